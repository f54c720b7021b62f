"""Forward/backward hooks of one fully_shard call, and the root's per-iteration state.

Each fully_shard call gets an :class:`FSDPState`: hooks on its module(s) that move its
:class:`ParamGroup` (one per mesh its parameters are sharded on, usually one) through the step
(``pre_forward`` ... ``finalize_backward``). The first
state to run forward becomes the root (lazy init): it owns a :class:`Root` shared by every state
below it, which orders backward prefetch, bounds reductions in flight and finishes backward.
Calls flow downward: hooks -> group -> gather/reduce -> collectives.
"""

from __future__ import annotations

import logging
from enum import Enum, auto
from typing import Any

import torch
import torch.nn as nn

from fsdp2 import compat
from fsdp2.errors import FSDPUsageError, FSDPUsageRuntimeError
from fsdp2.policies import MixedPrecisionPolicy
from fsdp2.runtime import schedule
from fsdp2.runtime.activations import cast_floating, map_tensors, tensors_in
from fsdp2.runtime.param_group import BackwardEnd, ParamGroup, Phase
from fsdp2.runtime.reduce import ReduceWindow
from fsdp2.runtime import traced_ops
from fsdp2.runtime.traced import TracedCall, TracedGroup
from fsdp2.runtime.traced_graph import EndOfBackward

# A child of PyTorch's FSDP logger, so ``TORCH_LOGS=+fsdp`` shows fsdp2's hook events as it shows
# PyTorch's own, under the same event names.
logger = logging.getLogger("torch.distributed.fsdp.fsdp2")


class Finalization(Enum):
    """Who ends a backward iteration (``FSDPModule.set_manual_backward_finalization``)."""

    AUTOMATIC = auto()  # the end of each autograd backward through the tree
    MANUAL = auto()  # the caller's ``finalize_backward()``, after one or more backwards


class BackwardState(Enum):
    """Where the root's tree is between one end of a backward iteration and the next::

        IDLE --(a group's pre-backward)--> RUNNING --(autograd's end, automatic)--> IDLE
        RUNNING --(autograd's end, manual)--> AWAITING_FINALIZE --(pre-backward)--> RUNNING
        AWAITING_FINALIZE --finalize_backward()--> IDLE
        AWAITING_FINALIZE --finalize_backward(async_op=True)--> REDUCING --(handle.wait())--> IDLE

    ``reset_iter_state`` returns to IDLE from anywhere.
    """

    IDLE = auto()
    RUNNING = auto()  # autograd runs a backward through the tree (its end-of-backward callback is queued)
    AWAITING_FINALIZE = auto()  # manual: backward(s) done; gradients wait for finalize_backward
    REDUCING = auto()  # finalize_backward(async_op=True) issued the reductions; its handle completes them


class IterationSettings:
    """Settings for the next iteration that users may set before the first forward.

    Each state owns one until lazy init; then every state under a root shares the root's.
    """

    def __init__(self) -> None:
        self.is_last_backward = True
        self.post_optim_event: Any = None
        self.max_reduces_in_flight = schedule.DEFAULT_MAX_REDUCES_IN_FLIGHT
        self.finalization = Finalization.AUTOMATIC


