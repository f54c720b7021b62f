"""The few collectives checkpointing uses: rank info and an all-ranks-agree flag.

No tensor data and no pickled objects ever cross ranks; a one-element all-reduce
doubles as the barrier and lets every rank learn whether any rank failed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _flag_device() -> torch.device:
    backend = str(dist.get_backend())
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_ok(ok: bool) -> bool:
    """Barrier that returns True only if ``ok`` is True on every rank."""
    if rank_and_world()[1] == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_flag_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
