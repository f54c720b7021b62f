"""The policies ``fully_shard`` takes, and the dtype rules they imply.

The policy classes are PyTorch's own (``torch.distributed.fsdp``), re-exported: code written for
PyTorch's FSDP2 passes the same objects to fsdp2, and one policy object serves both.

- ``MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)``: the
  sharded (master) parameters keep their own dtype; compute and all-gathers use ``param_dtype``,
  gradient reduction ``reduce_dtype`` (default: ``param_dtype``).
- ``OffloadPolicy()``: no offloading. ``CPUOffloadPolicy(pin_memory=True)``: sharded parameters
  and gradients live on the CPU (the optimizer steps there); each all-gather copies the shard to
  the mesh device first, each reduced gradient shard is copied back.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy", "param_dtype_of", "reduce_dtype_of"]


def param_dtype_of(param: torch.Tensor, mp_policy: MixedPrecisionPolicy) -> torch.dtype:
    """The dtype ``param`` is gathered and computed in (its own unless the policy casts floats)."""
    if param.is_floating_point() and mp_policy.param_dtype is not None:
        return mp_policy.param_dtype
    return param.dtype


def reduce_dtype_of(param: torch.Tensor, mp_policy: MixedPrecisionPolicy) -> torch.dtype:
    """The dtype ``param``'s gradient is reduce-scattered in (default: its compute dtype)."""
    if param.is_floating_point() and mp_policy.reduce_dtype is not None:
        return mp_policy.reduce_dtype
    return param_dtype_of(param, mp_policy)