class Root:
    """What the root tracks for one forward/backward iteration of the whole tree."""

    def __init__(self, root_state: "FSDPState", states: list["FSDPState"], settings: IterationSettings):
        self.root_state = root_state
        self.states = states  # every FSDPState under the root, in module (pre-)order
        self.settings = settings
        # Order in which states *finished* forward this iteration: backward runs its reverse.
        self.post_forward_order: list[FSDPState] = []
        self.backward = BackwardState.IDLE
        # How this backward iteration ends: the setting when it began (it may not change until it ends).
        self.finalization = settings.finalization
        self._awaited_by: object | None = None  # in REDUCING: the handle whose wait() completes it
        self.reduce_window = ReduceWindow(settings.max_reduces_in_flight)
        groups = [g for s in states for g in s.groups]
        self.streams = groups[0].streams
        self._offloads = any(p.offload for g in groups for p in g.params)
        # Inside the root's forward the all-gather stream need not wait for compute before
        # each group (nothing there writes shards), so all-gathers run ahead: implicit prefetch.
        self.gathers_may_run_ahead = False

    def begin_forward(self, root_state: "FSDPState") -> None:
        self.post_forward_order.clear()
        for state in self.states:
            if state is not root_state:
                state.forget_forward()  # left over from a forward that raised
        event, self.settings.post_optim_event = self.settings.post_optim_event, None
        if event is not None:
            self.streams.all_gather.wait_event(event)  # the user's post-optimizer-step event
        else:
            self.streams.all_gather.wait_for_compute()  # the optimizer step wrote the shards
        self.gathers_may_run_ahead = True

    def end_forward(self) -> None:
        self.gathers_may_run_ahead = False
        for state in self.states:
            state.complete_unfinished_forward()

    def check_no_reduction_pending(self, what: str) -> None:
        if self.backward is BackwardState.REDUCING:
            raise FSDPUsageRuntimeError(
                f"{what} of {self.root_state.name}: the gradient reduction of finalize_backward(async_op=True) "
                "is still pending; call wait() on the handle it returned first"
            )

    def begin_backward(self) -> None:
        if self.backward is BackwardState.RUNNING:
            return
        if self.backward is BackwardState.IDLE:
            self.finalization = self.settings.finalization  # fixed until this iteration ends
        else:
            self.check_no_reduction_pending("a backward")
        self.backward = BackwardState.RUNNING
        compat.queue_backward_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """Autograd finished a backward through the tree (also called by PyTorch's pipelining on
        older releases, through fsdp2.runtime.torch_view)."""
        logger.debug("FSDP::root_post_backward")
        manual = self.backward is not BackwardState.IDLE and self.finalization is Finalization.MANUAL
        # A backward through the root's outputs ends every group's backward. One that never
        # reached them (a chunked loss's per-chunk backward through the head alone) ends only the
        # groups it ran: the others keep what they hold for the backward still to come.
        whole_model = False
        for group in self.root_state.groups:
            if group.phase is not Phase.IDLE:
                whole_model = True
        for state in reversed(self.states):
            for group in reversed(state.groups):  # as backward ran them
                if whole_model or group.phase is not Phase.IDLE:
                    if manual:
                        group.end_backward_before_finalize()
                    else:
                        group.finalize_backward()
            # A group some of whose modules ran alone after forward (the chunk's head) starts
            # its next forward afresh, gathering again what this backward freed.
            state.forget_forward()
        if manual:
            # The reductions this backward issued complete now: their gradients are in ``.grad``, as
            # PyTorch's FSDP2 writes them in its post-backward (a later zero_grad() clears them). What
            # no group reduced yet waits for finalize_backward().
            self.reduce_window.drain()
            self.backward = BackwardState.AWAITING_FINALIZE
            return
        # Every backward ends with its gradients in ``.grad``, as PyTorch's FSDP2 writes them in its
        # post-backward, whether or not it is the last backward before the optimizer step.
        self.reduce_window.drain()
        if self.settings.is_last_backward and self._offloads:
            self.streams.host_waits_for_compute()  # gradients copied to the host asynchronously
        self.backward = BackwardState.IDLE

    def finalize(self, awaited_by: object | None = None) -> None:
        """``finalize_backward``: reduce what the backwards left (as the gradient sync setting now
        says), reshard as resharding after backward now says, and complete the reductions; with
        ``awaited_by`` (the async handle) the reductions complete in :meth:`complete_reduction`."""
        self._check_finalize()
        logger.debug("FSDP::finalize_backward")
        for state in reversed(self.states):
            for group in reversed(state.groups):
                group.finalize_backward()
            state.forget_forward()
        if awaited_by is None:
            self._complete()
        else:
            self.backward = BackwardState.REDUCING
            self._awaited_by = awaited_by

    def complete_reduction(self, awaited_by: object) -> None:
        """The async handle's ``wait()``: the reductions ``finalize`` issued are in ``.grad``."""
        if self.backward is not BackwardState.REDUCING or self._awaited_by is not awaited_by:
            raise FSDPUsageRuntimeError(
                f"GradientReductionHandle.wait() of {self.root_state.name}: reset_iter_state() abandoned the "
                "gradient reduction this handle was waiting for (its gradients are lost)"
            )
        self._complete()

    def _complete(self) -> None:
        self.reduce_window.drain()
        if self._offloads:
            self.streams.host_waits_for_compute()  # gradients copied to the host asynchronously
        self._awaited_by = None
        self.backward = BackwardState.IDLE

    def _check_finalize(self) -> None:
        name = self.root_state.name
        self.check_no_reduction_pending("finalize_backward")
        if self.backward is BackwardState.RUNNING or compat.autograd_backward_running():
            raise FSDPUsageRuntimeError(
                f"{name}.finalize_backward: called during backward; call it after the backward (or the last of "
                "several backwards) returned"
            )
        finalization = self.finalization if self.backward is not BackwardState.IDLE else self.settings.finalization
        if finalization is not Finalization.MANUAL:
            raise FSDPUsageRuntimeError(
                f"{name}.finalize_backward: backward is finalized automatically; call "
                "set_manual_backward_finalization(True) on the root before the forward"
            )
        for state in self.states:
            for group in state.groups:
                reduce = group.reduce
                if reduce.holds_partial_sums or (
                    group.dp.is_hybrid and not group.requires_all_reduce and group.has_unreduced_grads
                ):
                    raise FSDPUsageRuntimeError(
                        f"{name}.finalize_backward: fully_shard({state.name}) keeps HSDP sums for a later all-reduce "
                        "(set_requires_all_reduce(False)), which manual finalization does not support; call "
                        "set_requires_all_reduce(True) before backward, or finalize automatically"
                    )

    def reset(self) -> None:
        """Abandon the current iteration (``FSDPModule.reset_iter_state``)."""
        for state in self.states:
            for group in state.groups:
                group.reset_iteration()
            state.forget_forward()
        self.reduce_window.discard()
        self.post_forward_order.clear()
        self.backward = BackwardState.IDLE
        self._awaited_by = None  # its handle's wait() now raises
        self.gathers_may_run_ahead = False


