"""Every private PyTorch API fsdp2 relies on, in one place.

These are underscore names of DTensor, DeviceMesh and autograd that have no public equivalent in
torch 2.11 and 2.13. Keeping them here means a torch release that moves one breaks one file, and
reading this file tells what fsdp2 assumes beyond the public API.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.distributed.fsdp as torch_fsdp
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

# fully_shard on a tensor-parallel parameter split along the same dim: "every tp-th block".
StridedShard = _StridedShard

# PyTorch's FSDP2 classes that fsdp2's derive from, so frameworks' isinstance checks pass.
TorchFSDPModule = torch_fsdp.FSDPModule
TorchUnshardHandle = torch_fsdp.UnshardHandle


def torch_fully_shard_home():
    """The module that defines PyTorch's ``fully_shard`` (its implementation reads its own global
    ``fully_shard``, so this one binding must always stay PyTorch's)."""
    import torch.distributed.fsdp._fully_shard._fully_shard as home

    return home


def set_torch_fully_shard_state(module: nn.Module, state: object) -> None:
    """Make PyTorch's ``fully_shard.state(module)`` return ``state``: the composable-API state
    dict is keyed by the undecorated function ``contract`` wrapped."""
    key = torch_fully_shard_home().fully_shard.__wrapped__
    module.__dict__.setdefault(STATE_KEY, OrderedDict())[key] = state


try:  # torch >= 2.13: shard_placement_fn may name a placement and a mesh per parameter
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:  # torch 2.11
    ShardPlacementResult = None


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself if it is not a slice)."""
    return mesh._get_root_mesh()


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s dims as one 1-D mesh called ``name`` (cached by DeviceMesh: same name, same mesh)."""
    return mesh._flatten(name)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are those of ``meshes`` (slices of one root mesh), in order."""
    if hasattr(DeviceMesh, "_concatenate"):  # torch >= 2.13
        return DeviceMesh._concatenate(meshes)
    names = tuple(n for m in meshes for n in m.mesh_dim_names)
    return root_mesh(meshes[0])[names]  # older torch slices flattened dims from the root


def local_tensor(dtensor: DTensor) -> torch.Tensor:
    """The local shard of ``dtensor`` itself, not an autograd view of it (``to_local`` is one)."""
    return dtensor._local_tensor


def local_tensors(dtensors: list[DTensor]) -> list[torch.Tensor]:
    """``local_tensor`` of each (one call for a whole group, not one per parameter)."""
    return [d._local_tensor for d in dtensors]


def dtensor_like(template: DTensor, local: torch.Tensor, requires_grad: bool = False) -> DTensor:
    """A DTensor with ``template``'s mesh, placements, shape and stride around ``local``.

    Unlike ``DTensor.from_local`` this neither moves ``local`` to the mesh's device type (a CPU
    offloaded shard must stay on the CPU while the mesh is on CUDA) nor builds an autograd node.
    The template's spec is shared when the dtype matches (cheap: gradients are made every step).
    Built by ``DTensor.__new__`` alone, here and in ``dtensors_like`` / ``make_dtensor``: DTensor's
    ``__init__`` has no body, only decorators for dynamo and export that cost Python calls.
    """
    if local.dtype == template.dtype:
        return DTensor.__new__(DTensor, local, template._spec, requires_grad=requires_grad)
    return make_dtensor(local, template.device_mesh, template.placements, template.shape, template.stride(), requires_grad)


def assign_dtensor_grads(params: Sequence[DTensor], locals_: Sequence[torch.Tensor]) -> None:
    """Each parameter's ``.grad``: ``dtensor_like`` of it around its local gradient (one call for a
    whole group, not one per parameter)."""
    for param, local in zip(params, locals_):
        param.grad = (
            DTensor.__new__(DTensor, local, param._spec, requires_grad=False)
            if local.dtype == param.dtype
            else dtensor_like(param, local)
        )


# ``tensors`` flattened and concatenated into a new 1-D tensor, in one call (no Python per tensor).
flatten_dense_tensors: Callable[[list[torch.Tensor]], torch.Tensor] = torch._C._nn.flatten_dense_tensors

# ``flat`` as consecutive views shaped like each of ``like`` (only their shapes are read: meta
# tensors will do), in one call; torch's own gradient-bucket helper, private but stable since 1.x.
unflatten_dense_tensors: Callable[[torch.Tensor, list[torch.Tensor]], list[torch.Tensor]] = (
    torch._C._nn.unflatten_dense_tensors
)


def make_dtensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: torch.Size,
    stride: tuple[int, ...],
    requires_grad: bool = False,
) -> DTensor:
    """A DTensor around ``local`` with the given global shape and stride, ``local`` left where it is."""
    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor.__new__(DTensor, local, spec, requires_grad=requires_grad)


def out_collectives_traceable() -> bool:
    """Whether torch.compile traces ``_c10d_functional``'s ``*_out`` collectives (functionalized by
    ``auto_functionalized``): torch 2.13 does; 2.11 refuses ops whose result aliases an argument."""
    from torch._higher_order_ops.auto_functionalize import can_auto_functionalize

    ops = torch.ops._c10d_functional
    try:
        return all(can_auto_functionalize(op.default) for op in (ops.all_gather_into_tensor_out, ops.reduce_scatter_tensor_out))
    except (AttributeError, RuntimeError):  # a build without distributed or without these ops
        return False


def outside_functorch() -> contextlib.AbstractContextManager:
    """Run FSDP's own tensor work outside any active functorch transform (``torch.func.jvp``):
    gathered parameters are plain tensors, not wrappers of the transform's level."""
    if torch._C._are_functorch_transforms_active():
        return torch._C._DisableFuncTorch()
    return contextlib.nullcontext()


def mark_fully_sharded(module: nn.Module) -> None:
    """List ``fully_shard`` in ``module``'s composable-API registry, which PyTorch's composable
    APIs read: ``replicate()`` then leaves the module's parameters to us."""
    registry = module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())
    registry.setdefault("fully_shard", RegistryItem())


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once autograd has finished the current backward pass."""
    Variable._execution_engine.queue_callback(fn)


def run_backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` for a scalar, handed straight to the autograd engine: no torch-function
    dispatch, so the TorchFunctionModes active around the call stay active during backward (a
    mode's own handler runs with the mode switched off)."""
    Variable._execution_engine.run_backward(
        (loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


def has_step_hooks_besides(optimizer: torch.optim.Optimizer, ignored: Callable) -> bool:
    """Whether step pre- or post-hooks other than the global pre-hook ``ignored`` are registered on
    ``optimizer`` (``register_step_pre_hook``, ...) or for every optimizer
    (``register_optimizer_step_pre_hook``, ...): torch.optim keeps them in private dicts. Plain
    checks, run on every step: no Python call per hook."""
    import torch.optim.optimizer as optimizer_module

    if (
        optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
        or optimizer_module._global_optimizer_post_hooks
    ):
        return True
    for hook in optimizer_module._global_optimizer_pre_hooks.values():
        if hook is not ignored:
            return True
    return False


def premul_sum_op(scale: float) -> "torch.distributed.ReduceOp":
    """c10d's PREMUL_SUM reduce op scaling each input by ``scale``: torch 2.13 builds it by calling
    ``ReduceOp.PREMUL_SUM``; 2.11 only through the private ``_make_nccl_premul_sum``."""
    import torch.distributed as dist

    premul = dist.ReduceOp.PREMUL_SUM
    if callable(premul):
        return premul(scale)
    return dist._make_nccl_premul_sum(scale)
