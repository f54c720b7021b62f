"""Train a Llama-style model with tensor parallel + fsdp2 on a 2-D (dp, tp) mesh of CPU ranks.

    python examples/train_llama_2d.py --dp 2 --tp 2 --steps 20
    torchrun --nproc-per-node 4 examples/train_llama_2d.py --dp 2 --tp 2 --steps 20

TP (``parallelize_module``) splits attention heads and MLP hidden units over the 'tp' dim;
fully_shard then shards every parameter over the 'dp' dim. Order matters: TP first, then FSDP.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from fsdp2 import clip_grad_norm_, fully_shard
from fsdp2.models import Llama, LlamaConfig, tensor_parallel_plan
from launch import init_process_group, launch
from train_gpt import MiB, global_batch, load_corpus


def run(rank: int, args: argparse.Namespace, port: int | None) -> None:
    warnings.filterwarnings("ignore")
    # DTensor logs a hint each time a norm reduces over two mesh dims; harmless at this size.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    world = init_process_group(rank, args.dp * args.tp, port)
    if world != args.dp * args.tp:
        raise SystemExit(f"--dp {args.dp} x --tp {args.tp} needs {args.dp * args.tp} ranks; torchrun started {world}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    cfg = LlamaConfig(vocab_size=256, seq_len=args.seq_len, dim=args.dim, n_layers=args.layers, n_heads=args.heads)
    torch.manual_seed(0)
    model = Llama(cfg)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], tensor_parallel_plan())
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    corpus = load_corpus(8 * MiB)
    dp_rank = mesh["dp"].get_local_rank()
    rows = slice(dp_rank * args.batch, (dp_rank + 1) * args.batch)
    for step in range(args.steps):
        t0 = time.perf_counter()
        tokens, targets = global_batch(corpus, step, args.batch * args.dp, cfg.seq_len)
        loss = model.loss(tokens[rows], targets[rows])  # TP peers see the same rows
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(
                f"step {step + 1:3d}  loss {mean_loss.item() / world:.4f}  grad-norm {norm.item():.3f}  "
                f"{time.perf_counter() - t0:.2f}s"
            )
    if rank == 0:
        wq = model.blocks[0].attn.wq.weight
        print(
            f"blocks.0.attn.wq.weight: global {tuple(wq.shape)}, placements {wq.placements}, "
            f"local {tuple(wq.to_local().shape)}"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    launch(run, args, args.dp * args.tp)


if __name__ == "__main__":
    main()
