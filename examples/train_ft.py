"""Fault-tolerant HSDP with torchft: replica groups that keep training when one of them dies.

Each replica group is its own torchrun job that shards the model over its ranks; the groups
average gradients through torchft and find each other through a lighthouse. Kill a group (or a
node of it) and the others go on; restart it and it heals from a live group, no checkpoint read.

    pip install "fsdp2[ft]"
    torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 &            # once per job
    export TORCHFT_LIGHTHOUSE=http://localhost:29510
    torchrun --nproc-per-node 2 --master-port 29600 examples/train_ft.py --replica-id 0 &
    torchrun --nproc-per-node 2 --master-port 29601 examples/train_ft.py --replica-id 1 &

Each group needs its own store (``--master-port`` on one machine, its own ``--rdzv-endpoint`` on a
cluster) and a replica id that stays the same across its restarts. Run on CPU (gloo) as is, or on
GPUs (nccl) where torchrun gives each rank one.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp2 import fully_shard
from fsdp2.ft import FaultTolerantHSDP
from fsdp2.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=2)


def batch(step: int, replica: int, shard_rank: int, device) -> torch.Tensor:
    """This rank's token sequences for ``step``: distinct per replica group and per shard rank."""
    g = torch.Generator().manual_seed(step * 1_000_003 + replica * 1009 + shard_rank)
    return torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=g).to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replica-id", type=int, required=True, help="this group's index, the same across restarts")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--min-replicas", type=int, default=1, help="commit a step only with this many groups in it")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds a dead peer may stall a collective")
    args = ap.parse_args()

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda" if use_cuda else "cpu")
    # This group's ranks only: the replicate dim is torchft's, across groups.
    shard_mesh = init_device_mesh(device.type, (dist.get_world_size(),))

    torch.manual_seed(0)  # every group builds the same initial model (a late one heals anyway)
    model = GPT(CFG).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    ft = FaultTolerantHSDP(
        model,
        optimizer,
        replica_id=f"replica_{args.replica_id}",
        min_replicas=args.min_replicas,
        timeout=timedelta(seconds=args.timeout),
    )
    with ft:
        while ft.step < args.steps:
            ft.begin_step()  # joins the quorum; a restarted group heals here
            tokens = batch(ft.step, args.replica_id, dist.get_rank(), device)
            loss = model.loss(tokens[:, :-1], tokens[:, 1:])
            loss.backward()  # gradients averaged over this group's ranks and over the groups
            committed = ft.commit_step()  # the optimizer steps only if the step's all-reduces succeeded
            if dist.get_rank() == 0:
                print(
                    f"replica {args.replica_id} step {ft.step:4d} loss {loss.item():.4f} "
                    f"groups {ft.participants} {'committed' if committed else 'NOT committed'}",
                    flush=True,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
