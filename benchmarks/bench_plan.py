"""fsdp2.plan's predictions against measurements: memory, communication bytes, step time.

    python benchmarks/bench_plan.py --memory                  # fake process groups of 8/64/1024 ranks (CPU)
    python benchmarks/bench_plan.py --comm                    # 4 gloo ranks: counted vs predicted bytes
    python benchmarks/bench_plan.py --compute --device cuda --model gpt-1b --seq-len 2048 --micro-batches 1,2,4,8

--memory: for each strategy fsdp2 can run (FSDP, ZeRO-2, HSDP, FSDP+TP, HSDP+TP; DDP as torch DDP),
the planner's predicted peak next to the CPU allocator's peak of one real step on rank 0 of a
fake process group (fsdp2.tools.memory_meter; params + optimizer state held + the step's peak).

--comm: bytes fsdp2 hands to its collectives (fsdp2.tools.comm_stats.count_comm), DTensor's
TP all-reduces and torch DDP's bucket all-reduces in one step on 4 gloo ranks, next to the plan.

--compute: calibrate the achievable rate from one step of the model cut to 2 blocks, then
predict the world-size-1 step time of the whole model at several micro-batch sizes and measure
fsdp2's real step (fully_shard on one rank) on the same device.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsdp2.models import LlamaConfig  # noqa: E402
from fsdp2.plan import Cluster, Precision, model_source, plan  # noqa: E402
from fsdp2.plan.apply import apply, device_mesh  # noqa: E402
from fsdp2.plan.model_source import from_config  # noqa: E402

MiB = 2**20
BENCH_MODEL = LlamaConfig(vocab_size=2048, seq_len=128, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, hidden_dim=688)
SEQ, MICRO = 128, 4
MEMORY_CASES = {
    8: ["DDP", "ZeRO-2", "FSDP", "HSDP 2x4", "FSDP+TP 4x2", "HSDP+TP 2x2x2"],
    64: ["FSDP", "HSDP 8x8", "FSDP+TP 32x2", "FSDP+TP 16x4", "HSDP+TP 4x8x2"],
    1024: ["FSDP", "HSDP 128x8", "FSDP+TP 512x2", "HSDP+TP 2x256x2"],
}


def _measure_memory(world: int, name: str, ac: bool, precision: Precision, source) -> tuple[int, int]:
    from fsdp2.plan.apply import predicted_and_measured_peak

    result, measured = predicted_and_measured_peak(
        source, name, gpus=world, seq_len=SEQ, micro_batch=MICRO, precision=precision, activation_checkpointing=ac
    )
    return result.memory.peak, measured


def run_memory(ac: bool) -> None:
    from torch.distributed.tensor import debug
    from torch.testing._internal.distributed.fake_pg import FakeStore

    source = from_config(BENCH_MODEL, "bench-llama")
    print(f"model: {BENCH_MODEL}, micro-batch {MICRO} x {SEQ}, AdamW, activation checkpointing {ac}")
    print("| world | strategy | precision | predicted MiB | measured MiB | measured / predicted |")
    print("|---:|---|---|---:|---:|---:|")
    for world, names in MEMORY_CASES.items():
        for name in names:
            # torch DDP runs fp32 here: with bf16 it needs autocast, which the planner does not model exactly
            precision = Precision(None, None) if name == "DDP" else Precision()
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            try:
                predicted, measured = _measure_memory(world, name, ac, precision, source)
            finally:
                dist.destroy_process_group()
                getattr(debug, "_clear_sharding_prop_cache", debug._clear_python_sharding_prop_cache)()
            print(
                f"| {world} | {name} | {precision.describe()} | {predicted / MiB:.2f} | {measured / MiB:.2f} | "
                f"{measured / predicted:.4f} |",
                flush=True,
            )


def _comm_worker(rank: int, world: int, port: int, names: list[str], queue) -> None:
    from fsdp2.plan.apply import count_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    source = from_config(BENCH_MODEL, "bench-llama")
    precision = Precision(None, None)  # gloo: fp32 activations for TP's all-reduces
    rows = []
    for name in names:
        result = plan(
            source,
            seq_len=SEQ,
            micro_batch=MICRO,
            cluster=Cluster(gpus=world, gpus_per_node=2),
            strategies=[name],
            precision=precision,
        ).result(name)
        counted = count_bytes(result.strategy, source, seq_len=SEQ, micro_batch=MICRO, precision=precision)
        rows.append((name, result.comm.per_micro_step(), counted))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def run_comm() -> None:
    import torch.multiprocessing as mp

    names = ["DDP", "ZeRO-2", "FSDP", "HSDP 2x2", "FSDP+TP 2x2"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_comm_worker, args=(r, 4, port, names, queue)) for r in range(4)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=900)
    for p in procs:
        p.join()
    print(f"model: {BENCH_MODEL}, micro-batch {MICRO} x {SEQ}, fp32, 4 gloo ranks, one forward + backward")
    print("| strategy | kind | predicted MiB | counted MiB | equal |")
    print("|---|---|---:|---:|---|")
    for name, predicted, counted in rows:
        for kind in ("all_gather", "reduce_scatter", "all_reduce", "tensor_parallel", "ddp_all_reduce"):
            if predicted[kind] or counted[kind]:
                label = {"tensor_parallel": "TP all-reduce (DTensor)", "ddp_all_reduce": "DDP bucket all-reduce"}.get(
                    kind, kind
                )
                print(
                    f"| {name} | {label} | {predicted[kind] / MiB:.3f} | {counted[kind] / MiB:.3f} | "
                    f"{'yes' if predicted[kind] == counted[kind] else 'NO'} |"
                )


def run_compute(args) -> None:
    from fsdp2.plan.calibrate import calibrate
    from fsdp2.plan.strategies import Kind as K, Strategy

    source = model_source(args.model)
    precision = Precision(None, None) if args.fp32 else Precision()
    micro_batches = [int(m) for m in args.micro_batches.split(",")]
    cal = calibrate(
        source,
        seq_len=args.seq_len,
        micro_batch=micro_batches[len(micro_batches) // 2],
        precision=precision,
        device=args.device,
        layers=args.calibrate_layers,
        steps=args.calibrate_steps,
    )
    cluster = cal.apply(Cluster(gpus=1, gpus_per_node=1))
    print(f"calibrated: {cal.tflops:.3g} TFLOP/s, optimizer {cal.hbm_gbps:.3g} GB/s ({cal.description})")
    device = torch.device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    strategy = Strategy(K.FSDP, 1, 1)
    print(
        f"| model | micro-batch x seq | predicted step ms | measured step ms (median of {args.steps}) | "
        "measured / predicted |"
    )
    print("|---|---|---:|---:|---:|")
    try:
        for micro in micro_batches:
            predicted = (
                plan(
                    source,
                    seq_len=args.seq_len,
                    micro_batch=micro,
                    precision=precision,
                    cluster=cluster,
                    strategies=["FSDP"],
                )
                .result("FSDP")
                .time.seconds
            )
            with torch.device(device):
                torch.manual_seed(0)
                model = source.build(args.seq_len)
            apply(model, strategy, device_mesh(strategy, device.type), source=source, mp_policy=precision.policy())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            x, y = source.inputs(micro, args.seq_len, device)
            times = []
            for i in range(args.warmup + args.steps):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                source.loss(model, x, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            measured = sorted(times)[len(times) // 2]
            print(
                f"| {source.name} | {micro} x {args.seq_len} | {predicted * 1e3:.1f} | {measured * 1e3:.1f} | "
                f"{measured / predicted:.3f} |",
                flush=True,
            )
            del model, opt
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory", action="store_true")
    p.add_argument("--ac", action="store_true", help="--memory with activation checkpointing")
    p.add_argument("--comm", action="store_true")
    p.add_argument("--compute", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="gpt-1b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batches", default="1,2,4")
    p.add_argument("--calibrate-layers", type=int, default=2)
    p.add_argument("--calibrate-steps", type=int, default=1, help="measured calibration steps (the fastest counts)")
    p.add_argument("--fp32", action="store_true")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    if not (args.memory or args.comm or args.compute):
        p.error("choose --memory, --comm or --compute")
    if args.memory:
        run_memory(args.ac)
    if args.comm:
        run_comm()
    if args.compute:
        run_compute(args)


if __name__ == "__main__":
    main()
