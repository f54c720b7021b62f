"""fsdp2: fully sharded data parallel on DTensor, a drop-in for ``torch.distributed.fsdp.fully_shard``."""

from fsdp2 import torch_switch as _torch_switch
from fsdp2.errors import FSDPUsageError
from fsdp2.optim.grad_clip import clip_grad_norm_
import fsdp2.optim.local_step  # noqa: F401 - registers the default local-shard step's process hook
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


# The runtime imports nothing above it: fully_shard reaches the switch's refusal of modules PyTorch
# sharded through this wiring. The process-wide hooks of the layers above it (the optimizer default,
# the guard on PyTorch's fully_shard) register themselves in fsdp2.runtime.process_hooks.
_on_fully_shard(check=_torch_switch.refuse_mixed_implementations)

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
