"""Optimizer step time on an fsdp2 model: fsdp2.optim.Muon vs torch.optim.Muon vs torch.optim.AdamW.

    python benchmarks/bench_optim.py --world-size 8                  # fake process group, rank 0 of 8, CPU
    python benchmarks/bench_optim.py --world-size 64
    python benchmarks/bench_optim.py --world-size 8 --device cuda    # the same on one GPU

The same GPT, sharded by fsdp2.fully_shard per block and at the root, gets fixed random
gradients; we time ``optimizer.step()`` alone. Implementations:

- ``fsdp2 Muon``: ``fsdp2.optim.Muon(muon_param_groups(model))``: hidden matrices by Muon (each
  orthogonalized once, on its owner rank), embeddings/head/vectors by its AdamW group;
- ``torch Muon``: ``torch.optim.Muon`` on the same matrices (DTensor shards: DTensor runs the
  Newton-Schulz matmuls sharded, with redistributions) + ``torch.optim.AdamW`` on the rest;
- ``torch AdamW``: ``torch.optim.AdamW`` on every parameter (the elementwise floor).

Each runs in a fresh process, rounds alternate the order, and we report the median over all
timed steps of wall ms and process CPU ms (on a shared machine CPU time moves less). In a fake
process group collectives do nothing (buffers keep garbage; denormals are flushed), so this
measures rank 0's compute and overhead, not communication; we also print rank 0's share of
the Newton-Schulz flops and the bytes it hands to all_to_all per step (fsdp2.tools.comm_stats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

IMPLS = ("fsdp2 Muon", "torch Muon", "torch AdamW")
# dim 128, 8 layers: 32 hidden matrices (4 shapes), enough to balance over 8 ranks; bf16 matmuls
# on a CPU without native bf16 are slow, so larger models make torch's step take minutes.
MODELS = {
    "small": dict(vocab_size=2048, seq_len=128, dim=128, n_layers=8, n_heads=4),
    "medium": dict(vocab_size=8192, seq_len=256, dim=512, n_layers=8, n_heads=8),
    "1b": dict(vocab_size=32000, seq_len=2048, dim=2048, n_layers=18, n_heads=16),
}


def _run(impl: str, args: dict) -> dict:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp2 import fully_shard
    from fsdp2.tools.comm_stats import count_comm
    from fsdp2.models import GPT, GPTConfig
    from fsdp2.optim import Muon, muon_param_groups
    from fsdp2.optim.muon import default_use_muon
    from fsdp2.optim.newton_schulz import newton_schulz_flops

    torch.set_num_threads(args["threads"])
    torch.set_flush_denormal(True)  # received buffers hold garbage in a fake world
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args["world_size"])
    device = torch.device(args["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
    cfg = GPTConfig(**MODELS[args["model"]])
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    mesh = init_device_mesh(device.type, (args["world_size"],))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g = torch.Generator(device=device).manual_seed(1)
    for p in model.parameters():
        local = torch.randn(p._local_tensor.shape, generator=g, device=device) * 1e-3
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )

    rule = default_use_muon(model)
    matrices = [p for n, p in model.named_parameters() if rule(n, p)]
    others = [p for n, p in model.named_parameters() if not rule(n, p)]
    if impl == "fsdp2 Muon":
        optimizers = [Muon(muon_param_groups(model), lr=0.02, adamw_lr=3e-4)]
    elif impl == "torch Muon":
        optimizers = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=3e-4, weight_decay=0.1)]
    else:
        optimizers = [torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)]

    def step():
        for opt in optimizers:
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args["warmup"]):
        step()
    wall, cpu = [], []
    for _ in range(args["steps"]):
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    with count_comm() as stats:
        step()
    result = {"wall": wall, "cpu": cpu, "all_to_all": stats.bytes["all_to_all"]}
    if impl == "fsdp2 Muon":
        total = sum(newton_schulz_flops(p.shape, 5) for p in matrices)
        result["ns_share"] = optimizers[0].newton_schulz_flops / (args["warmup"] + args["steps"] + 1) / total
        result["matrix_bytes_bf16"] = 2 * sum(p.numel() for p in matrices)
    dist.destroy_process_group()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--model", choices=list(MODELS), default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--impl", help=argparse.SUPPRESS)  # internal: run one implementation
    ns = parser.parse_args()
    args = {k: getattr(ns, k) for k in ("world_size", "model", "device", "steps", "warmup", "threads")}
    if ns.impl:
        print("RESULT " + json.dumps(_run(ns.impl, args)))
        return

    runs: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
    for round_ in range(ns.rounds):
        for impl in IMPLS if round_ % 2 == 0 else reversed(IMPLS):
            cmd = [sys.executable, os.path.abspath(__file__), "--impl", impl] + sys.argv[1:]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode or not lines:
                sys.exit(f"{impl} failed:\n{out.stdout}\n{out.stderr}")
            runs[impl].append(json.loads(lines[-1][len("RESULT ") :]))

    med = {
        impl: {k: 1e3 * statistics.median(x for r in rs for x in r[k]) for k in ("wall", "cpu")}
        for impl, rs in runs.items()
    }
    print(
        f"optimizer step, fake world {ns.world_size}, {ns.model} GPT, {ns.device}, {ns.threads} thread(s); "
        f"median of {ns.rounds} x {ns.steps} steps"
    )
    print(f"{'':14s} {'wall ms':>10s} {'CPU ms':>10s}   vs torch Muon (wall, CPU)   vs AdamW (wall, CPU)")
    for impl in IMPLS:
        m, muon, adamw = med[impl], med["torch Muon"], med["torch AdamW"]
        print(
            f"{impl:14s} {m['wall']:10.1f} {m['cpu']:10.1f}   "
            f"{m['wall'] / muon['wall']:10.2f}x {m['cpu'] / muon['cpu']:6.2f}x"
            f"   {m['wall'] / adamw['wall']:13.2f}x {m['cpu'] / adamw['cpu']:6.2f}x"
        )
    ours = runs["fsdp2 Muon"][0]
    print(
        f"fsdp2 Muon on rank 0: {ours['ns_share']:.3f} of the Newton-Schulz flops (1/N = {1 / ns.world_size:.3f}); "
        f"all_to_all {ours['all_to_all'] / 2**20:.2f} MiB/step (the matrices in bf16: "
        f"{ours['matrix_bytes_bf16'] / 2**20:.2f} MiB)"
    )


if __name__ == "__main__":
    main()
