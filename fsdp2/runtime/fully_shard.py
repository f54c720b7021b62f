"""``fully_shard``: turn a module's parameters into DTensor shards and install the FSDP hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fsdp2 import compat
from fsdp2.errors import FSDPUsageAssertionError, FSDPUsageError, FSDPUsageNotImplementedError
from fsdp2.layout.regions import local_part_like
from fsdp2.policies import MixedPrecisionPolicy, OffloadPolicy, check_grad_dtype
from fsdp2.runtime import extensions, schedule, traced
from fsdp2.runtime.dp_mesh import DataParallelMesh, DataParallelMeshDims
from fsdp2.runtime.dtensor_spec import ShardedSpec, sharded_spec
from fsdp2.runtime.fsdp_module import FSDPModule
from fsdp2.runtime.gather import Subgroup
from fsdp2.runtime.hooks import FSDPState, states_under
from fsdp2.runtime.param_group import ParamGroup, ReshardAfterForward
from fsdp2.runtime.param_slots import ParamSlot
from fsdp2.runtime.sharded_param import ShardedParam, managed_by
from fsdp2.runtime.process_hooks import PROCESS_HOOKS
from fsdp2.runtime.torch_view import TorchStateView

_FSDP_CLASSES: dict[type, type] = {}

# The package's layers above the runtime whose checks every fully_shard runs (the refusal of
# modules PyTorch's fully_shard sharded, in fsdp2.torch_switch): fsdp2/__init__.py registers them
# once through on_fully_shard, so the runtime imports none of them. (Their process-wide hooks are
# in fsdp2.runtime.process_hooks.)
_checks: list[Callable[[tuple[nn.Module, ...], str], None]] = []


def on_fully_shard(*, check: Callable[[tuple[nn.Module, ...], str], None]) -> None:
    """Package wiring: every later ``fully_shard`` calls ``check(modules, name)`` before its own
    validation (it may refuse: nothing is changed yet), in the order registered, a function once."""
    if check not in _checks:
        _checks.append(check)


@dataclass
class _ParamPlan:
    """What fully_shard will do with one parameter, decided before anything is changed."""

    managed: schedule.ManagedParam
    dp: DataParallelMesh | None = None  # the mesh it is sharded on: the call's, or shard_placement_fn's
    shard_dim: int = 0
    spec: ShardedSpec | None = None


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> Any:
    """Shard the parameters of ``module`` (or of a list of modules, as one group) that no
    fully_shard'ed submodule already manages.

    Apply it bottom-up: to each block first, then to the root. Every managed parameter becomes an
    ``nn.Parameter`` wrapping a DTensor (``Shard(0)`` on ``mesh`` unless ``shard_placement_fn``
    says otherwise; a ``ShardPlacementResult`` may name another mesh, whose parameters form a
    group of their own, gathered and reduced in their own collectives). Forward and backward
    all-gather the parameters just in time and reduce-scatter the gradients.
    ``reshard_after_forward`` None (default) frees the parameters after forward except in the
    root, True frees them, False keeps them, ``k`` keeps 1/k of them for backward. Returns
    ``module``, whose class now also derives from :class:`FSDPModule`.
    """
    modules = _modules_of(module)
    name = "+".join(type(m).__name__ for m in modules)
    for m in modules:
        if isinstance(m, FSDPModule):
            raise FSDPUsageAssertionError(
                f"fully_shard was already applied to this {type(m).__name__}; apply it once per module"
            )
    for check in _checks:
        check(modules, name)
    _check_policies(mp_policy, offload_policy, name)
    dp = DataParallelMesh.from_mesh(mesh, name, dp_mesh_dims)
    _check_reshard_after_forward(reshard_after_forward, dp, name)
    plans = _plan_params(modules, set(ignored_params or ()), name)
    _check_devices(plans, dp, name)
    meshes = _CallMeshes(dp, name)
    for plan in plans:
        plan.dp, plan.shard_dim = _placement(plan, shard_placement_fn, meshes, name)
        plan.spec = sharded_spec(plan.managed.fqn, plan.managed.param, plan.dp, plan.shard_dim)
        extensions.check_hooks(plan.managed.fqn, plan.spec.fsdp_input, plan.shard_dim, plan.dp, name)
    # One group per mesh, in the order of their first parameters (PyTorch's order).
    group_meshes: list[DataParallelMesh] = []
    for plan in plans:
        if not any(plan.dp is m for m in group_meshes):
            group_meshes.append(plan.dp)
    for group_dp in group_meshes:
        if group_dp is not dp:
            _check_reshard_after_forward(reshard_after_forward, group_dp, name)
    # Collective (every rank, same order): before any change.
    subgroups = [_subgroup(reshard_after_forward, group_dp) for group_dp in group_meshes]

    # Validation is over: from here on we change the module.
    sharded = [
        ShardedParam(
            p.managed.fqn,
            p.managed.param,
            [ParamSlot(m, n) for m, n in p.managed.places],
            p.dp,
            p.shard_dim,
            p.spec,
            mp_policy,
            offload_policy,
            owner=name,
        )
        for p in plans
    ]
    for m in modules:
        _move_buffers(m, dp)
    groups = [
        ParamGroup(
            [param for param, plan in zip(sharded, plans) if plan.dp is group_dp],
            group_dp,
            ReshardAfterForward(reshard_after_forward, group_dp.shard_size, subgroup),
            name,
        )
        for group_dp, subgroup in zip(group_meshes, subgroups)
    ] or [ParamGroup([], dp, ReshardAfterForward(reshard_after_forward, dp.shard_size), name)]
    state = FSDPState(modules, groups, mp_policy)
    for m in modules:
        m.__dict__["_fsdp_state"] = state
        m.__class__ = _fsdp_class(type(m))
        compat.mark_fully_sharded(m)
        PROCESS_HOOKS.module_sharded(m)
        # PyTorch's ``fully_shard.state(m)`` (pipelining reads it) sees fsdp2's state through a view.
        compat.set_torch_fully_shard_state(m, TorchStateView.of(state))
    for group in groups:
        _register_state_dict_hooks(group)
    _link_traced_forward_order(modules)
    return module


def _subgroup(reshard_after_forward: Any, dp: DataParallelMesh) -> Subgroup | None:
    """The k-rank subgroup ``reshard_after_forward=k`` reshards to on ``dp`` (collective), if any."""
    k = reshard_after_forward
    if isinstance(k, int) and not isinstance(k, bool) and 1 < k < dp.shard_size:
        group, position = dp.subgroup(k)
        return Subgroup(group, position, k, dp.across_subgroups(k))
    return None


def _link_traced_forward_order(modules: tuple[nn.Module, ...]) -> None:
    """The traced path's implicit prefetch: each group gathers the next fully_shard'ed module's
    group in module order (apply bottom-up: the outermost call sets the order last)."""
    states = states_under(modules)
    traced.link_forward_order([state.traced_call for state in states])
    if states:
        states[0].states_below = states  # the call's own state: as a root, what its backward ends


def _state_of(module: nn.Module) -> TorchStateView | None:
    """``module``'s fully_shard state as PyTorch's callers read it, the same answer PyTorch's
    ``fully_shard.state`` gives for it (None if fully_shard was not applied to it)."""
    state = module.__dict__.get("_fsdp_state") if isinstance(module, nn.Module) else None
    return TorchStateView.of(state) if state is not None else None


# Like PyTorch's ``fully_shard.state(module)``: code holding either function gets the same view.
fully_shard.state = _state_of


def _modules_of(module: Any) -> tuple[nn.Module, ...]:
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
        # Its forward is never called, so the hooks that gather its parameters would never run.
        # The wording starts as PyTorch's, whose tests match it.
        raise FSDPUsageError(
            f"fully_shard does not support containers that do not implement forward: this "
            f"{type(module).__name__} is never called. Apply fully_shard to each module in it, or to them as "
            "one group: fully_shard(list(container)) (a ModuleDict: list(container.values()))."
        )
    if isinstance(module, nn.Module):
        return (module,)
    if isinstance(module, (list, tuple)) and module and all(isinstance(m, nn.Module) for m in module):
        # Modules inside another listed module belong to that one's group anyway.
        roots = [m for m in module if not any(m is not o and _contains(o, m) for o in module)]
        unique: list[nn.Module] = []
        for m in roots:
            if not any(m is u for u in unique):
                unique.append(m)
        return tuple(unique)
    raise FSDPUsageError(
        f"fully_shard expects an nn.Module or a non-empty list of nn.Modules, got {type(module).__name__}"
    )


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _fsdp_class(cls: type) -> type:
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


def _check_policies(mp_policy, offload_policy, name: str) -> None:
    # Caught here, not as an AttributeError halfway through building the shards.
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise FSDPUsageError(
            f"fully_shard({name}): mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}"
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise FSDPUsageError(
            f"fully_shard({name}): offload_policy must be an OffloadPolicy (OffloadPolicy() or "
            f"CPUOffloadPolicy()), got {type(offload_policy).__name__}"
        )


def _check_reshard_after_forward(value: Any, dp: DataParallelMesh, name: str) -> None:
    if value is None or isinstance(value, bool):
        return
    if len(dp.shard_dims) > 1 and value not in (1, dp.shard_size):
        raise FSDPUsageNotImplementedError(
            f"fully_shard({name}): reshard_after_forward={value!r} with several dp_mesh_dims shard dims "
            f"{dp.shard_dims}; resharding to a subgroup needs one shard dim: use True or False."
        )
    if isinstance(value, int) and 1 <= value <= dp.shard_size and dp.shard_size % value == 0:
        return
    raise FSDPUsageError(
        f"fully_shard({name}): reshard_after_forward={value!r}; expected None, True, False, or an int that "
        f"divides the shard world size {dp.shard_size} (the number of ranks to reshard over after forward)."
    )


def _plan_params(modules: tuple[nn.Module, ...], ignored: set[nn.Parameter], name: str) -> list[_ParamPlan]:
    """Parameters this call manages: not ignored, not inside an already fully_shard'ed submodule."""
    plans = []
    for managed in schedule.managed_params(modules, lambda m: isinstance(m, FSDPModule), ignored):
        owner = managed_by(managed.param)
        if owner is not None:
            raise FSDPUsageError(
                f"fully_shard({name}): parameter {managed.fqn} is already managed by fully_shard({owner}). "
                "Apply fully_shard bottom-up (submodules before their parents). A parameter shared "
                "between modules must be sharded once: apply fully_shard to their common ancestor "
                "only, or pass it in ignored_params."
            )
        if managed.param.dim() == 0:
            raise FSDPUsageError(
                f"fully_shard({name}): parameter {managed.fqn} is a scalar and cannot be sharded; give it shape (1,) "
                "or pass it in ignored_params."
            )
        check_grad_dtype(managed.param, managed.fqn, name)
        plans.append(_ParamPlan(managed))
    return plans


