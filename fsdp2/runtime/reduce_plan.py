"""How a bucket's gradients are averaged: the reduce ops of its collectives and the divisions around them.

PyTorch's FSDP2 picks these per reduce dtype (``_get_gradient_divide_factors`` in its
``_fsdp_collectives``), and on NCCL the pick decides the rounding: AVG and PREMUL_SUM scale each
rank's input inside the collective, SUM followed by ``div_`` scales the sum. fsdp2 picks the same,
so its gradients are PyTorch's on every backend (on gloo AVG is a sum then a division, so there
the two agree either way):

- fp32/bf16 (no overflow risk): AVG in the reduce-scatter and the HSDP all-reduce, SUM where
  there is one data-parallel rank; with ``set_gradient_divide_factor(f)``: PREMUL_SUM(1/f) in the
  reduce-scatter (AVG if ``f`` is the shard group's size) and SUM across replicas.
- fp16 and other dtypes (overflow risk), or ``set_force_sum_reduction_for_comms(True)``: SUM, the
  factor split into a division before the sum (fp16: a power of two near its square root) and
  one after.

Two places where fsdp2 cannot pass PyTorch's op, each handled the same way every time:
- one shard rank: no reduce-scatter runs; as PyTorch's FSDP2, the input is divided by ``f`` in
  its place, *in addition to* the divisions above (so with fp16 or force-sum, PyTorch's FSDP2
  divides by ``f`` twice at one shard rank: fsdp2 does the same, since a drop-in must not
  change the numbers);
- a backend without PREMUL_SUM (gloo, where PyTorch's FSDP2 raises): SUM, then a division by ``f``.

A division by 1 is never planned (PyTorch 2.13's one-rank copy still divides by a factor of 1; the
result is the same without it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp2 import compat


@dataclass(frozen=True)
class ReduceOp:
    """A collective's reduction: ``sum``, ``avg`` (the sum over ``n`` ranks scaled by 1/n) or
    ``premul_sum`` (each rank's input scaled by ``scale``, then summed)."""

    name: str
    scale: float = 1.0

    def c10d(self) -> dist.ReduceOp:
        if self.name == "sum":
            return dist.ReduceOp.SUM
        if self.name == "avg":
            return dist.ReduceOp.AVG
        return compat.premul_sum_op(self.scale)

    @property
    def functional_name(self) -> str | None:
        """The name functional collectives take (``"sum"``, ``"avg"``); None: they cannot express it."""
        return None if self.name == "premul_sum" else self.name


SUM = ReduceOp("sum")
AVG = ReduceOp("avg")

# Dtypes whose range takes a sum over all ranks before the division (PyTorch's list).
_NO_OVERFLOW_RISK = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class ReducePlan:
    """The reduce ops and divisions of one bucket's gradient reduction, in the order they run:
    divide the reduce-scatter input by each of ``divide_before`` in turn, reduce-scatter with
    ``reduce_scatter_op`` (skipped at one shard rank), all-reduce across replicas (HSDP) with
    ``all_reduce_op``, run the user's all-reduce hook, divide by ``divide_after`` (1: no division).
    No divisor in ``divide_before`` is 1."""

    reduce_scatter_op: ReduceOp
    all_reduce_op: ReduceOp
    divide_before: tuple[float, ...] = ()
    divide_after: float = 1.0

    @classmethod
    def choose(
        cls,
        *,
        shard_size: int,
        replicate_size: int,
        reduce_dtype: torch.dtype,
        divide_factor: float | None,
        force_sum: bool,
        premul_sum_supported: bool,
        device_type: str = "",
    ) -> "ReducePlan":
        """PyTorch FSDP2's choice for this configuration (see the module docstring).
        ``replicate_size``: 1 without HSDP. ``divide_factor``: None averages over all
        data-parallel ranks."""
        plan = cls._choose_ops(
            shard_size, replicate_size, reduce_dtype, divide_factor, force_sum, premul_sum_supported, device_type
        )
        if shard_size == 1 and divide_factor is not None:  # PyTorch's single-rank copy divides, whatever the plan
            plan = dataclasses.replace(plan, divide_before=plan.divide_before + (divide_factor,))
        # A division by 1 changes nothing: the plan never holds one, so no step runs one.
        return dataclasses.replace(plan, divide_before=tuple(d for d in plan.divide_before if d != 1))

    @classmethod
    def _choose_ops(
        cls, shard_size, replicate_size, reduce_dtype, divide_factor, force_sum, premul_sum_supported, device_type
    ):
        force_sum = force_sum or device_type == "mtia"  # as PyTorch: MTIA only sums
        data_parallel_size = shard_size * replicate_size
        if reduce_dtype in _NO_OVERFLOW_RISK and not force_sum:
            if divide_factor is None:
                op = SUM if data_parallel_size == 1 else AVG
                return cls(op, op)
            if divide_factor == shard_size:
                return cls(AVG, SUM)
            if shard_size == 1:
                return cls(SUM, SUM)  # the reduce-scatter is skipped; choose() adds the division
            if not premul_sum_supported:
                return cls(SUM, SUM, divide_after=divide_factor)
            return cls(ReduceOp("premul_sum", 1 / divide_factor), SUM)
        factor = float(data_parallel_size) if divide_factor is None else divide_factor
        if reduce_dtype in _NO_OVERFLOW_RISK:
            return cls(SUM, SUM, divide_after=factor)
        # fp16's narrow range: divide by about sqrt(factor) (a power of two) before the sum, the rest after.
        before = 1
        while factor % before == 0 and factor / before > before:
            before *= 2
        return cls(SUM, SUM, divide_before=(float(before),) if before != 1 else (), divide_after=factor / before)
