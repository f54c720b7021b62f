"""What PyTorch's own code reads from an fsdp2 module, which passes ``isinstance(m, torch FSDPModule)``.

Frameworks and PyTorch branch on that check and then reach past the public methods into FSDP2's
private state: ``fully_shard.state(m)`` (pipelining's manual post-backward up to torch 2.14) and
``m._get_fsdp_state()`` (``register_fsdp_forward_method``, the FSDP memory tracker, pipelining's
schedules). fsdp2's state is shaped differently, so both return a :class:`TorchStateView`: the
members PyTorch's callers use, routed to fsdp2's equivalents. Any other private member raises,
naming the caller and the member, instead of half-working.
"""

from __future__ import annotations

import sys
from typing import Any

from fsdp2.errors import FSDPUsageAssertionError, FSDPUsageError
from fsdp2.runtime.hooks import FSDPState
from fsdp2.runtime.param_group import ParamGroup


class UnsupportedTorchInternal(FSDPUsageError, AttributeError):
    """PyTorch code read a private FSDP2 member that fsdp2 has no equivalent for. Also an
    AttributeError, so ``hasattr`` probes still answer False."""


def _caller() -> str:
    """``module.function`` of the code that asked for the missing member (three frames up:
    past ``_unsupported`` and ``__getattr__``/``__setattr__``)."""
    frame = sys._getframe(3)
    code = frame.f_code
    return f"{frame.f_globals.get('__name__', '?')}.{getattr(code, 'co_qualname', code.co_name)}"


class _Unsupported:
    """Raises a clear error for private members PyTorch's FSDP2 has and fsdp2 does not, read or
    written (a write that silently landed on the view would change nothing)."""

    _what = "PyTorch FSDP2 state"
    _fields: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)  # copy/pickle protocol probes
        raise self._unsupported("reads", name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._fields or isinstance(getattr(type(self), name, None), property):
            object.__setattr__(self, name, value)
        else:
            raise self._unsupported("sets", name)

    def _unsupported(self, verb: str, name: str) -> UnsupportedTorchInternal:
        return UnsupportedTorchInternal(
            f"{_caller()} {verb} {self._what}.{name} of a module managed by fsdp2; fsdp2 has no such internal. "
            "Use fsdp2's public FSDPModule methods (or fsdp2.tools.memory_meter for memory tracking), or "
            "shard this module with torch.distributed.fsdp.fully_shard."
        )


class TorchParamGroupView(_Unsupported):
    """One ``FSDPParamGroup`` as pipelining drives it: gathered ahead of a stage's forward,
    ``post_backward()`` after the last microbatch."""

    _what = "FSDPParamGroup"
    _fields = ("_group",)

    def __init__(self, group: ParamGroup):
        self._group = group

    def unshard(self, async_op: bool = False) -> None:
        self._group.unshard(async_op=async_op)

    def wait_for_unshard(self) -> None:
        self._group.wait_for_unshard()

    def post_backward(self) -> None:
        """Reduce the gradients accumulated over the microbatches (as the flags now say), then
        reshard if resharding after backward is on."""
        self._group.post_backward()


class TorchStateContextView(_Unsupported):
    """``FSDPStateContext``: what every state under one root shares."""

    _what = "FSDPStateContext"
    _fields = ("_state",)

    def __init__(self, state: FSDPState):
        self._state = state

    @property
    def all_states(self) -> list["TorchStateView"]:
        root = self._state.root  # None before the first forward: no states known yet, as in PyTorch
        return [TorchStateView.of(s) for s in root.states] if root is not None else []

    @property
    def is_last_backward(self) -> bool:
        return self._state.settings.is_last_backward

    @is_last_backward.setter
    def is_last_backward(self, value: bool) -> None:
        self._state.settings.is_last_backward = value


class TorchCommContextView(_Unsupported):
    """``FSDPCommContext``: one per root, as PyTorch's root shares its own with every state under
    it. Pipelining compares them by identity (stages whose roots share one cannot defer their
    gradient reductions' waits); fsdp2's roots never share one."""

    _what = "FSDPCommContext"

    @classmethod
    def of(cls, root_state: FSDPState) -> "TorchCommContextView":
        view = root_state.torch_views.get(cls)
        if view is None:
            view = root_state.torch_views[cls] = cls()
        return view


class TorchStateView(_Unsupported):
    """``fully_shard.state(m)`` / ``m._get_fsdp_state()`` of an fsdp2 module, as PyTorch reads it."""

    _what = "FSDPState"
    _fields = ("_state",)

    def __init__(self, state: FSDPState):
        self._state = state

    @classmethod
    def of(cls, state: FSDPState) -> "TorchStateView":
        """The one view of ``state`` (callers may compare states by identity, as PyTorch's are),
        kept by the state: a table of views would keep every state alive."""
        view = state.torch_views.get(cls)
        if view is None:
            view = state.torch_views[cls] = cls(state)
        return view

    @property
    def _state_ctx(self) -> TorchStateContextView:
        return TorchStateContextView(self._state)

    @property
    def _comm_ctx(self) -> TorchCommContextView:
        root = self._state.root  # before the first forward each state is its own root, as in PyTorch
        return TorchCommContextView.of(root.root_state if root is not None else self._state)

    @property
    def _fsdp_param_groups(self) -> list[TorchParamGroupView]:
        """One per mesh the call's parameters are sharded on, in the order their groups gather."""
        return [TorchParamGroupView(group) for group in self._state.groups if group.has_params]

    @property
    def _fsdp_param_group(self) -> TorchParamGroupView | None:
        """The one group (None without parameters); as PyTorch, an AssertionError with several."""
        groups = self._fsdp_param_groups
        if len(groups) > 1:
            raise FSDPUsageAssertionError(
                f"_fsdp_param_group: fully_shard({self._state.name}) shards its parameters on {len(groups)} meshes, "
                "one FSDPParamGroup each: read _fsdp_param_groups instead."
            )
        return groups[0] if groups else None

    def _pre_forward(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._state._pre_forward_hook(module, args, kwargs)

    def _post_forward(self, module, args: tuple, output: Any) -> Any:
        return self._state._post_forward_hook(module, args, {}, output)

    def _root_post_backward_final_callback(self) -> None:
        """End of the (manually driven) backward: finish every group and wait for the reductions."""
        root = self._state.root
        if root is not None:
            root.finish_backward()
