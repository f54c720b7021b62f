"""Run a planned strategy: its device mesh, and the model sharded as the planner modelled it.

    mesh = device_mesh(strategy, "cuda")                  # every rank, after init_process_group
    model = apply(model, strategy, mesh, source=source, mp_policy=precision.policy())

    peak = measure_peak(strategy, source, seq_len=..., micro_batch=..., precision=...)   # what the plan predicts
    result, peak = predicted_and_measured_peak(source, "FSDP", gpus=8, seq_len=..., ...)  # both, one workload
    counted = count_bytes(strategy, source, seq_len=..., micro_batch=..., precision=...)  # per micro-step

Used by ``--calibrate``, by the tests that check the predictions against measured runs, and by
benchmarks/bench_plan.py. fsdp2 has no DDP: ``apply`` wraps DDP strategies in torch's
``DistributedDataParallel``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp2 import compat
from fsdp2.compat import TorchDispatchMode
from fsdp2.plan.model_source import ModelSource
from fsdp2.plan.strategies import Kind, Strategy
from fsdp2.policies import AllGatherPolicy, MixedPrecisionPolicy
from fsdp2.runtime.fully_shard import fully_shard


def device_mesh(strategy: Strategy, device_type: str) -> DeviceMesh:
    """The (replicate, shard, tp) mesh of ``strategy`` with its size-1 dims left out."""
    dims = [("replicate", strategy.replicate), ("shard", strategy.shard), ("tp", strategy.tp)]
    if strategy.kind is Kind.DDP:
        dims = [("replicate", strategy.replicate)]
    kept = [(name, size) for name, size in dims if size > 1] or [("shard", 1)]
    return init_device_mesh(
        device_type, tuple(size for _, size in kept), mesh_dim_names=tuple(name for name, _ in kept)
    )


def _data_parallel_mesh(strategy: Strategy, mesh: DeviceMesh) -> DeviceMesh:
    names = [n for n in ("replicate", "shard") if n in mesh.mesh_dim_names]
    return mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]


def apply(
    model: nn.Module,
    strategy: Strategy,
    mesh: DeviceMesh,
    *,
    source: ModelSource,
    mp_policy: MixedPrecisionPolicy | None = None,
    all_gather_policy: AllGatherPolicy | None = None,
) -> nn.Module:
    """Shard ``model`` (built by ``source``) as ``strategy`` says; returns the model to train.
    ``all_gather_policy``: set on every group (a low-precision all-gather)."""
    if strategy.kind is Kind.DDP:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    dp_mesh = _data_parallel_mesh(strategy, mesh)
    plan = source.tp_plan() if strategy.tp > 1 else None
    if strategy.tp > 1 and plan is None:
        raise ValueError(f"{strategy.name}: {source.name} has no tensor-parallel plan")
    mp_policy = mp_policy or MixedPrecisionPolicy()
    for block in [m for m in model.modules() if source.is_block(m)]:
        if plan is not None:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=strategy.reshard_after_forward)
    sharded = fully_shard(
        model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=strategy.reshard_after_forward
    )
    if all_gather_policy is not None:
        sharded.set_all_gather_policy(all_gather_policy)
    return sharded


def measure_peak(
    strategy: Strategy,
    source: ModelSource,
    *,
    seq_len: int,
    micro_batch: int,
    precision,
    activation_checkpointing: bool = False,
    device: str = "cpu",
) -> int:
    """Bytes one rank holds at the peak of a training step of ``strategy``: what the planner's
    ``memory.peak`` predicts. Collective over the current process group (``strategy.gpus`` ranks;
    a fake one simulates rank 0).

    Parameters + optimizer state held between steps (+ DDP's gradient buckets) + the allocator's
    peak over one step (forward, backward, ``optimizer.step()``, ``zero_grad``), after a warm-up
    step (two for DDP, which rebuilds its buckets in the second).
    """
    from fsdp2.plan.model_source import checkpoint_blocks
    from fsdp2.tools.estimate import local_bytes, optimizer_state_bytes
    from fsdp2.tools.memory_meter import PeakMemory

    torch.manual_seed(0)
    with torch.device(device):
        model = source.build(seq_len)
    if activation_checkpointing:
        checkpoint_blocks(model, source.is_block)
    mesh = device_mesh(strategy, torch.device(device).type)
    with PeakMemory(device) as construction:
        trained = apply(
            model,
            strategy,
            mesh,
            source=source,
            mp_policy=precision.policy(),
            all_gather_policy=precision.all_gather_policy(),
        )
    buckets = construction.net_bytes if strategy.kind is Kind.DDP else 0
    warmup = 2 if strategy.kind is Kind.DDP else 1
    if strategy.kind is Kind.DDP and dist.get_backend() == "fake":
        trained.register_comm_hook(None, _bucket_back)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    tokens, targets = source.inputs(micro_batch, seq_len, device)

    def step() -> None:
        source.loss(trained, tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    with PeakMemory(device) as meter:
        step()
    return local_bytes(trained.parameters()) + optimizer_state_bytes(optimizer) + buckets + meter.peak_bytes


def predicted_and_measured_peak(
    source: ModelSource,
    strategy: str,
    *,
    gpus: int,
    seq_len: int,
    micro_batch: int,
    precision,
    activation_checkpointing: bool = False,
    device: str = "cpu",
):
    """The planner's result for the strategy named ``strategy`` on ``gpus`` ranks, and the peak
    :func:`measure_peak` measures in a real step of it with the same workload. The measurement runs
    on ``device``'s kernels, so the prediction counts their scratch there too."""
    from fsdp2.plan.cluster import Cluster
    from fsdp2.plan.planner import plan

    result = plan(
        source,
        seq_len=seq_len,
        micro_batch=micro_batch,
        cluster=Cluster(gpus=gpus),
        strategies=[strategy],
        activation_checkpointing=activation_checkpointing,
        precision=precision,
        kernel_scratch=device,
    ).result(strategy)
    measured = measure_peak(
        result.strategy,
        source,
        seq_len=seq_len,
        micro_batch=micro_batch,
        precision=precision,
        activation_checkpointing=activation_checkpointing,
        device=device,
    )
    return result, measured


def _bucket_back(state, bucket):
    """A fake process group's all-reduce returns no tensor, which DDP's reducer needs: hand the bucket back."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def count_bytes(
    strategy: Strategy, source: ModelSource, *, seq_len: int, micro_batch: int, precision, device: str = "cpu"
) -> dict[str, int]:
    """Bytes one rank hands to collectives in one forward + backward of ``strategy``: fsdp2's as
    ``count_comm`` counts them (``all_gather``, ``reduce_scatter``, ``all_reduce``), DTensor's
    tensor-parallel all-reduces (``tensor_parallel``) and torch DDP's bucket all-reduces
    (``ddp_all_reduce``). Collective over the current process group (``strategy.gpus`` ranks)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from fsdp2.tools.comm_stats import count_comm

    torch.manual_seed(0)
    with torch.device(device):
        model = source.build(seq_len)
    trained = apply(
        model,
        strategy,
        device_mesh(strategy, torch.device(device).type),
        source=source,
        mp_policy=precision.policy(),
        all_gather_policy=precision.all_gather_policy(),
    )
    ddp = [0]
    if strategy.kind is Kind.DDP:

        def count_bucket(state, bucket):
            ddp[0] += bucket.buffer().numel() * bucket.buffer().element_size()
            return default_hooks.allreduce_hook(state, bucket)

        trained.register_comm_hook(None, count_bucket)
    tokens, targets = source.inputs(micro_batch, seq_len, device)
    with count_comm() as stats, _FunctionalAllReduceBytes() as tensor_parallel:
        source.loss(trained, tokens, targets).backward()
    return {**stats.bytes, "tensor_parallel": tensor_parallel.bytes, "ddp_all_reduce": ddp[0]}


class _FunctionalAllReduceBytes(TorchDispatchMode):
    """Bytes handed to functional all-reduces: DTensor's (TP); fsdp2 calls c10d directly."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is compat.functional_all_reduce():
            self.bytes += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))