def _check_devices(plans: list[_ParamPlan], dp: DataParallelMesh, name: str) -> None:
    devices = {}
    for plan in plans:
        devices.setdefault(plan.managed.param.device.type, plan.managed.fqn)
    if len(devices) > 1:
        where = ", ".join(f"{fqn} on {dev}" for dev, fqn in devices.items())
        raise FSDPUsageError(
            f"fully_shard({name}): parameters are on different devices ({where}); move the module to one "
            "device (or build it on meta) before fully_shard."
        )
    for dev, fqn in devices.items():
        if dev not in ("meta", "cpu", dp.mesh.device_type):
            raise FSDPUsageError(
                f"fully_shard({name}): parameter {fqn} is on {dev} but the mesh is on {dp.mesh.device_type}."
            )


def _placement(plan: _ParamPlan, shard_placement_fn, meshes: "_CallMeshes", name: str) -> tuple[DataParallelMesh, int]:
    """The mesh a parameter is sharded on and its shard dim, from ``shard_placement_fn``'s answer:
    None, ``Shard(dim)``, or PyTorch 2.13's ``ShardPlacementResult(placement, mesh_info)``."""
    param, fqn = plan.managed.param, plan.managed.fqn
    placement = shard_placement_fn(param) if shard_placement_fn is not None else None
    dp = meshes.default
    if compat.ShardPlacementResult is not None and isinstance(placement, compat.ShardPlacementResult):
        dp = meshes.of_result(placement.mesh_info, fqn)
        placement = placement.placement
    if placement is None:
        return dp, 0
    if not isinstance(placement, Shard):
        raise FSDPUsageError(
            f"fully_shard({name}): shard_placement_fn returned {placement!r} for {fqn}; expected Shard(dim), "
            "a ShardPlacementResult, or None"
        )
    ndim = param.dim()
    if not -ndim <= placement.dim < ndim:
        raise FSDPUsageAssertionError(
            f"fully_shard({name}): shard_placement_fn returned Shard({placement.dim}) for {fqn} of shape "
            f"{tuple(param.shape)}; the dim must be in [{-ndim}, {ndim})."
        )
    return dp, placement.dim % ndim


