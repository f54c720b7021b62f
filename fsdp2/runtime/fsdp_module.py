"""``FSDPModule``: the methods a fully_shard'ed module gains (its class is swapped to include them)."""

from __future__ import annotations

import functools
from typing import Any, Iterable, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2.errors import FSDPUsageError
from fsdp2.layout.regions import local_part_like
from fsdp2.runtime.hook_state import FSDPState
from fsdp2.runtime.param_group import GroupState


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``; ``wait()`` blocks until the parameters are usable."""

    def __init__(self, state: FSDPState):
        self._state = state

    def wait(self) -> None:
        if self._state.group is not None:
            self._state.group.wait_for_unshard()


class FSDPModule:
    """Mixin placed in front of a module's own class by ``fully_shard``."""

    _fsdp_state: FSDPState

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state]
        return [m._fsdp_state for m in self.modules() if isinstance(m, FSDPModule)]

    # -- manual control -------------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (e.g. ahead of its forward)."""
        state = self._fsdp_state
        if state.group is not None:
            state.group.unshard(async_op=async_op)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's gathered parameters; only the shards remain."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reshard()

    # -- settings ---------------------------------------------------------------------------------

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps full local gradients and communicates nothing (accumulation)."""
        for state in self._fsdp_states(recurse):
            if state.group is not None:
                state.group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for state in self._fsdp_states(recurse):
            if state.group is not None:
                state.group.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise FSDPUsageError(f"set_reshard_after_forward expects a bool, got {reshard_after_forward!r}")
        for state in self._fsdp_states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the next backward does not wait for its gradient reductions (microbatching)."""
        root = self._fsdp_state.root
        if root is None:
            raise FSDPUsageError(f"{type(self).__name__}.set_is_last_backward: run a forward first")
        root.is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel world size."""
        # 0 would silently fall back to the world size (``factor or world``), negatives flip signs.
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise FSDPUsageError(f"set_gradient_divide_factor: factor must be a positive number, got {factor!r}")
        for state in self._fsdp_states(recurse=True):
            if state.group is not None:
                state.group.gradient_divide_factor = factor

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Issue these modules' all-gathers at the start of this module's forward."""
        self._fsdp_state.forward_prefetch = _states_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Issue these modules' all-gathers at the start of this module's backward."""
        self._fsdp_state.backward_prefetch = _states_of(modules, "set_modules_to_backward_prefetch")

    def _require_sharded(self, error_suffix: str) -> list[FSDPState]:
        """Every FSDP state below this module, after checking none holds gathered parameters."""
        states = self._fsdp_states(recurse=True)
        if any(s.group is not None and s.group.state != GroupState.SHARDED for s in states):
            raise FSDPUsageError(f"{type(self).__name__}{error_suffix}")
        return states

    # -- nn.Module overrides ------------------------------------------------------------------------

    def _apply(self, fn, recurse: bool = True):
        # to()/to_empty()/cuda() replace parameter contents; re-read our sharded references.
        states = self._require_sharded(": cannot move or convert while parameters are unsharded; call reshard() first")
        result = super()._apply(fn, recurse)
        for state in states:
            if state.group is not None:
                for param in state.group.params:
                    param.refresh_after_apply()
        return result

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Like ``nn.Module.load_state_dict``, but checks everything before changing anything.

        Values may be DTensors sharded like ours (no communication) or full tensors (each rank
        copies its own rows, no communication).
        """
        self._require_sharded(".load_state_dict: call reshard() first")
        current = self.state_dict()
        _check_compatible(type(self).__name__, current, state_dict, strict)
        converted = {k: _local_part(current[k], v) if k in current else v for k, v in state_dict.items()}
        return super().load_state_dict(converted, strict=strict, assign=assign)


def _local_part(current: Any, value: Any) -> Any:
    """A full tensor for a sharded entry becomes this rank's box of it (no communication)."""
    if isinstance(current, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return local_part_like(current, value)
    return value


def _states_of(modules: Iterable[Any], method: str) -> list[FSDPState]:
    if isinstance(modules, nn.Module):  # would fail later as "object is not iterable"
        raise FSDPUsageError(f"{method} expects a list of modules, got a single {type(modules).__name__}; wrap it in [ ]")
    states = []
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise FSDPUsageError(f"{method}: {type(m).__name__} is not fully_shard'ed; apply fully_shard to it first")
        states.append(m._fsdp_state)
    return states


def _check_compatible(owner: str, current: Mapping[str, Any], incoming: Mapping[str, Any], strict: bool) -> None:
    problems = []
    if strict:
        missing = sorted(set(current) - set(incoming))
        unexpected = sorted(set(incoming) - set(current))
        if missing:
            problems.append(f"missing keys: {missing}")
        if unexpected:
            problems.append(f"unexpected keys: {unexpected}")
    for key, value in incoming.items():
        if key not in current or not isinstance(value, torch.Tensor):
            continue
        have = current[key]
        if tuple(value.shape) != tuple(have.shape):
            problems.append(f"{key}: shape {tuple(value.shape)} in the state dict, {tuple(have.shape)} in the model")
        elif isinstance(value, DTensor) and isinstance(have, DTensor) and value.placements != have.placements:
            problems.append(
                f"{key}: placements {value.placements} in the state dict, {have.placements} in the model; "
                "pass full tensors or DTensors sharded like the model"
            )
    if problems:
        raise FSDPUsageError(f"{owner}.load_state_dict: nothing was loaded:\n  " + "\n  ".join(problems))


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>()`` unshard/reshard like ``forward`` does (e.g. ``generate``)."""
    if not isinstance(module, FSDPModule):
        raise FSDPUsageError(f"register_fsdp_forward_method: {type(module).__name__} is not fully_shard'ed")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise FSDPUsageError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    state = module._fsdp_state

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        args, kwargs = state._pre_forward_hook(module, args, kwargs)
        output = method(*args, **kwargs)
        return state._post_forward_hook(module, args, kwargs, output)

    object.__setattr__(module, method_name, wrapped)
