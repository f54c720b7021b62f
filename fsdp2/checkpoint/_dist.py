"""The few collectives checkpointing uses: rank info and an all-ranks-agree check.

No tensor data and no pickled objects ever cross ranks. A one-element all-reduce doubles as
the barrier and tells every rank whether any rank failed; only then is the failing rank's
message (UTF-8 bytes in a tensor) broadcast, so every rank can report the real reason. A save
also sums two counts over the ranks and broadcasts rank 0's id for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_MAX_MESSAGE_BYTES = 4096


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _flag_device() -> torch.device:
    backend = str(dist.get_backend())
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def first_failure(error: BaseException | str | None) -> tuple[int, str] | None:
    """Barrier: None if no rank passed an error, else (lowest failing rank, its message).

    Every rank must call it at the same point of its program.
    """
    rank, world = rank_and_world()
    message = None if error is None else ((error if isinstance(error, str) else _describe(error)) or "failed")
    if world == 1:
        return None if message is None else (0, message)
    device = _flag_device()
    flag = torch.tensor([rank if message is not None else world], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    failed = int(flag.item())
    if failed == world:
        return None
    data = message.encode("utf-8", "replace")[:_MAX_MESSAGE_BYTES] if rank == failed else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=failed)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8)
    if rank == failed and data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    buffer = buffer.to(device)
    dist.broadcast(buffer, src=failed)
    return failed, buffer.cpu().numpy().tobytes().decode("utf-8", "replace")


def sum_over_ranks(values: list[int]) -> list[int]:
    """The element-wise sum of every rank's ``values`` (collective; small counts, not data)."""
    _, world = rank_and_world()
    if world == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=_flag_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [int(v) for v in t.cpu().tolist()]


def broadcast_from_rank0(value: int) -> int:
    """Rank 0's ``value`` on every rank (collective; an int64)."""
    _, world = rank_and_world()
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_flag_device())
    dist.broadcast(t, src=0)
    return int(t.item())


def _describe(error: BaseException) -> str:
    text = str(error)
    return text if text else type(error).__name__