class _CallMeshes:
    """The data-parallel meshes of one fully_shard call: its own, and those ``shard_placement_fn``
    names through ``ShardPlacementResult`` mesh infos, one object per pair of process groups
    (shard, replicate), as PyTorch's FSDP2 groups parameters."""

    def __init__(self, default: DataParallelMesh, name: str):
        self.default = default
        self.name = name
        self._by_groups = {(default.shard_group, default.replicate_group): default}

    def of_result(self, mesh_info: Any, fqn: str) -> DataParallelMesh:
        mesh = getattr(mesh_info, "mesh", None)
        default = self.default
        if mesh is not None and (mesh == default.mesh or mesh == default.shard_mesh):
            return default
        where = f"fully_shard({self.name}): shard_placement_fn put parameter {fqn} on mesh {mesh}"
        if not isinstance(mesh, DeviceMesh) or getattr(mesh_info, "shard_mesh_dim", None) is None:
            raise FSDPUsageError(
                f"{where} with {type(mesh_info).__name__}; a ShardPlacementResult needs an FSDPMeshInfo or "
                "HSDPMeshInfo whose mesh is a DeviceMesh."
            )
        if getattr(mesh_info, "is_spmd_mesh", False):
            raise FSDPUsageNotImplementedError(
                f"{where} with dp_mesh_dims (a full SPMD mesh); fsdp2 takes dp_mesh_dims for the call's own mesh "
                "only. Give the parameter a mesh info of its data-parallel mesh, or the call's mesh."
            )
        shard_dim, replicate_dim = mesh_info.shard_mesh_dim, getattr(mesh_info, "replicate_mesh_dim", None)
        if (mesh.ndim, shard_dim, replicate_dim) not in ((1, 0, None), (2, 1, 0)):
            raise FSDPUsageNotImplementedError(
                f"{where} (shard dim {shard_dim}, replicate dim {replicate_dim}); fsdp2 shards on a 1-D mesh "
                "(FSDPMeshInfo(mesh, shard_mesh_dim=0)) or a 2-D (replicate, shard) mesh (HSDPMeshInfo(mesh, "
                "shard_mesh_dim=1, replicate_mesh_dim=0))."
            )
        # This rank's data-parallel peers must each hold their part of the parameter: its mesh (one
        # copy per rank, sliced or unflattened from a root) must cover them.
        ours = set(default.mesh.mesh.flatten().tolist())
        theirs = set(compat.root_mesh(mesh).mesh.flatten().tolist())
        if not ours <= theirs:
            raise FSDPUsageError(
                f"{where}, whose ranks {sorted(theirs)} do not contain the call's data-parallel ranks "
                f"{sorted(ours)} (mesh {default.mesh}). Give it a mesh sliced or unflattened from the mesh the "
                "data-parallel mesh comes from, e.g. FSDPMeshInfo(world_mesh._unflatten(0, (efsdp, ep), "
                "('efsdp', 'ep'))['efsdp'], shard_mesh_dim=0)."
            )
        dp = DataParallelMesh.from_mesh(mesh, self.name)
        return self._by_groups.setdefault((dp.shard_group, dp.replicate_group), dp)


