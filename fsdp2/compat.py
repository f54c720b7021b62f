"""Every private PyTorch API fsdp2 relies on, in one place.

These are underscore names of DTensor, DeviceMesh, nn.Module, c10d, the dispatcher and autograd
that have no public equivalent in torch 2.11 and 2.13. Keeping them here means a torch release
that moves one breaks one file, and reading this file tells what fsdp2 assumes beyond the public
API. tests/docs/test_private_api.py keeps every other module of fsdp2 from naming one.

Where a training step uses one per parameter, this module binds the private accessor itself
(``operator.attrgetter``, or torch's own function object) rather than a ``def`` around it: calling
it adds no Python frame, so moving a use here changes no step's host work.
"""

from __future__ import annotations

import contextlib
import operator
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.distributed.fsdp as torch_fsdp
from torch._C._distributed_c10d import FakeProcessGroup, _create_work_from_future
from torch._subclasses.fake_tensor import DataDependentOutputException as _DataDependentOutputException
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode as _TorchDispatchMode

# fully_shard on a tensor-parallel parameter split along the same dim: "every tp-th block".
StridedShard = _StridedShard

# PyTorch's FSDP2 classes that fsdp2's derive from, so frameworks' isinstance checks pass.
TorchFSDPModule = torch_fsdp.FSDPModule
TorchUnshardHandle = torch_fsdp.UnshardHandle
# ``FSDPModule.finalize_backward(async_op=True)``'s handle: torch >= 2.15 (before it, fsdp2's own has no PyTorch base).
TorchGradientReductionHandle = getattr(torch_fsdp, "GradientReductionHandle", object)


# PyTorch 2.15 changed what ``MixedPrecisionPolicy(reduce_dtype=None)`` means: gradients follow each
# parameter's ``grad_dtype`` (unset: the parameter's own dtype) instead of ``param_dtype``.
REDUCE_DTYPE_DEFAULTS_TO_GRAD_DTYPE = torch.torch_version.TorchVersion(torch.__version__) >= (2, 15)


def _torch_fsdp_sets_unsharded_grad_dtype() -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return hasattr(FSDPParam, "unsharded_grad_dtype")


# PyTorch 2.15's FSDP2 also gives each unsharded parameter ``grad_dtype`` = its reduce dtype, so
# autograd accumulates its gradient at that precision (across backwards without sync too, and a
# tensor-parallel pending sum before it is reduced over TP): fsdp2 does the same where it does.
UNSHARDED_GRAD_IN_REDUCE_DTYPE = _torch_fsdp_sets_unsharded_grad_dtype()


def grad_dtype_override(param: torch.Tensor) -> tuple[bool, torch.dtype | None]:
    """``(True, dtype)`` if ``param.grad_dtype`` was set (None: any gradient dtype), else
    ``(False, None)``; torch < 2.15 does not tell (and its FSDP2 ignores ``grad_dtype``)."""
    if getattr(param, "_has_grad_dtype_override", False):
        return True, param.grad_dtype
    return False, None


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


def groups_along(mesh: DeviceMesh, dim: int) -> list[list[int]]:
    """Every group of ranks the job's layout of ``mesh`` forms along ``dim`` (not only this rank's),
    each in its order along the dim: all ranks compute the same list, with no communication,
    however ``mesh`` was made (sliced, flattened or unflattened from a world mesh)."""
    size = mesh.size(dim)
    if hasattr(mesh, "_layout") and hasattr(mesh, "_rank_map"):  # torch's layout bookkeeping
        from torch.distributed._mesh_layout import _MeshLayout

        return _MeshLayout([mesh._layout[dim]]).remap_to_tensor(mesh._rank_map).reshape(-1, size).tolist()
    root = root_mesh(mesh)  # a slice of a root that names the dim
    names = mesh.mesh_dim_names
    root_dim = root.mesh_dim_names.index(names[dim]) if names else dim
    return root.mesh.movedim(root_dim, -1).reshape(-1, size).tolist()


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