class FSDPState:
    """The hooks of one fully_shard call over ``modules`` (one, or several forming one group).

    Its parameters form one :class:`ParamGroup` per mesh they are sharded on (``groups``: one,
    unless ``shard_placement_fn`` put some on another mesh), each with its own collectives; the
    verbs apply to every group, in order (backward: in reverse).
    """

    def __init__(self, modules: tuple[nn.Module, ...], groups: list[ParamGroup], mp_policy: MixedPrecisionPolicy):
        self.modules = modules
        self.name = groups[0].name
        self.groups = groups
        self.mp_policy = mp_policy
        self.root: Root | None = None  # set on the first forward (lazy init)
        self.is_root = False
        self.settings = IterationSettings()
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] | None = None  # None: implicit (reverse forward order)
        self._modules_to_run: set[nn.Module] = set()  # modules of this group yet to finish this forward
        # What PyTorch's own code reads of this state, one view of each kind (fsdp2.runtime.torch_view).
        self.torch_views: dict[type, object] = {}
        # The hooks' path while torch.compile traces them: the call's, and one per group.
        self.traced_groups = [TracedGroup(group) for group in groups]
        self.traced_call = TracedCall(modules, self.traced_groups)
        # Where a compiled backward through this call (as the root) reports that it runs.
        self.end_anchor = torch.empty(0, device=groups[0].dp.device).requires_grad_()
        self.end_key = traced_ops.register_route(self)
        self._compiled_backward_end_queued = False
        self.states_below: list[FSDPState] = [self]  # every state at or under this call (fully_shard sets it)
        for module in modules:
            module.register_forward_pre_hook(_registered_pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(_registered_post_forward, with_kwargs=True)

    @property
    def group(self) -> ParamGroup:
        """The state's one group (most states have one; see ``groups``)."""
        self._check_one_group()
        return self.groups[0]

    @property
    def traced(self) -> TracedGroup:
        """The one group's traced path (see ``traced_groups``)."""
        self._check_one_group()
        return self.traced_groups[0]

    def _check_one_group(self) -> None:
        if len(self.groups) != 1:
            raise FSDPUsageError(
                f"fully_shard({self.name}) shards its parameters on {len(self.groups)} meshes, one group each: "
                "read FSDPState.groups (and traced_groups)"
            )

    # -- lazy init ----------------------------------------------------------------------------------

    def lazy_init(self) -> None:
        """The first state to run forward becomes the root of every fully_shard'ed module below it."""
        states = states_under(self.modules)
        for state in states:
            if state is not self and state.settings.finalization is Finalization.MANUAL:
                raise FSDPUsageRuntimeError(
                    f"set_manual_backward_finalization(True) was called on fully_shard({state.name}), which is not "
                    f"the root: the first module to run forward is {self.name}; call it on that one"
                )
        root = Root(self, states, self.settings)
        for state in states:
            state.root = root
            state.is_root = state is self
            state.settings = self.settings
            for group in state.groups:
                group.set_root(state.is_root)
                group.reduce_window = root.reduce_window
                group.refresh_params()  # parameters replaced since fully_shard (load with assign=True)
        self._name_groups(states)
        logger.debug("FSDP::lazy_init: root %s over %d fully_shard groups", self.name, len(states))

    def _name_groups(self, states: list["FSDPState"]) -> None:
        """Each group's module paths from the root, for its log lines."""
        paths: dict[int, list[str]] = {}
        for path, module in self.modules[0].named_modules():
            state = module.__dict__.get("_fsdp_state")
            if state is not None:
                paths.setdefault(id(state), []).append(path)
        for state in states:
            for group in state.groups:
                group.module_fqn = ", ".join(paths.get(id(state), []))

    # -- forward --------------------------------------------------------------------------------------

    # Two paths. Eager (also a block compiled inside an eager root's forward: block.compile()):
    # the hooks run outside the compiler, doing communication and Python bookkeeping. Traced
    # (torch.compile over the whole model): dynamo traces fsdp2.runtime.traced's graph ops.

    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if torch.compiler.is_compiling() and not self._eager_iteration_running():
            self.traced_call.pre_forward([other.traced_call for other in self.forward_prefetch])
            return self._cast_inputs(args, kwargs)
        return self._eager_pre_forward(module, args, kwargs)

    def _eager_iteration_running(self) -> bool:
        root = self.root
        return root is not None and (root.gathers_may_run_ahead or root.backward is BackwardState.RUNNING)

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.mp_policy.param_dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    @torch.compiler.disable
    def _eager_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ends_at_inputs: list[ParamGroup] = []
        with compat.outside_functorch():
            if self.root is None:
                self.lazy_init()
            if self.root.backward is BackwardState.RUNNING:
                # Activation-checkpoint recompute: gather (a no-op after this group's pre-backward)
                # and nothing else. Its forward may stop early, so it is not tracked as a forward.
                for group in self.groups:
                    group.unshard()
            elif not self._modules_to_run:  # the first of this group's modules in this forward
                self._modules_to_run = set(self.modules)
                try:
                    self._begin_group_forward()
                except BaseException:
                    self._modules_to_run.clear()  # nothing half-started: the next forward begins afresh
                    raise
                for group in self.groups:  # a loop, not a comprehension: no Python call per forward
                    if group.backward_end is BackwardEnd.INPUT_GRADS and torch.is_grad_enabled():
                        ends_at_inputs.append(group)
        if ends_at_inputs:  # inside any functorch transform: the inputs are its tensors
            args, kwargs = _EndBackwardAtInputs.wrap(ends_at_inputs, args, kwargs)
        return self._cast_inputs(args, kwargs)

    def _begin_group_forward(self) -> None:
        root = self.root
        if root.backward is BackwardState.REDUCING:
            root.check_no_reduction_pending("the forward")
        if self.is_root:
            logger.debug("FSDP::root_pre_forward")
            root.begin_forward(self)
        run_ahead = root.gathers_may_run_ahead
        manual = root.settings.finalization is Finalization.MANUAL
        for group in self.groups:
            logger.debug("%s", group.event("FSDP::pre_forward"))
            group.pre_forward(gathers_run_ahead=run_ahead, manual_finalization=manual)
        for other in self.forward_prefetch:
            for group in other.groups:
                group.unshard(async_op=True, wait_for_compute=not run_ahead)

    def _post_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if torch.compiler.is_compiling() and not self._eager_iteration_running():
            # Backward is autograd's: no pre-backward hook. Where the end of a backward has work a
            # graph does not do, the root's output tells this state when a compiled backward runs
            # (EndOfBackward), to end it as eager's end of backward does.
            if self.traced_call.post_forward() and torch.is_grad_enabled() and self._backward_end_has_work():
                output = self._marked_for_compiled_backward(output)
            return self._cast_output(output)
        return self._eager_post_forward(module, args, kwargs, output)

    def _backward_end_has_work(self) -> bool:
        """Read while a root call's forward is traced (dynamo guards on every flag read, so a change
        retraces): some group under it keeps sums for the next synced backward, which the graph
        may not take (its forward does not run the group, or reaches none of its parameters), or
        reduces unused parameters, whose zeros a group the graph does not reduce still gets (its
        parameters all unused, or its module not run in this step)."""
        for state in self.states_below:
            for group in state.groups:
                reduce = group.reduce
                if reduce.holds_unsynced_sums or reduce.partial_sums or reduce.include_unused:
                    return True
        return False

    def _marked_for_compiled_backward(self, output: Any) -> Any:
        marked = False

        def mark(t: torch.Tensor) -> torch.Tensor:
            nonlocal marked
            if marked or not (t.requires_grad and t.is_floating_point()):
                return t
            marked = True
            return EndOfBackward.apply(self.end_anchor, t, self.end_key)

        return map_tensors(mark, output)

    def compiled_backward_runs(self) -> None:
        """A compiled backward through this root call began (``fsdp2::end_backward``): its end
        reduces, for every group under it, what the graph did not (sums kept for a group the
        compiled forward did not run, unused parameters' zeros), as the end of an eager backward
        does; under manual finalization that waits for finalize_backward()."""
        if not self._compiled_backward_end_queued:
            self._compiled_backward_end_queued = True
            for state in self.states_below:
                for group in state.groups:
                    group.reduce.reduced_in_graph = False
            compat.queue_backward_callback(self._end_compiled_backward)

    def _end_compiled_backward(self) -> None:
        self._compiled_backward_end_queued = False
        self.end_anchor.grad = None
        if self.settings.finalization is Finalization.MANUAL:
            return
        for state in reversed(self.states_below):
            for group in reversed(state.groups):
                # Attribute reads only on the common path (nothing left): no call per group and step.
                reduce = group.reduce
                if reduce.holds_unsynced_sums or reduce.partial_sums or reduce.include_unused:
                    group.reduce_after_compiled_backward()

    def _cast_output(self, output: Any) -> Any:
        if self.mp_policy.output_dtype is not None:
            output = cast_floating(output, self.mp_policy.output_dtype)
        return output

    @torch.compiler.disable
    def _eager_post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if torch.is_grad_enabled():
            for tensor in tensors_in(output):
                if tensor.requires_grad and tensor.is_floating_point():
                    tensor.register_hook(self._pre_backward_hook)
        if module in self._modules_to_run:
            self._modules_to_run.discard(module)
            if not self._modules_to_run:
                with compat.outside_functorch():
                    if self.is_root:
                        self.root.end_forward()  # before the root joins the order: it is first in backward
                    self._end_group_forward()
        return self._cast_output(output)

    def _end_group_forward(self) -> None:
        grad_enabled = torch.is_grad_enabled()
        for group in self.groups:
            logger.debug("%s", group.event("FSDP::post_forward"))
            group.post_forward(grad_enabled=grad_enabled)
        self.root.post_forward_order.append(self)

    def complete_unfinished_forward(self) -> None:
        """Some of this group's modules never ran this forward: end the group's forward anyway."""
        if self._modules_to_run:
            self._modules_to_run.clear()
            self._end_group_forward()

    def forget_forward(self) -> None:
        self._modules_to_run.clear()

    # -- backward -----------------------------------------------------------------------------------

    @torch.compiler.disable
    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        self.root.begin_backward()
        started = False
        for group in self.groups:
            if group.pre_backward():
                logger.debug("%s", group.event("FSDP::pre_backward"))
                started = True
        if not started:
            return  # already done for another output of this group
        if self._modules_to_run:
            # Only some of the group's modules ran (a chunked loss calling the head alone): this
            # backward is the chunk's own and reaches no other group, so nothing is prefetched.
            return
        for other in self._backward_prefetch_targets():
            for group in reversed(other.groups):  # backward order
                group.unshard(async_op=True)  # no-op unless it is (partially) sharded

    def _backward_prefetch_targets(self) -> list["FSDPState"]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        return schedule.implicit_backward_prefetch(self.root.post_forward_order, self)


def states_under(modules: tuple[nn.Module, ...]) -> list[FSDPState]:
    """Every fully_shard state at or below ``modules``, in module (pre-)order."""
    states: list[FSDPState] = []
    for root_module in modules:
        for module in root_module.modules():
            state = module.__dict__.get("_fsdp_state")
            if isinstance(state, FSDPState) and state not in states:
                states.append(state)
    return states


class _EndBackwardAtInputs(torch.autograd.Function):
    """Identity on a group's forward inputs whose backward ends the groups' backward: it runs
    once autograd has the gradients of all of them, after every read of the groups' parameters.
    (Inputs that need no gradient give no signal: the end of backward finalizes such a group.)"""

    @staticmethod
    def forward(ctx, groups: list[ParamGroup], *inputs: torch.Tensor):
        ctx.groups = groups
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        for group in reversed(ctx.groups):
            group.inputs_grads_ready()
        return (None, *grads)

    @classmethod
    def wrap(cls, groups: list[ParamGroup], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if not inputs:
            return args, kwargs
        passed = dict(zip(map(id, inputs), cls.apply(groups, *inputs)))
        return map_tensors(lambda t: passed.get(id(t), t), (args, kwargs))


# The hooks registered on each module: functions that find the state as ``module._fsdp_state``,
# not the state's bound methods. A compiled step's guards then reach the state by that one
# attribute; through two bound methods they would check that both hooks' ``__self__`` are one
# object, a guard evaluated in Python with a dict-keys call per hook dict on every step.


def _registered_pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return module._fsdp_state._pre_forward_hook(module, args, kwargs)


def _registered_post_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    return module._fsdp_state._post_forward_hook(module, args, kwargs, output)
