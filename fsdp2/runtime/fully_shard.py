"""``fully_shard``: turn a module's parameters into DTensor shards and install the FSDP hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fsdp2.runtime.dp_mesh import DataParallelMesh
from fsdp2.runtime.dtensor_spec import ShardedSpec, sharded_spec
from fsdp2.errors import FSDPUsageError
from fsdp2.runtime.fsdp_module import FSDPModule
from fsdp2.runtime.hook_state import FSDPState
from fsdp2.runtime.param_group import ParamGroup
from fsdp2.policies import MixedPrecisionPolicy, OffloadPolicy
from fsdp2.runtime.sharded_param import ParamSlot, ShardedParam, managed_by

_FSDP_CLASSES: dict[type, type] = {}


@dataclass
class _ParamPlan:
    """What fully_shard will do with one parameter, decided before anything is changed."""

    fqn: str
    param: nn.Parameter
    slots: list[ParamSlot]
    shard_dim: int = 0
    spec: ShardedSpec | None = None


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int = True,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters (those not already managed by a fully_shard'ed submodule).

    Apply it bottom-up: to each block first, then to the root. Every managed parameter becomes an
    ``nn.Parameter`` wrapping a DTensor (``Shard(0)`` on ``mesh`` unless ``shard_placement_fn``
    says otherwise). Forward and backward all-gather the parameters just in time and
    reduce-scatter the gradients. Returns ``module``, whose class now also derives from
    :class:`FSDPModule`.
    """
    name = type(module).__name__
    if not isinstance(module, nn.Module):
        raise FSDPUsageError(f"fully_shard expects an nn.Module, got {name}")
    if isinstance(module, FSDPModule):
        raise FSDPUsageError(f"fully_shard was already applied to this {name}; apply it once per module")
    _check_policies(mp_policy, offload_policy, name)
    dp = DataParallelMesh.from_mesh(mesh, name)
    reshard, post_forward_ranks = _resolve_reshard_after_forward(reshard_after_forward, dp, name)
    plans = _plan_params(module, set(ignored_params or ()), name)
    _check_devices(plans, dp, name)
    for plan in plans:
        plan.shard_dim = _shard_dim(plan, shard_placement_fn, name)
        plan.spec = sharded_spec(plan.fqn, plan.param, dp, plan.shard_dim)

    post_forward_subgroup = None
    if post_forward_ranks is not None and plans:
        subgroup, position = dp.subgroup(post_forward_ranks)  # collective: before any change
        post_forward_subgroup = (subgroup, position, post_forward_ranks)

    # Validation is over: from here on we change the module.
    def on_grad_ready(param: ShardedParam) -> None:
        module._fsdp_state.on_grad_ready(param)

    sharded = [
        ShardedParam(p.fqn, p.param, p.slots, dp, p.shard_dim, p.spec, mp_policy, offload_policy, on_grad_ready, owner=name)
        for p in plans
    ]
    _move_buffers(module, dp)
    group = ParamGroup(sharded, dp) if sharded else None
    if group is not None and post_forward_subgroup is not None:
        group.post_forward_subgroup = post_forward_subgroup
    state = FSDPState(module, group, mp_policy, reshard)
    module.__dict__["_fsdp_state"] = state
    module.__class__ = _fsdp_class(type(module))
    return module


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


def _resolve_reshard_after_forward(value: bool | int, dp: DataParallelMesh, name: str) -> tuple[bool, int | None]:
    """(reshard after forward?, size of the post-forward subgroup or None for a full reshard)."""
    if isinstance(value, bool):
        return value, None
    if isinstance(value, int) and 1 <= value <= dp.shard_size and dp.shard_size % value == 0:
        if value == 1:
            return False, None  # every rank keeps a full copy
        if value == dp.shard_size:
            return True, None
        return True, value
    raise FSDPUsageError(
        f"fully_shard({name}): reshard_after_forward={value!r}; expected True, False, or an int that divides "
        f"the shard world size {dp.shard_size} (the number of ranks to reshard over after forward)."
    )


def _plan_params(module: nn.Module, ignored: set[nn.Parameter], name: str) -> list[_ParamPlan]:
    """Parameters this call manages: not ignored, not inside an already fully_shard'ed submodule."""
    plans: dict[nn.Parameter, _ParamPlan] = {}
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, mod = stack.pop()
        for pname, param in mod._parameters.items():
            if param is None or param in ignored:
                continue
            fqn = f"{prefix}{pname}"
            owner = managed_by(param)
            if owner is not None:
                raise FSDPUsageError(
                    f"fully_shard({name}): parameter {fqn} is already managed by fully_shard({owner}). "
                    "Apply fully_shard bottom-up (submodules before their parents). A parameter shared "
                    "between modules must be sharded once: apply fully_shard to their common ancestor "
                    "only, or pass it in ignored_params."
                )
            if param.dim() == 0:
                raise FSDPUsageError(
                    f"fully_shard({name}): parameter {fqn} is a scalar and cannot be sharded; give it shape (1,) "
                    "or pass it in ignored_params."
                )
            plan = plans.get(param)
            if plan is None:
                plans[param] = _ParamPlan(fqn, param, [ParamSlot(mod, pname)])
            else:
                plan.slots.append(ParamSlot(mod, pname))  # tied: same parameter, another place
        for cname, child in reversed(list(mod._modules.items())):
            if child is not None and not isinstance(child, FSDPModule):
                stack.append((f"{prefix}{cname}.", child))
    # Keep parameters() order so buffers are laid out as the user declared the model.
    order = {id(p): i for i, p in enumerate(module.parameters())}
    return sorted(plans.values(), key=lambda p: order.get(id(p.param), -1))


def _check_devices(plans: list[_ParamPlan], dp: DataParallelMesh, name: str) -> None:
    devices = {}
    for plan in plans:
        devices.setdefault(plan.param.device.type, plan.fqn)
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


def _shard_dim(plan: _ParamPlan, shard_placement_fn, name: str) -> int:
    placement = shard_placement_fn(plan.param) if shard_placement_fn is not None else None
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise FSDPUsageError(
            f"fully_shard({name}): shard_placement_fn returned {placement!r} for {plan.fqn}; expected Shard(dim) or None"
        )
    ndim = plan.param.dim()
    if not -ndim <= placement.dim < ndim:
        raise FSDPUsageError(
            f"fully_shard({name}): shard_placement_fn returned Shard({placement.dim}) for {plan.fqn} of shape "
            f"{tuple(plan.param.shape)}; the dim must be in [{-ndim}, {ndim})."
        )
    return placement.dim % ndim


def _move_buffers(module: nn.Module, dp: DataParallelMesh) -> None:
    for mod in module.modules():
        for bname, buf in mod._buffers.items():
            if buf is not None and buf.device.type not in ("meta", dp.device.type):
                mod._buffers[bname] = buf.to(dp.device)
