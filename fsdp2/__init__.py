"""fsdp2: fully sharded data parallel on DTensor, a drop-in for ``torch.distributed.fsdp.fully_shard``."""

from fsdp2 import torch_switch as _torch_switch
from fsdp2.errors import FSDPUsageError
from fsdp2.optim.grad_clip import clip_grad_norm_
from fsdp2.optim.local_step import step_on_local_shards_by_default as _step_on_local_shards_by_default
from fsdp2.policies import AllGatherPolicy, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp2.runtime.dp_mesh import DataParallelMeshDims
from fsdp2.runtime.fsdp_module import (
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from fsdp2.runtime.fully_shard import fully_shard, on_fully_shard as _on_fully_shard
from fsdp2.torch_switch import install_as_torch_fsdp, uninstall_as_torch_fsdp


def _one_implementation_per_module(modules, name: str) -> None:
    """Refuse modules PyTorch's ``fully_shard`` sharded; from the first fsdp2 module on, PyTorch's
    ``fully_shard`` refuses modules holding fsdp2's (fsdp2.torch_switch)."""
    _torch_switch.refuse_mixed_implementations(modules, name)
    _torch_switch.guard_pytorch_fully_shard()


# The runtime imports nothing above it: fully_shard reaches the switch's guards and the optimizer
# default (the global step pre-hook, registered at the first fully_shard) through this wiring.
_on_fully_shard(check=_one_implementation_per_module, before_change=_step_on_local_shards_by_default)

__all__ = [
    "AllGatherPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "FSDPUsageError",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "clip_grad_norm_",
    "fully_shard",
    "install_as_torch_fsdp",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "uninstall_as_torch_fsdp",
]