# ``local_tensor`` and a DTensor's spec (placements, mesh and tensor meta in one object, shared by
# DTensors laid out alike: compared by identity) as C accessors, for eager loops over every
# parameter on every step (the local-shard optimizer step): no Python frame per call. Dynamo
# cannot call an attrgetter: code a trace may reach uses the ``def`` forms.
local_tensor_of: Callable[[DTensor], torch.Tensor] = operator.attrgetter("_local_tensor")
spec_of: Callable[[DTensor], DTensorSpec] = operator.attrgetter("_spec")


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
    return make_dtensor(
        local, template.device_mesh, template.placements, template.shape, template.stride(), requires_grad
    )


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
        return all(
            can_auto_functionalize(op.default) for op in (ops.all_gather_into_tensor_out, ops.reduce_scatter_tensor_out)
        )
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


def autograd_backward_running() -> bool:
    """Whether this thread is inside an autograd backward (a hook or callback of one)."""
    return torch._C._current_graph_task_id() != -1


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
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
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


# -- nn.Module and tensors ------------------------------------------------------------------------


def module_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameter registry, name -> parameter (None entries included, no
    submodule's): assigning into it swaps a registered tensor without nn.Module.__setattr__'s
    checks, reading it walks no module tree."""
    return module._parameters


def module_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffer registry, name -> buffer (as ``module_parameters``)."""
    return module._buffers


def module_children(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module``'s own child registry, name -> module (None entries included, a child registered
    under two names listed twice: ``named_children`` drops both)."""
    return module._modules


# ``module_parameters`` as a C accessor, for the eager loops that swap every parameter on every
# unshard and reshard: no Python frame per parameter (dynamo cannot call it; traced code uses the def).
parameter_registry: Callable[[nn.Module], dict[str, nn.Parameter | None]] = operator.attrgetter("_parameters")


def apply_past_torch_fsdp_module(module: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` (what ``to()``, ``cuda()``, ``float()`` and ``to_empty()`` go through,
    with no public hook) as ``module``'s own class runs it, past PyTorch's ``FSDPModule._apply``,
    which reads PyTorch's FSDP state."""
    return super(TorchFSDPModule, module)._apply(fn, recurse)


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of (None when it is not a view): a view keeps its base's
    whole storage alive."""
    return tensor._base


# Fake tensors (torch.compile's tracing, FakeTensorMode): they have no storage, hence no data_ptr.
FakeTensor = _FakeTensor
# What reading a value out of a FakeTensor raises (a RuntimeError).
DataDependentOutputException = _DataDependentOutputException

# torch's multi-tensor kernels, one op for a whole list (torch.optim's foreach paths run on them),
# and the chunk-and-concatenate kernel PyTorch's FSDP2 packs reduce-scatter inputs with: ``out``
# row i holds chunk i (along ``dim``, of ``num_chunks``) of every tensor side by side.
foreach_copy_ = torch._foreach_copy_
foreach_zero_ = torch._foreach_zero_
foreach_mul_ = torch._foreach_mul_
chunk_cat = torch._chunk_cat


# -- the dispatcher ----------------------------------------------------------------------------------

# The base class of ``__torch_dispatch__`` modes, which see every ATen op (counters, the dry run).
TorchDispatchMode = _TorchDispatchMode

# torch's pytree over nested lists, tuples, named tuples and dicts (no public module in torch 2.11).
tree_flatten = _pytree.tree_flatten
tree_map = _pytree.tree_map
tree_map_only = _pytree.tree_map_only

# ATen's flash-attention kernels behind F.scaled_dot_product_attention: underscore ops, renamed
# when torch's attention kernels change. The estimator's dry run calls the CPU one and counts the
# FLOPs of each.
aten_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention
aten_flash_attention_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward
aten_cpu_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
aten_cpu_flash_attention_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def op_name(op: torch._ops.OpOverload) -> str:
    """An op's name without namespace and overload: ``copy_`` for ``aten::copy_.default``."""
    return op._opname


def op_schema(op: torch._ops.OpOverload) -> torch.FunctionSchema:
    """An op's schema: its arguments and returns, with which of them it writes (alias info)."""
    return op._schema


def functional_all_reduce() -> torch._ops.OpOverload:
    """The functional collectives' all-reduce op (``_c10d_functional``): what DTensor's reductions
    (a tensor-parallel Linear's partial sums) dispatch."""
    return torch.ops._c10d_functional.all_reduce.default


# -- c10d: a simulated world (fsdp2.tools.noop_pg) ---------------------------------------------------

# A c10d Work that completes with ``future``.
work_from_future: Callable[[torch.futures.Future], Any] = _create_work_from_future


def fake_process_group_backend(rank: int, size: int) -> Any:
    """c10d's FakeProcessGroup (no communication) as a backend: it keeps a group's name,
    description and sequence numbers. On torch 2.13 it refuses collectives (none should reach it)."""
    options = FakeProcessGroup.Options()
    if hasattr(options, "error_on_collective"):  # torch 2.13; older fakes cannot refuse
        options.error_on_collective = True
    create = getattr(FakeProcessGroup, "_create_internal", None) or FakeProcessGroup
    return create(rank, size, options)


def register_process_group_backend(group: Any, device: torch.device, backend_type: Any, backend: Any) -> None:
    """Give the ProcessGroup ``group`` ``backend`` for ``device`` (``ProcessGroup._register_backend``)."""
    group._register_backend(device, backend_type, backend)


def set_default_process_group_backend(group: Any, backend_type: Any) -> None:
    """Make ``backend_type`` the backend ``group`` answers for when no device is named
    (``ProcessGroup._set_default_backend``)."""
    group._set_default_backend(backend_type)


def backend_registered(name: str) -> bool:
    """Whether ``dist.Backend.register_backend`` knows ``name`` (c10d keeps no public list)."""
    import torch.distributed as dist

    return name.upper() in dist.Backend._plugins


def default_process_group() -> Any:
    """The process group ``init_process_group`` made, as a ProcessGroup object."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group()


# -- the compiled whole step (fsdp2.runtime.traced) -------------------------------------------------

# Functional collectives: the graph ops dynamo traces a step's all-gathers and reduce-scatters
# into (c10d's own collectives break the graph). No public name exists for them.
functional_collectives = torch.ops._c10d_functional


def process_group_named(name: str) -> torch.distributed.ProcessGroup:
    """The process group a functional collective names ``name`` (``group.group_name``)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def register_ordered_effect(op) -> bool:
    """Make the compilers keep ``op`` (it returns nothing: its effect is all it does) and run it in
    program order, in forward and backward graphs, as ``aten::_print``. False where this torch
    has no such registration (the caller then does without the op under compile)."""
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    except ImportError:
        return False
    _register_effectful_op(op, _EffectType.ORDERED)
    return True


def held_parameter_registry(module: nn.Module) -> dict:
    """``module``'s ``_parameters`` dict object itself, read as the compiled step reads it (through
    the instance dict: a trace reaches this ``def``)."""
    return module.__dict__["_parameters"]


def set_parameter_registry(module: nn.Module, registry: dict) -> None:
    """Give ``module`` another ``_parameters`` dict object: while a trace runs, the modules see the
    gathered parameters without the DTensor parameters being read (dynamo would guard on each)."""
    module.__dict__["_parameters"] = registry


# -- PyTorch's own FSDP2, where fsdp2 meets it (torch_switch, ft) ------------------------------------

# Where PyTorch's FSDP2 functions are importable from besides torch.distributed.fsdp: private
# module paths that code written for PyTorch may import them through.
TORCH_FSDP2_PRIVATE_IMPORT_PATHS = (
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)


def torch_fully_shard_module_lookup() -> Callable | None:
    """The helper PyTorch's ``fully_shard`` looks up the modules and their states with (None on a
    torch that lays its implementation out otherwise)."""
    return torch_fully_shard_home().__dict__.get("_get_modules_and_states")


def set_torch_fully_shard_module_lookup(lookup: Callable) -> None:
    torch_fully_shard_home()._get_modules_and_states = lookup


def torch_fsdp_mp_policy(state: object) -> Any:
    """The mixed-precision policy of a module PyTorch's FSDP2 sharded (its ``FSDPState``)."""
    return state._mp_policy