def _move_buffers(module: nn.Module, dp: DataParallelMesh) -> None:
    for mod in module.modules():
        buffers = compat.module_buffers(mod)
        for bname, buf in buffers.items():
            if buf is not None and buf.device.type not in ("meta", dp.device.type):
                buffers[bname] = buf.to(dp.device)


def _register_state_dict_hooks(group: ParamGroup) -> None:
    """On every module holding one of the group's parameters: ``state_dict()`` and
    ``load_state_dict()`` see the shards (the group reshards first, as in PyTorch); a full
    tensor being loaded becomes this rank's box of it (no communication); parameters a load
    with ``assign=True`` replaced are taken over."""
    by_module: dict[int, tuple[nn.Module, list[tuple[str, ShardedParam]]]] = {}
    for p in group.params:
        for slot in p.slots:
            by_module.setdefault(id(slot.module), (slot.module, []))[1].append((slot.name, p))

    def reshard(*_: Any) -> None:
        group.reshard()

    for module, named in by_module.values():

        def to_local_boxes(module, state_dict, prefix, *_, named=named) -> None:
            group.reshard()
            for name, p in named:
                key = prefix + name
                value = state_dict.get(key)
                ours = p.sharded_param
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == ours.shape:
                    state_dict[key] = local_part_like(ours, value)

        module.register_state_dict_pre_hook(reshard)
        module.register_load_state_dict_pre_hook(to_local_boxes)
        module.register_load_state_dict_post_hook(lambda *_: group.refresh_params())
