"""Stand-ins for a user's custom collectives (``set_custom_reduce_scatter``)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def premul_factor(op) -> float | None:
    """The scale of a ``ReduceOp.PREMUL_SUM(scale)``, None for other ops (plain ``RedOpType``s)."""
    return op.factor if getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM else None


def describe_op(op) -> tuple:
    """A reduce op as comparable data: ``("avg",)``, ``("sum",)``, ``("premul_sum", scale)``, ..."""
    if premul_factor(op) is not None:
        return ("premul_sum", premul_factor(op))
    return (str(getattr(op, "op", op)).rsplit(".", 1)[-1].lower(),)


class RecordingReduceScatter:
    """A user's reduce-scatter (PyTorch's ``ReduceScatter`` protocol): c10d's, with the op logged."""

    def __init__(self):
        self.ops: list[tuple] = []

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.ops.append(describe_op(op))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
