"""Predicted step time of the low-precision all-gather at scale: bf16 vs int8 vs float8 all-gathers.

    python benchmarks/predict_all_gather.py                  # 1B GPT and 8B Llama, 64 and 1024 GPUs
    python benchmarks/predict_all_gather.py --compute-1b 0.21 --compute-8b 1.6   # measured compute (s)

Bytes are exact: ``fsdp2.tools.estimate.estimate_memory`` on a meta model gives each group's
all-gather and reduce-scatter buffer bytes as fsdp2 lays them out (equal to ``count_comm``,
tests/runtime/test_lowp_gather.py), with bf16 parameters and fp32 gradient reduction, blocks freed after
forward and the root kept (fully_shard's default). The rest is a model, per GPU and step:

    T(S)      = (W - 1) * a + S * (W - 1) / W / B             one ring collective of buffer S bytes
    C         = (6 N + 12 L d s) * tokens / (MFU * peak)       compute; forward C/3, backward 2C/3
    fwd       = max(C / 3, sum_blocks T(AG_b))                 block all-gathers overlap forward compute
    bwd       = max(2 C / 3, sum_blocks T(AG_b) + T(RS_b))     re-gathers and reductions overlap backward
    exposed   = T(AG_root) + T(RS_root)                        the root's gather starts the step, its reduction ends it
    quant     = Q * 3 bytes / HBM                              eager dequantize (7 B/elem) vs the copy \
it replaces (4 B/elem)
    step      = fwd + bwd + exposed + quant

W GPUs at 8 per node; B = 400 Gb/s = 50 GB/s per GPU between nodes (a flat ring's bus bandwidth
is the per-GPU NIC); a = 5 us per ring hop; H100 bf16 dense peak 989 TFLOP/s at MFU 0.40 unless
--compute-* gives measured compute seconds (e.g. the unsharded row of ``bench_fsdp.py --mode gpu``
scaled to the batch); HBM 3.35 TB/s; Q the quantized elements gathered per step (blocks twice,
the root once). The quantize pass itself reads a 1/W shard: negligible at these W.
"""

from __future__ import annotations

import argparse

import torch

GB = 1e9


def _models():
    from fsdp2.models import GPT, GPTConfig, Llama, LlamaConfig
    from fsdp2.models.gpt import Block
    from fsdp2.models.llama import Block as LlamaBlock

    gpt = GPTConfig(vocab_size=32000, seq_len=2048, dim=2048, n_layers=18, n_heads=16)  # bench_fsdp's "1b"
    llama = LlamaConfig(vocab_size=32000, seq_len=2048, dim=4096, n_layers=32, n_heads=32, hidden_dim=14336)
    return {
        "1B GPT": (lambda: GPT(gpt), Block, gpt.n_layers, gpt.dim, gpt.seq_len),
        "8B Llama": (lambda: Llama(llama), LlamaBlock, llama.n_layers, llama.dim, llama.seq_len),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="64,1024")
    ap.add_argument("--batch", type=int, default=4, help="sequences per GPU")
    ap.add_argument("--link-gbps", type=float, default=400.0)
    ap.add_argument("--hop-us", type=float, default=5.0)
    ap.add_argument("--mfu", type=float, default=0.40)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--hbm-tbps", type=float, default=3.35)
    ap.add_argument("--reduce-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--compute-1b", type=float, default=None, help="measured compute seconds per step, 1B")
    ap.add_argument("--compute-8b", type=float, default=None, help="measured compute seconds per step, 8B")
    args = ap.parse_args()

    from fsdp2 import AllGatherPolicy, MixedPrecisionPolicy
    from fsdp2.tools.estimate import estimate_memory

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, args.reduce_dtype))
    settings = {"bf16": None, "int8": AllGatherPolicy(torch.int8), "float8": AllGatherPolicy(torch.float8_e4m3fn)}
    bandwidth = args.link_gbps / 8 * GB
    measured = {"1B GPT": args.compute_1b, "8B Llama": args.compute_8b}
    print(
        f"# B={args.link_gbps:g} Gb/s per GPU, hop latency {args.hop_us:g} us, batch {args.batch} x seq per GPU, "
        f"compute at MFU {args.mfu} of {args.peak_tflops:g} TFLOP/s unless measured; "
        f"bf16 params, {args.reduce_dtype} reduce"
    )
    print(
        "| model | GPUs | all-gather | AG GB/step | RS GB/step | compute s | comm fwd s | comm bwd s | exposed s | "
        "quant s | step s | vs bf16 |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (build, block, layers, dim, seq) in _models().items():
        with torch.device("meta"):
            model = build()
        n = sum(p.numel() for p in model.parameters())
        tokens = args.batch * seq
        compute = measured[name] or (6 * n + 12 * layers * dim * seq) * tokens / (args.mfu * args.peak_tflops * 1e12)
        matrices = lambda module: sum(p.numel() for p in module.parameters() if p.ndim >= 2)  # noqa: E731
        in_blocks = sum(matrices(m) for m in model.modules() if isinstance(m, block))
        quantized_per_step = 2 * in_blocks + (matrices(model) - in_blocks)  # blocks re-gathered in backward
        for world in (int(w) for w in args.gpus.split(",")):
            base = None
            for setting, policy in settings.items():
                est = estimate_memory(
                    model, world, groups=lambda m: isinstance(m, block), mp_policy=mp, all_gather_policy=policy
                )

                def t(nbytes: int) -> float:
                    return (world - 1) * args.hop_us * 1e-6 + nbytes * (world - 1) / world / bandwidth

                root, blocks = est.groups[0], est.groups[1:]
                fwd_comm = sum(t(g.all_gather_bytes) for g in blocks)
                bwd_comm = sum(t(g.all_gather_bytes) + t(g.reduce_scatter_input_bytes) for g in blocks)
                exposed = t(root.all_gather_bytes) + t(root.reduce_scatter_input_bytes)
                quant = 0.0 if policy is None else quantized_per_step * 3 / (args.hbm_tbps * 1e12)
                step = max(compute / 3, fwd_comm) + max(2 * compute / 3, bwd_comm) + exposed + quant
                base = base or step
                comm = est.comm_bytes_per_step
                print(
                    f"| {name} ({n / 1e9:.2f}B) | {world} | {setting} | {comm['all_gather'] / GB:.2f} | "
                    f"{comm['reduce_scatter'] / GB:.2f} | {compute:.3f} | {fwd_comm:.3f} | {bwd_comm:.3f} | "
                    f"{exposed:.3f} | {quant:.4f} | {step:.3f} | {step / base:.2f}x |"
                )


if __name__ == "__main__":
    main()
