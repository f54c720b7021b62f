"""fsdp2: fully sharded data parallel on DTensor, a drop-in for ``torch.distributed.fsdp.fully_shard``."""

import sys

from fsdp2 import moved
from fsdp2.errors import FSDPUsageError
from fsdp2.optim.grad_clip import clip_grad_norm_
from fsdp2.policies import AllGatherPolicy, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp2.runtime.dp_mesh import DataParallelMeshDims
from fsdp2.runtime.fsdp_module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from fsdp2.runtime.fully_shard import fully_shard
from fsdp2.torch_switch import install_as_torch_fsdp, uninstall_as_torch_fsdp

moved.install(sys.modules[__name__])  # the old import paths (fsdp2.comm_stats, ...) warn and forward for one release

__all__ = [
    "AllGatherPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "FSDPUsageError",
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
