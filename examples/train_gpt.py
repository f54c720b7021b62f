"""Train a small GPT with fsdp2 on CPU ranks, on the bytes of the Python sources that ship with torch.

    python examples/train_gpt.py --nproc 2 --steps 40 --save-every 20 --ckpt runs/ckpt
    python examples/train_gpt.py --nproc 2 --steps 40 --ckpt runs/ckpt --resume
    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 40      # the same, ranks started by torchrun
    python examples/train_gpt.py --nproc 2 --steps 200 --optimizer muon   # fsdp2.optim.Muon + AdamW
    python examples/train_gpt.py --nproc 2 --steps 300 --bf16 --all-gather int8   # low-precision all-gather
    python examples/train_gpt.py --nproc 2 --steps 100 --report-every 25   # tokens/s and memory per rank

Every rank trains on its own slice of each global batch; batches depend only on the step
number, so a resumed run sees exactly the batches the original run would have seen.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp2 import AllGatherPolicy, MixedPrecisionPolicy, fully_shard
from fsdp2.models import GPT, GPTConfig
from fsdp2.optim import Muon, muon_param_groups
from fsdp2.tools import local_bytes
from launch import init_process_group, launch

MiB = 2**20


def load_corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of torch's own .py files, in a fixed order: real text that needs no download."""
    root = Path(torch.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def global_batch(corpus: torch.Tensor, step: int, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch,), generator=g)
    windows = torch.stack([corpus[s : s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def memory_report(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes this rank holds for params, grads and optimizer state, vs one unsharded copy."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    full = sum(p.numel() * p.element_size() for p in params)
    return {
        "params": local_bytes(params),
        "grads": local_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": local_bytes(state),
        "unsharded_params": full,
        # params + grads + the optimizer's state, unsharded (DTensor numel is the global one)
        "unsharded_total": 2 * full + sum(v.numel() * v.element_size() for v in state),
    }


def peak_memory() -> int:
    """This process's peak memory in bytes: the allocator's on an accelerator, resident set size on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class ThroughputReport:
    """Every ``every`` steps: tokens/s over those steps and each rank's memory (a collective: all ranks call it)."""

    def __init__(self, every: int, tokens_per_step: int):
        self.every, self.tokens_per_step = every, tokens_per_step
        self.window_start = time.perf_counter()

    def after_step(self, step: int, rank: int, model, optimizer) -> None:
        if not self.every or step % self.every:
            return
        seconds = time.perf_counter() - self.window_start
        mem = memory_report(model, optimizer)
        mine = (mem["params"] + mem["grads"] + mem["optimizer"], peak_memory())
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        if rank == 0:
            ranks = "; ".join(
                f"rank {r}: state {held / MiB:.1f} MiB, peak {peak / MiB:.0f} MiB"
                for r, (held, peak) in enumerate(per_rank)
            )
            print(f"step {step:4d}  {self.every * self.tokens_per_step / seconds:,.0f} tokens/s  {ranks}")
        self.window_start = time.perf_counter()  # the report's own collective is not counted


def run(rank: int, args: argparse.Namespace, port: int | None) -> None:
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use.*")
    args.nproc = init_process_group(rank, args.nproc, port)  # torchrun decides the world size itself
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    if args.ckpt:
        from fsdp2 import checkpoint

    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, dim=args.dim, n_layers=args.layers, n_heads=args.heads)
    torch.manual_seed(0)
    model = GPT(cfg)
    mp_policy = MixedPrecisionPolicy()
    if args.bf16:
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    if args.all_gather:
        qdtype = {"int8": torch.int8, "float8": torch.float8_e4m3fn}[args.all_gather]
        model.set_all_gather_policy(AllGatherPolicy(qdtype))  # every group; 1-D parameters stay exact
    if args.optimizer == "muon":
        # Hidden matrices by Muon (each orthogonalized once, on its owner rank); embeddings,
        # head, biases and norms by the optimizer's AdamW group with the AdamW run's settings.
        optimizer = Muon(
            muon_param_groups(model), lr=args.muon_lr, weight_decay=0.01, adamw_lr=args.lr, adamw_weight_decay=0.1
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    start_step = 0
    if args.resume:
        extra = checkpoint.load(args.ckpt, model, optimizer)
        start_step = extra["step"]
        if rank == 0:
            print(f"resumed from {args.ckpt} at step {start_step}")

    corpus = load_corpus(args.corpus_mb * MiB)
    if rank == 0:
        print(
            f"corpus: {corpus.numel() / MiB:.1f} MiB of torch's Python sources; "
            f"model: {cfg.num_params() / 1e6:.2f}M params; {args.nproc} ranks"
        )
    rows = slice(rank * args.batch, (rank + 1) * args.batch)
    losses = {}
    throughput = ThroughputReport(args.report_every, args.batch * args.nproc * cfg.seq_len)
    for step in range(start_step, args.steps):
        t0 = time.perf_counter()
        tokens, targets = global_batch(corpus, step, args.batch * args.nproc, cfg.seq_len)
        loss = model.loss(tokens[rows], targets[rows])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses[step + 1] = mean_loss.item() / args.nproc
        if rank == 0:
            print(f"step {step + 1:4d}  loss {losses[step + 1]:.4f}  {time.perf_counter() - t0:.2f}s")
        if args.ckpt and (step + 1) % args.save_every == 0 and not args.resume:
            checkpoint.save(f"{args.ckpt}/step-{step + 1}", model, optimizer, extra={"step": step + 1})
            if rank == 0:
                print(f"saved {args.ckpt}/step-{step + 1}")
        throughput.after_step(step + 1, rank, model, optimizer)

    mem = memory_report(model, optimizer)
    reports = [None] * args.nproc
    dist.all_gather_object(reports, mem)
    if rank == 0:
        for r, m in enumerate(reports):
            held = m["params"] + m["grads"] + m["optimizer"]
            print(
                f"rank {r}: params {m['params'] / MiB:.2f} + grads {m['grads'] / MiB:.2f}"
                f" + optimizer {m['optimizer'] / MiB:.2f}"
                f" = {held / MiB:.2f} MiB vs {m['unsharded_total'] / MiB:.2f} MiB unsharded"
                f" ({held / m['unsharded_total']:.2f}x)"
            )
        if args.losses_out:
            Path(args.losses_out).write_text(json.dumps(losses))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="CPU ranks to spawn (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's lr (and Muon's AdamW group's)")
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    parser.add_argument("--muon-lr", type=float, default=0.02, help="lr of the Muon matrices")
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 parameters for compute and all-gather, fp32 reduction"
    )
    parser.add_argument(
        "--all-gather", choices=["int8", "float8"], help="all-gather parameters quantized (AllGatherPolicy)"
    )
    parser.add_argument("--corpus-mb", type=int, default=8)
    parser.add_argument("--ckpt", default="", help="checkpoint directory (save under it, or resume from it)")
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--resume", action="store_true", help="load --ckpt and continue to --steps")
    parser.add_argument("--losses-out", default="", help="write {step: loss} JSON here")
    parser.add_argument(
        "--report-every",
        type=int,
        default=10,
        metavar="N",
        help="every N steps: tokens/s (all ranks) and each rank's memory (default 10; 0: never)",
    )
    args = parser.parse_args()
    launch(run, args, args.nproc)


if __name__ == "__main__":
    main()
