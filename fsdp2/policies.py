"""The policies ``fully_shard`` takes, and the dtype rules they imply.

The policy classes are PyTorch's own (``torch.distributed.fsdp``), re-exported: code written for
PyTorch's FSDP2 passes the same objects to fsdp2, and one policy object serves both.

- ``MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)``: the
  sharded (master) parameters keep their own dtype; compute and all-gathers use ``param_dtype``,
  gradient reduction ``reduce_dtype``. Its default follows the installed PyTorch: the parameter's
  own dtype from torch 2.15 on (PyTorch's FSDP2 follows the parameter's ``grad_dtype``, which
  fsdp2 supports unset), ``param_dtype`` before.
- ``OffloadPolicy()``: no offloading. ``CPUOffloadPolicy(pin_memory=True)``: sharded parameters
  and gradients live on the CPU (the optimizer steps there); each all-gather copies the shard to
  the mesh device first, each reduced gradient shard is copied back.

``AllGatherPolicy`` is fsdp2's own (PyTorch has no counterpart): the low-precision all-gather,
set per module with ``FSDPModule.set_all_gather_policy`` (fully_shard keeps PyTorch's signature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fsdp2 import compat
from fsdp2.errors import FSDPUsageError, FSDPUsageNotImplementedError

__all__ = [
    "AllGatherPolicy",
    "CPUOffloadPolicy",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "check_grad_dtype",
    "param_dtype_of",
    "reduce_dtype_of",
    "skip_1d",
]


def param_dtype_of(param: torch.Tensor, mp_policy: MixedPrecisionPolicy) -> torch.dtype:
    """The dtype ``param`` is gathered and computed in (its own unless the policy casts floats)."""
    if param.is_floating_point() and mp_policy.param_dtype is not None:
        return mp_policy.param_dtype
    return param.dtype


def reduce_dtype_of(param: torch.Tensor, mp_policy: MixedPrecisionPolicy) -> torch.dtype:
    """The dtype ``param``'s gradient is reduce-scattered in (default: its own dtype on torch >=
    2.15, its compute dtype before, as PyTorch's FSDP2 on the installed release)."""
    if param.is_floating_point() and mp_policy.reduce_dtype is not None:
        return mp_policy.reduce_dtype
    if compat.REDUCE_DTYPE_DEFAULTS_TO_GRAD_DTYPE:
        return param.dtype
    return param_dtype_of(param, mp_policy)


def check_grad_dtype(param: torch.Tensor, fqn: str, owner: str) -> None:
    """Refuse a ``grad_dtype`` other than the parameter's dtype, set before fully_shard (torch >=
    2.15): fsdp2 keeps a parameter's gradients in its dtype (reduced in ``reduce_dtype``)."""
    overridden, grad_dtype = compat.grad_dtype_override(param)
    if overridden and grad_dtype != param.dtype:
        raise FSDPUsageNotImplementedError(
            f"fully_shard({owner}): parameter {fqn} has grad_dtype={grad_dtype} (its dtype is {param.dtype}); "
            "fsdp2 keeps gradients in the parameter's dtype. Leave grad_dtype unset and choose the "
            "reduction's dtype with MixedPrecisionPolicy(reduce_dtype=...)."
        )


# -- low-precision all-gather ----------------------------------------------------------------------

_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_SCALE_DTYPES = (torch.float32, torch.bfloat16)
_QUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16)  # shard and param dtypes
BLOCK_SIZE_MULTIPLE = 16  # keeps every quantized slot 16-byte aligned (fsdp2.runtime.quantize)


def skip_1d(fqn: str, param: torch.Tensor) -> bool:
    """The default rule: quantize matrices and larger; 1-D parameters (norms, biases) stay exact."""
    return param.ndim >= 2


@dataclass(frozen=True)
class AllGatherPolicy:
    """Communicate parameters in 1 byte per element, with one scale per block.

    Set with ``module.set_all_gather_policy(policy)`` on a fully_shard'ed module. Each rank
    quantizes its shard before the all-gather (values and scales travel in the group's one
    collective) and dequantizes the gathered rows into ``param_dtype``; the sharded (master)
    parameters, the gradients and their reduce-scatter are untouched.

    - ``dtype``: ``torch.float8_e4m3fn`` (relative error <= 2^-4 per element) or ``torch.int8``
      (absolute error <= absmax/254 per block).
    - ``block_size``: elements per scale, a multiple of 16. The default 128 costs 2/128 of a byte
      per element with bf16 scales: 0.508x the bytes of a bf16 all-gather (0.516x with fp32
      scales); larger blocks save little more and let one outlier coarsen more neighbours.
    - ``scale_dtype``: ``torch.bfloat16`` (default) or ``torch.float32``. The scale's precision
      does not limit the error bounds (values are divided by the stored, rounded scale); bf16
      halves the scale bytes and lets bf16 parameters dequantize in bf16 arithmetic, exactly.
    - ``applies_to(fqn, param)``: which parameters are quantized; the others are all-gathered
      in ``param_dtype`` as usual. Default :func:`skip_1d`: everything but 1-D parameters.
    """

    dtype: torch.dtype
    block_size: int = 128
    scale_dtype: torch.dtype = torch.bfloat16
    applies_to: Callable[[str, torch.Tensor], bool] = skip_1d

    def __post_init__(self) -> None:
        if self.dtype not in _QMAX:
            raise FSDPUsageError(
                f"AllGatherPolicy(dtype={self.dtype}): dtype must be torch.float8_e4m3fn or torch.int8; "
                "to all-gather in a 2-byte float instead, use MixedPrecisionPolicy(param_dtype=...)"
            )
        size = self.block_size
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size % BLOCK_SIZE_MULTIPLE:
            raise FSDPUsageError(
                f"AllGatherPolicy(block_size={size!r}): block_size must be a positive multiple of "
                f"{BLOCK_SIZE_MULTIPLE} (elements per scale), e.g. 128"
            )
        if self.scale_dtype not in _SCALE_DTYPES:
            raise FSDPUsageError(
                f"AllGatherPolicy(scale_dtype={self.scale_dtype}): scale_dtype must be torch.float32 or torch.bfloat16"
            )
        if not callable(self.applies_to):
            raise FSDPUsageError(
                f"AllGatherPolicy(applies_to={self.applies_to!r}): applies_to must be a function "
                "(fqn, param) -> bool choosing the parameters to quantize"
            )

    @property
    def qmax(self) -> float:
        """The largest code magnitude: a block's absmax maps to it."""
        return _QMAX[self.dtype]

    def quantizes(self, fqn: str, param: torch.Tensor, param_dtype: torch.dtype) -> bool:
        """Whether ``param`` (gathered in ``param_dtype``) travels quantized under this policy: a
        float32/bfloat16/float16 parameter gathered in one of those that ``applies_to`` picks.
        ``fqn`` is its name inside the fully_shard'ed module, ``param`` has its full shape."""
        return param.dtype in _QUANTIZABLE and param_dtype in _QUANTIZABLE and bool(self.applies_to(fqn, param))
