"""Cost of the low-precision all-gather's quantize / dequantize against the copies a bf16 all-gather makes.

    python benchmarks/bench_quantize.py                        # CPU, 1 thread, eager and compiled
    python benchmarks/bench_quantize.py --device cuda          # GPU: CUDA-event timing, Triton kernels

One rank's all-gather slot of --numel elements (fp32 master shard) and the --world gathered rows:

- before the collective, a bf16 all-gather cast-copies the shard into its bf16 slot; the
  quantized one runs ``quantize_into`` (fp32 shard -> values + scales);
- after it, the bf16 path copies ``world x numel`` gathered bf16 rows into the unsharded
  parameter; the quantized one runs ``dequantize_from`` (uint8 rows -> bf16 parameter).

Ratios are against those copies (the floor: any all-gather pays them). Best of --repeats (on a
shared machine the least disturbed run); CPU: process CPU time, GPU: CUDA events.
"""

from __future__ import annotations

import argparse
import time

import torch

from fsdp2 import AllGatherPolicy
from fsdp2.runtime.quantize import dequantize_from, quantize_into, wire_bytes


def _timer(device: torch.device):
    if device.type == "cuda":

        def timed(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

    else:
        # Process CPU time: what the work costs, which other load on a shared machine moves little.

        def timed(fn) -> float:
            t0 = time.process_time()
            fn()
            return (time.process_time() - t0) * 1e3

    return timed


def _best_ms(fn, timed, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    return min(timed(fn) for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--numel", type=int, default=4 * 2**20, help="elements in one rank's slot")
    ap.add_argument("--world", type=int, default=8, help="gathered rows to dequantize")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--scale-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (one per rank in training)")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    timed = _timer(device)
    n, world = args.numel, args.world
    shard = torch.randn(n, device=device)
    bf16_slot = torch.empty(n, dtype=torch.bfloat16, device=device)
    bf16_rows = torch.randn(world, n, device=device).to(torch.bfloat16)
    unsharded = torch.empty(world, n, dtype=torch.bfloat16, device=device)
    copy_in = _best_ms(lambda: bf16_slot.copy_(shard), timed, args.repeats)
    copy_out = _best_ms(lambda: unsharded.copy_(bf16_rows), timed, args.repeats)
    print(
        f"device={device} numel/rank={n} world={world} block={args.block_size} scales={args.scale_dtype} "
        f"threads={args.threads} torch={torch.__version__}"
    )
    print(f"bf16 floor: copy-in {copy_in:.3f} ms, copy-out {copy_out:.3f} ms")
    print(
        "| dtype | mode | quantize ms | vs copy-in | dequantize ms | vs copy-out | both vs both copies | "
        "wire / bf16 bytes |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    modes = {"eager": (quantize_into, dequantize_from)}
    if not args.no_compile:
        modes["compiled"] = (
            torch.compile(quantize_into, fullgraph=True),
            torch.compile(dequantize_from, fullgraph=True),
        )
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        policy = AllGatherPolicy(qdtype, args.block_size, getattr(torch, args.scale_dtype))
        w = wire_bytes(n, policy)
        wire = torch.empty(w, dtype=torch.uint8, device=device)
        quantize_into(shard, wire, policy)
        gathered = wire.expand(world, w).contiguous()
        for mode, (quantize, dequantize) in modes.items():
            q = _best_ms(lambda: quantize(shard, wire, policy), timed, args.repeats)
            d = _best_ms(lambda: dequantize(gathered, unsharded, policy), timed, args.repeats)
            print(
                f"| {str(qdtype).removeprefix('torch.')} | {mode} | {q:.3f} | {q / copy_in:.2f}x | {d:.3f} | "
                f"{d / copy_out:.2f}x | {(q + d) / (copy_in + copy_out):.2f}x | {w / (2 * n):.4f} |"
            )


if __name__ == "__main__":
    main()
