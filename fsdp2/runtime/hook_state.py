"""Forward/backward hooks of one fully_shard'ed module, and the root's per-iteration bookkeeping."""

from __future__ import annotations

from enum import Enum, auto
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map

from fsdp2.runtime.param_group import ParamGroup
from fsdp2.policies import MixedPrecisionPolicy


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()  # gradients flow through this module's outputs
    POST_BACKWARD = auto()  # this module's gradients were handed off for reduction


class RootContext:
    """What the root module tracks for one forward/backward iteration of the whole tree."""

    def __init__(self, states: list["FSDPState"]):
        self.states = states  # every FSDPState under the root, in module (pre-)order
        # Order in which groups *finished* forward this iteration: backward runs it in reverse
        # (the root, finishing last, is first in backward and prefetches the last block).
        self.post_forward_order: list[FSDPState] = []
        self.in_backward = False
        self.is_last_backward = True
        self._reducing: list[ParamGroup] = []  # groups with reduce-scatters in flight
        groups = [s.group for s in states if s.group is not None]
        self.streams = groups[0].streams if groups else None
        self._offloads = any(p.offload for g in groups for p in g.params)
        # Inside the root's forward the all-gather stream need not wait for compute before
        # each group (nothing there writes shards), so all-gathers run ahead: implicit prefetch.
        self.gathers_may_run_ahead = False

    def begin_forward(self) -> None:
        if self.in_backward:
            return
        self.post_forward_order.clear()
        if self.streams is not None:
            self.streams.all_gather.wait_for_compute()  # the optimizer step wrote the shards
            self.gathers_may_run_ahead = True

    def end_forward(self) -> None:
        self.gathers_may_run_ahead = False

    def begin_backward(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        # Runs once autograd has finished the whole backward pass.
        Variable._execution_engine.queue_callback(self.finish_backward)

    def track_reduce(self, group: ParamGroup) -> None:
        """Bound memory: at most two groups' reduce-scatters in flight, finish the oldest."""
        self._reducing.append(group)
        while len(self._reducing) > 2:
            self._reducing.pop(0).finish_reduce()

    def finish_backward(self) -> None:
        # Groups whose grads never all arrived (unused or frozen params) still owe their
        # reduction, and groups unsharded for backward still hold full parameters.
        for state in reversed(self.states):
            group = state.group
            if group is None:
                continue
            if not group.reduced_this_backward and group.has_unreduced_grads:
                state.run_post_backward()
            elif group.reshard_after_backward:
                group.reshard()
        if self.is_last_backward:
            for group in self._reducing:
                group.finish_reduce()
            self._reducing.clear()
            if self._offloads and self.streams is not None:
                self.streams.host_waits_for_compute()  # gradients copied to the host asynchronously
        for state in self.states:
            state.training_state = TrainingState.IDLE
            if state.group is not None:
                state.group.end_backward()
        self.in_backward = False


class FSDPState:
    """Hooks that unshard a module's group before use and reshard/reduce after."""

    def __init__(self, module: nn.Module, group: ParamGroup | None, mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool):
        self.module = module
        self.group = group
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.training_state = TrainingState.IDLE
        self.root: RootContext | None = None  # set on the first forward (lazy init)
        self.is_root = False
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] | None = None  # None: implicit (reverse forward order)
        module.register_forward_pre_hook(self._pre_forward_hook, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward_hook, with_kwargs=True)

    # -- lazy init ----------------------------------------------------------------------------------

    def _lazy_init(self) -> None:
        """The first module to run forward becomes the root of every fully_shard'ed module below it."""
        states = [m._fsdp_state for m in self.module.modules() if isinstance(getattr(m, "_fsdp_state", None), FSDPState)]
        root = RootContext(states)
        for state in states:
            state.root = root
            state.is_root = state is self

    # -- forward --------------------------------------------------------------------------------------

    # The hooks stay eager under torch.compile: they do communication and Python bookkeeping,
    # and tracing them would only add graph breaks and recompilations.
    @torch._dynamo.disable
    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.root is None:
            self._lazy_init()
        if self.is_root:
            self.root.begin_forward()
        self.training_state = TrainingState.FORWARD
        run_ahead = self.root.gathers_may_run_ahead
        if self.group is not None:
            self.group.unshard(async_op=True, wait_for_compute=not run_ahead)
            self.group.wait_for_unshard()
        for other in self.forward_prefetch:
            if other.group is not None:
                other.group.unshard(async_op=True, wait_for_compute=not run_ahead)
        if self.mp_policy.param_dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    @torch._dynamo.disable
    def _post_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.group is not None and self._should_reshard_after_forward():
            self.group.reshard(after_forward=torch.is_grad_enabled())
        if self.group is not None and not self.root.in_backward:
            self.root.post_forward_order.append(self)
        if torch.is_grad_enabled():
            for tensor in _floating_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._pre_backward_hook)
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        self.training_state = TrainingState.IDLE
        if self.is_root:
            self.root.end_forward()
        return output

    def _should_reshard_after_forward(self) -> bool:
        if not torch.is_grad_enabled():
            return True  # no backward will follow: keep nothing gathered
        if self.root.in_backward:
            return False  # activation-checkpoint recompute: backward needs the params right now
        # The root's backward starts right after forward; resharding it would only re-gather.
        return self.reshard_after_forward and not self.is_root

    # -- backward -----------------------------------------------------------------------------------

    @torch._dynamo.disable
    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        self.root.begin_backward()
        if self.training_state == TrainingState.PRE_BACKWARD:
            return  # already done for another output of this module
        self.training_state = TrainingState.PRE_BACKWARD
        if self.group is not None:
            self.group.unshard(async_op=True)
            self.group.wait_for_unshard()
        for other in self._backward_prefetch_targets():
            if other.group is not None:
                other.group.unshard(async_op=True)  # no-op unless it is (partially) sharded

    def _backward_prefetch_targets(self) -> list["FSDPState"]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = self.root.post_forward_order
        if self in order:
            index = order.index(self)
            if index > 0:
                return [order[index - 1]]
        return []

    def on_grad_ready(self, param) -> None:
        """Post-accumulate-grad hook of each unsharded parameter of this group."""
        if self.group.note_grad_ready(param) and not self.group.reduced_this_backward:
            self.run_post_backward()

    def run_post_backward(self) -> None:
        self.training_state = TrainingState.POST_BACKWARD
        self.group.post_backward()
        if self.group.has_pending_reduce:
            self.root.track_reduce(self.group)


def _floating_tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)
