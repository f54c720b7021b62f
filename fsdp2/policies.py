"""User-facing policies: mixed precision and CPU offload (same fields as PyTorch FSDP2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes used around forward/backward; sharded (master) parameters keep their own dtype.

    - ``param_dtype``: dtype of the all-gathered (unsharded) parameters used in compute.
    - ``reduce_dtype``: dtype in which gradients are reduce-scattered (defaults to ``param_dtype``).
    - ``output_dtype``: floating-point outputs of the module are cast to this dtype.
    - ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state live on the mesh device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters and gradients live on CPU, so the optimizer steps on CPU.

    Each all-gather copies the shard to the mesh device first; each reduced gradient shard is
    copied back. ``pin_memory`` pins the CPU shards so these copies can be asynchronous.
    """

    pin_memory: bool = True
