"""Measure the achievable compute rate (and HBM rate) from one real fsdp2 step at world size 1.

    cal = calibrate(model_source("gpt-1b"), seq_len=2048, micro_batch=4, device="cuda")
    cluster = cal.apply(Cluster(gpus=64))          # tflops and hbm_gbps measured

The model runs as fsdp2 runs it on one rank (``fully_shard`` on a one-rank mesh: no
collectives), cut to ``layers`` blocks when its source can (``--calibrate-layers``) so a model
too large for one device still calibrates on its own layer shapes. One warm-up step, then
``steps`` measured ones (the fastest counts):

    rate = FLOPs of forward + backward (counted on the meta dry run) / forward + backward seconds
    HBM  = bytes the optimizer step touches (as the planner counts them) / optimizer seconds
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp2.plan.apply import apply, device_mesh
from fsdp2.plan.cluster import Cluster
from fsdp2.plan.model_source import ModelSource
from fsdp2.plan.results import Precision
from fsdp2.plan.strategies import Kind, Strategy
from fsdp2.tools.estimate import estimate_memory, trace_step


@dataclass
class Calibration:
    tflops: float  # achieved TFLOP/s in forward + backward
    hbm_gbps: float  # achieved GB/s of the optimizer step
    forward_backward_s: float
    optimizer_s: float
    flops: int  # of one forward + backward
    description: str

    def apply(self, cluster: Cluster) -> Cluster:
        return dataclasses.replace(cluster, tflops=self.tflops, hbm_gbps=self.hbm_gbps, calibrated=self.description)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrate(
    source: ModelSource,
    *,
    seq_len: int,
    micro_batch: int,
    precision: Precision = Precision(),
    device: str = "cuda",
    layers: int | None = 2,
    steps: int = 1,
    activation_checkpointing: bool = False,
) -> Calibration:
    from fsdp2.plan.model_source import checkpoint_blocks

    device_t = torch.device(device)
    if device_t.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("calibrate(device='cuda'): no CUDA device here; pass device='cpu' to calibrate this CPU")
    proxy = source.with_layers(layers) if layers and source.with_layers is not None else source
    created_group = not dist.is_initialized()
    if created_group:
        backend = "nccl" if device_t.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        strategy = Strategy(Kind.FSDP, 1, 1)
        meta = proxy.meta_model(seq_len)
        if activation_checkpointing:
            checkpoint_blocks(meta, proxy.is_block)
        trace = trace_step(
            meta,
            groups=proxy.is_block,
            mp_policy=precision.policy(),
            sample_input=proxy.inputs(micro_batch, seq_len),
            loss_fn=proxy.loss,
        )
        est = estimate_memory(meta, 1, groups=proxy.is_block, mp_policy=precision.policy())
        with torch.device(device_t):
            torch.manual_seed(0)
            model = proxy.build(seq_len)
        if activation_checkpointing:
            checkpoint_blocks(model, proxy.is_block)
        apply(model, strategy, device_mesh(strategy, device_t.type), source=proxy, mp_policy=precision.policy())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens, targets = proxy.inputs(micro_batch, seq_len, device_t)
        timings = []
        for _ in range(1 + steps):
            _sync(device_t)
            t0 = time.perf_counter()
            proxy.loss(model, tokens, targets).backward()
            _sync(device_t)
            t1 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device_t)
            timings.append((t1 - t0, time.perf_counter() - t1))
        forward_backward = min(t for t, _ in timings[1:])
        optimizer_s = min(t for _, t in timings[1:])
    finally:
        if created_group:
            dist.destroy_process_group()
    touched = 2 * est.sharded_params + est.sharded_grads + 2 * est.optimizer_state
    name = torch.cuda.get_device_name(device_t) if device_t.type == "cuda" else "CPU"
    return Calibration(
        tflops=trace.flops / forward_backward / 1e12,
        hbm_gbps=touched / optimizer_s / 1e9,
        forward_backward_s=forward_backward,
        optimizer_s=optimizer_s,
        flops=trace.flops,
        description=f"measured on {name}: {proxy.name}, micro-batch {micro_batch} x {seq_len}",
    )
