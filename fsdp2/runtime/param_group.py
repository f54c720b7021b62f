"""The parameters of one fully_shard call, and their life through a training step.

A group has two state machines. Its *memory* state says what is held::

    SHARDED --unshard--> UNSHARDING --(gathers done)--> UNSHARDED --reshard--> SHARDED
                                                            |  reshard to a k-rank subgroup
                                                            v
                                                     PARTIALLY_SHARDED --unshard--> UNSHARDING

Its *phase* says where in the step it is::

    IDLE --pre_forward--> FORWARD --post_forward--> IDLE --pre_backward--> PRE_BACKWARD
         --post_backward--> POST_BACKWARD --finalize_backward--> IDLE
                            POST_BACKWARD --pre_backward--> PRE_BACKWARD  (run again in this backward)

The hooks (fsdp2.runtime.hooks) call the lifecycle verbs ``pre_forward``, ``post_forward``,
``pre_backward``, ``post_backward`` (also from the parameters' gradient hooks) and
``finalize_backward`` (under manual finalization, ``end_backward_before_finalize`` at the end of
each backward first); packing and collectives live in ``gather`` and ``reduce``.
"""

from __future__ import annotations

import logging
import weakref
from enum import Enum, auto

import torch
import torch.nn as nn

from fsdp2 import compat
from fsdp2.errors import FSDPUsageError
from fsdp2.policies import AllGatherPolicy
from fsdp2.runtime import schedule
from fsdp2.runtime.codecs import GatherCodec, PlainCodec, QuantizedCodec
from fsdp2.runtime.dp_mesh import DataParallelMesh
from fsdp2.runtime.extensions import SubclassCodec, has_hooks
from fsdp2.runtime.gather import GroupGather, Subgroup
from fsdp2.runtime.process_hooks import PROCESS_HOOKS
from fsdp2.runtime.grad_sinks import GradSinks
from fsdp2.runtime.group_step import GroupStep, Mode, backward_mode
from fsdp2.runtime.reduce import GroupReduce, Reduction, ReduceWindow
from fsdp2.runtime.sharded_param import (
    GradDtype,
    ShardedParam,
    free_all_unsharded,
    hold_all_sharded,
    hold_all_unsharded,
    take_unreduced_grads,
)
from fsdp2.runtime.streams import CommStreams


logger = logging.getLogger("torch.distributed.fsdp.fsdp2")


class GroupState(Enum):
    SHARDED = auto()  # only shards in memory
    PARTIALLY_SHARDED = auto()  # after forward with reshard_after_forward=k: 1/k of the group held
    UNSHARDING = auto()  # all-gather issued, not yet waited on
    UNSHARDED = auto()  # full parameters registered on the modules


class Phase(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()  # gradients flow through this group's outputs
    POST_BACKWARD = auto()  # this group's gradients were handed off for reduction


class BackwardEnd(Enum):
    """What tells a group that autograd no longer needs its gathered parameters this backward
    (the rule: ``schedule.backward_ends_at_inputs``)."""

    GRADS_READY = auto()  # every parameter it gathered has its gradient: nothing later reads them
    INPUT_GRADS = auto()  # its forward inputs have their gradients (else: the end of backward)


class ReshardAfterForward:
    """What a group keeps between its forward and its backward: the setting, and the actions it
    makes for a group that is, or is not, the root (``GroupStep.after_forward``).

    ``setting`` is the user's ``reshard_after_forward`` (None: decided when the root is known);
    ``subgroup`` the k ranks a 1/k copy is re-gathered over.
    """

    def __init__(self, setting: bool | int | None, shard_size: int, subgroup: Subgroup | None = None):
        self.shard_size = shard_size
        self.subgroup = subgroup
        self.set(setting)

    def set(self, setting: bool | int | None) -> None:
        """The setting (``set_reshard_after_forward``: all or nothing from now on, no 1/k copy is
        held any more) and the actions it makes for a group that is the root of the forward running
        or below it (eager's root is fixed at lazy init, a compiled step's is the first call its
        trace gathers): decided here, once per setting, not at every ``ParamGroup.configure``."""
        self.setting = setting
        self.as_root = schedule.after_forward(setting, is_root=True, shard_size=self.shard_size)
        self.below_root = schedule.after_forward(setting, is_root=False, shard_size=self.shard_size)


class GradReadiness:
    """Counts which of a group's parameters autograd has finished this backward, and calls
    ``on_all_ready`` once every parameter that needs a gradient has it.

    ``note`` is each parameter's gradient hook itself (one Python call per parameter and step).
    """

    def __init__(self, params: list[ShardedParam], on_all_ready) -> None:
        self._params = params
        self._on_all_ready = on_all_ready
        self._ready: set[int] = set()
        self._expected = 0

    def note(self, param: ShardedParam, _unsharded: torch.Tensor | None = None) -> None:
        """Record ``param``'s gradient (``_unsharded``: what autograd's hook passes)."""
        if not self._ready:
            # Counted once per backward: requires_grad may change between iterations, not within.
            self._expected = len([p for p in self._params if p.sharded_param.requires_grad])
        self._ready.add(id(param))
        if len(self._ready) == self._expected:
            self._on_all_ready()

    def reset(self) -> None:
        self._ready.clear()


class ParamGroup:
    """A group's parameters, their memory state and phase, and the verbs that move them on."""

    def __init__(
        self,
        params: list[ShardedParam],
        dp: DataParallelMesh,
        reshard_after_forward: ReshardAfterForward,
        name: str = "",
    ):
        self.name = name  # the fully_shard'ed module(s) by class, for messages
        # Their paths from the root ("layers.0"; "norm, output" for a list; "" for the root),
        # known at lazy init: hook events are logged under them, as PyTorch logs its own.
        self.module_fqn = ""
        self.params = params
        self.dp = dp
        self.state = GroupState.SHARDED
        self.phase = Phase.IDLE
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.keep_unsharded_storage = False  # reshard keeps the gathered memory (stable data pointers)
        self.unshard_in_backward = True
        self.requires_gradient_sync = True  # set_requires_gradient_sync
        self.requires_all_reduce = True  # HSDP: all-reduce across replicas (False: keep partial sums)
        self.backward_end = BackwardEnd.GRADS_READY  # decided again at each forward
        # A parameter other than ours was registered in one of the group's slots since fsdp2 last
        # read them (set eagerly by the registration watch below; refresh_params takes it over).
        self.params_replaced = False
        self.local_only = schedule.one_rank_skips_collectives(dp.shard_size)
        self.all_gather_policy: AllGatherPolicy | None = None
        self._assign_codecs()
        self.streams = CommStreams.for_device(dp.device)
        self.gather = GroupGather(params, dp, self.streams)
        self.reduce = GroupReduce(params, dp, self.streams, self.local_only)
        self.reduce_window: ReduceWindow | None = None  # the root's, handed over at lazy init
        self._subgroup_rows: list[torch.Tensor] = []  # per gather bucket, in PARTIALLY_SHARDED
        self._grads = GradReadiness(params, self._on_all_grads_ready)
        for p in params:
            p.bind_grad_ready(self._grads.note)
        self.is_root = False  # the root's group (lazy init decides)
        self.sinks = GradSinks(self)  # where a compiled backward's gradients enter
        self._sinks_follow: list | None = None  # the reduce steps the sinks were made for
        self.configure()
        _registrations.watch(self)

    def configure(self) -> None:
        """Decide the group's step (``self.step``, a GroupStep) anew from its settings and
        parameters: at fully_shard, after every setter and every re-read of the parameters. Eager
        and compiled steps read only the current one; the compiled step's sinks follow it."""
        reshard = self.reshard_after_forward
        steps = self.reduce.steps_of(tuple([p.trainable for p in self.params]))
        self.step = GroupStep(
            self.gather.step,
            tuple(steps),
            backward_mode(self.requires_gradient_sync, self.dp.is_hybrid, self.requires_all_reduce),
            self.reduce.include_unused,
            after_forward=reshard.as_root if self.is_root else reshard.below_root,
            after_forward_as_root=reshard.as_root,
            after_forward_below_root=reshard.below_root,
        )
        # The same steps (``steps_of`` hands out one list per pattern until a setting or the
        # parameters change): the sinks serve them already. set_requires_gradient_sync runs this
        # for every group at every microbatch.
        if steps is not self._sinks_follow:
            self._sinks_follow = steps
            self.sinks.follow(self.step.reduce_steps)

    def set_sync(self, *, gradient_sync: bool | None = None, all_reduce: bool | None = None) -> None:
        """``set_requires_gradient_sync`` / ``set_requires_all_reduce`` (HSDP)."""
        if gradient_sync is not None:
            self.requires_gradient_sync = gradient_sync
        if all_reduce is not None:
            self.requires_all_reduce = all_reduce
        self.configure()

    def configure_reduce(self, **changes) -> None:
        """The reduce settings (``ReduceSettings``' fields) of ``FSDPModule``'s setters."""
        self.reduce.configure(**changes)
        self.configure()

    def set_reduce_unused(self, include_unused: bool) -> None:
        """``set_reduce_scatter_unused_params``."""
        self.reduce.include_unused = include_unused
        self.configure()

    def set_custom_all_gather(self, comm) -> None:
        self.gather.set_custom_all_gather(comm)
        self.configure()

    def set_reshard_after_forward(self, reshard: bool) -> None:
        self.reshard_after_forward.set(reshard)
        self.configure()

    def set_root(self, is_root: bool) -> None:
        """Lazy init: whether this is the root's group (its after-forward action may differ)."""
        self.is_root = is_root
        self.configure()

    def event(self, label: str) -> str:
        """A hook event's log line for this group: ``FSDP::pre_forward (layers.0)``."""
        return f"{label} ({self.module_fqn})" if self.module_fqn else label

    @property
    def has_params(self) -> bool:
        return bool(self.params)

    def refresh_params(self) -> None:
        """Re-read parameters replaced or converted from outside (see ShardedParam.refresh)."""
        for p in self.params:
            p.refresh()
        self.params_replaced = False
        self._assign_codecs()
        self.gather.rebuild()
        self.reduce.rebuild()
        self.configure()

    def set_all_gather_policy(self, policy: AllGatherPolicy | None, owner: str) -> None:
        """Gather the parameters ``policy`` picks quantized from now on (None: as they are)."""
        if policy is not None and not isinstance(policy, AllGatherPolicy):
            raise FSDPUsageError(
                f"{owner}.set_all_gather_policy: expected an fsdp2.AllGatherPolicy or None, got {type(policy).__name__}"
            )
        if self.phase is not Phase.IDLE:
            raise FSDPUsageError(
                f"{owner}.set_all_gather_policy: called during {self.phase.name.lower()}; change the all-gather "
                "policy between training steps (after backward, or before the first forward)"
            )
        self.reshard()  # what is gathered now was gathered under the old policy
        self.all_gather_policy = policy
        self._assign_codecs()
        self.gather.rebuild()
        self.configure()

    def _assign_codecs(self) -> None:
        """Give every parameter the codec it travels with: a tensor subclass's own all-gather
        hooks if it has them; quantized if the all-gather policy picks it and this group
        communicates at all; else the default. A parameter whose codec builds the unsharded
        parameter differently starts that anew."""
        policy = self.all_gather_policy
        for p in self.params:
            codec: GatherCodec
            if has_hooks(p.local_shard):
                codec = SubclassCodec(p, self.dp.shard_mesh)
            elif policy is not None and not self.local_only and policy.quantizes(p.fqn, p.sharded_param, p.param_dtype):
                codec = QuantizedCodec(p, policy)
            else:
                codec = PlainCodec(p)
            if codec.same_as(p.codec):
                continue
            if codec.builds_unsharded or p.codec.builds_unsharded:
                p.forget_unsharded()
            p.codec = codec

    # -- lifecycle verbs --------------------------------------------------------------------------

    def pre_forward(self, *, gathers_run_ahead: bool, manual_finalization: bool = False) -> None:
        """Gather before the module's forward. ``manual_finalization``: the root's backward ends
        at ``finalize_backward()`` (see schedule.backward_ends_at_inputs)."""
        self.phase = Phase.FORWARD
        # requires_grad may change between steps (freezing a base model after fully_shard). The rule
        # is schedule.backward_ends_at_inputs (any frozen parameter, unused ones reduced, manual
        # finalization), as a loop without a Python call.
        ends_at_inputs = manual_finalization or self.reduce.include_unused
        self.backward_end = BackwardEnd.INPUT_GRADS if ends_at_inputs else BackwardEnd.GRADS_READY
        for p in self.params:
            if not p.sharded_param.requires_grad:
                self.backward_end = BackwardEnd.INPUT_GRADS
                break
        self.unshard(async_op=True, wait_for_compute=not gathers_run_ahead)
        self.wait_for_unshard()

    def post_forward(self, *, grad_enabled: bool) -> None:
        action = schedule.after_this_forward(self.step.after_forward, grad_enabled=grad_enabled)
        if action is schedule.AfterForward.FREE:
            self.reshard()
        elif action is schedule.AfterForward.KEEP_SUBGROUP_SHARD:
            self._reshard_to_subgroup()
        self.phase = Phase.IDLE

    def pre_backward(self) -> bool:
        """Gather for this group's backward; False if already done (another output's gradient).

        From POST_BACKWARD this starts another round in the same backward: the group ran again
        after its gradients were reduced (a reentrant activation-checkpoint recompute, one per
        forward before the backward), and the new gradients are reduced when they are ready.
        """
        if self.phase is Phase.PRE_BACKWARD:
            return False
        if self.phase is Phase.POST_BACKWARD:
            self._grads.reset()
        self.phase = Phase.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard(async_op=True)
            self.wait_for_unshard()
        if compat.UNSHARDED_GRAD_IN_REDUCE_DTYPE:
            for p in self.params:
                if p.grad_dtype_rule is GradDtype.PER_BACKWARD and p.unsharded_param is not None and p.requires_grad:
                    p.choose_grad_dtype(self.requires_gradient_sync)
        return True

    def post_backward(self) -> None:
        """Reduce-scatter (or keep, without gradient sync) the gradients, then maybe reshard."""
        logger.debug("%s", self.event("FSDP::post_backward"))
        self.phase = Phase.POST_BACKWARD
        if self.step.mode is not Mode.UNSYNCED:
            # _issue_reduction, inlined: no call more per group and backward.
            grads = take_unreduced_grads(self.params)
            self.reduce.holds_unsynced_sums = False
            reduction = self.reduce.issue(grads, self.step.mode)
            if reduction is not None:
                self.reduce_window.add(reduction)
        else:
            for p in self.params:
                if p.unsharded_param is not None and p.requires_grad:
                    p.add_to_unsynced_sum()
            self.reduce.holds_unsynced_sums = True
        if self.reshard_after_backward:
            self.reshard()

    def _issue_reduction(self) -> Reduction | None:
        """Reduce this backward's gradients with every sum kept for them (by the eager and compiled
        microbatches of this accumulation)."""
        grads = take_unreduced_grads(self.params)
        self.reduce.holds_unsynced_sums = False
        return self.reduce.issue(grads, self.step.mode)

    def reduce_after_compiled_backward(self) -> None:
        """End of a compiled backward, with gradient sync: reduce what it left, as the end of an
        eager backward does (sums kept for this group by microbatches whose forward ran it when
        the compiled forward did not; zeros for unused parameters where the graph reduced none), now."""
        unused = self.reduces_unused_params and not self.reduce.reduced_in_graph
        if self.step.mode is not Mode.UNSYNCED and (self.has_unreduced_grads or unused):
            reduction = self._issue_reduction()
            if reduction is not None:
                reduction.finish()

    def finalize_backward(self) -> None:
        """End of the whole backward: reduce what never reported ready (unused or frozen
        parameters; under ``set_reduce_scatter_unused_params(True)`` also a group no gradient
        reached), free what backward gathered, and return to IDLE."""
        if self.phase != Phase.POST_BACKWARD and (self.has_unreduced_grads or self.reduces_unused_params):
            self.post_backward()
        elif self.reshard_after_backward:
            self.reshard()
        self.phase = Phase.IDLE
        self._grads.reset()

    def end_backward_before_finalize(self) -> None:
        """End of one backward under manual finalization: gradients that did not report ready stay
        where they are (held gathered) until ``finalize_backward`` reduces them, unless gradient sync
        is off (then they are kept without sync, as every such backward keeps them). IDLE again."""
        if self.phase != Phase.POST_BACKWARD and self.step.mode is Mode.UNSYNCED:
            self.finalize_backward()  # as any backward without sync ends
            return
        self.phase = Phase.IDLE
        self._grads.reset()

    @property
    def reduces_unused_params(self) -> bool:
        """``set_reduce_scatter_unused_params(True)`` and a synced backward: a group gathered before
        (eager or compiled) reduces every trainable parameter, zeros where no gradient reached it,
        whether or not this rank's backward reached the group (every rank then issues the same
        collective), as PyTorch's FSDP2 does once a parameter has its unsharded form."""
        if not (self.reduce.include_unused and self.step.mode is not Mode.UNSYNCED and self.reduce.gathered_before):
            return False
        for p in self.params:
            if p.requires_grad:
                return True
        return False

    @property
    def has_unreduced_grads(self) -> bool:
        """Some parameter holds a gradient not reduced yet (this backward's or kept without sync,
        by eager or compiled backwards)."""
        return any(p.has_unreduced_grad for p in self.params)

    def reset_iteration(self) -> None:
        """After an aborted forward/backward: nothing in flight, all sharded, IDLE."""
        self.reshard()
        self.discard_sums()
        self.sinks.discard()
        self.phase = Phase.IDLE
        self._grads.reset()

    def discard_sums(self) -> None:
        """Drop every gradient not reduced yet: this backward's, and the sums kept for the next
        synced backward (without sync; HSDP without the all-reduce)."""
        for p in self.params:
            if p.unsharded_param is not None:
                p.unsharded_param.grad = None
            p.unsynced_sum = None
        self.reduce.holds_unsynced_sums = False
        self.reduce.discard_partial()

    def inputs_grads_ready(self) -> None:
        """Autograd computed the gradients of this group's forward inputs: its backward is over."""
        if self.phase is Phase.PRE_BACKWARD:
            self.post_backward()

    def _on_all_grads_ready(self) -> None:
        if self.phase != Phase.POST_BACKWARD and self.backward_end is BackwardEnd.GRADS_READY:
            self.post_backward()

    # -- unshard / reshard ------------------------------------------------------------------------

    def unshard(self, async_op: bool = False, wait_for_compute: bool = True) -> None:
        """Issue the all-gather(s); with ``async_op`` return before they complete.

        ``wait_for_compute=False`` lets the all-gather stream run ahead of compute: only safe
        when nothing queued on the compute stream since the last full sync writes the shards
        (the root syncs the streams once at the start of its forward).
        """
        if self.state == GroupState.UNSHARDING and not async_op:
            self.wait_for_unshard()  # prefetched: a blocking unshard returns with the parameters usable
            return
        if self.state not in (GroupState.SHARDED, GroupState.PARTIALLY_SHARDED) or not self.params:
            return
        if self.local_only:
            self.gather.unshard_locally()
            self._hold_unsharded()
            return
        if self.state == GroupState.PARTIALLY_SHARDED:
            self.gather.issue_from_subgroup_rows(self._subgroup_rows, self.reshard_after_forward.subgroup)
            self._subgroup_rows = []
        else:
            self.gather.issue_from_shards(wait_for_compute)
        self.state = GroupState.UNSHARDING
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Complete an issued all-gather and register the full parameters on the modules."""
        if self.state != GroupState.UNSHARDING:
            return
        self.gather.finish(for_subgroup=self._subgroup_to_keep())
        self._hold_unsharded()

    def _subgroup_to_keep(self) -> Subgroup | None:
        """The subgroup this forward's gather will reshard to after forward, if any."""
        action = schedule.after_this_forward(self.step.after_forward, grad_enabled=torch.is_grad_enabled())
        if self.phase is Phase.FORWARD and action is schedule.AfterForward.KEEP_SUBGROUP_SHARD:
            return self.reshard_after_forward.subgroup
        return None

    def _hold_unsharded(self) -> None:
        hold_all_unsharded(self.params)
        self.state = GroupState.UNSHARDED
        self.reduce.gathered_before = True

    def reshard(self) -> None:
        """Free the full parameters (and any subgroup rows); only the shards remain."""
        if self.state == GroupState.UNSHARDING:
            self.wait_for_unshard()  # never leave a collective writing into freed memory
        if self.state == GroupState.PARTIALLY_SHARDED:
            self._subgroup_rows = []
            self.state = GroupState.SHARDED
        if self.state == GroupState.UNSHARDED:
            self._free_unsharded()
            self.state = GroupState.SHARDED

    def _reshard_to_subgroup(self) -> None:
        """Keep this rank's 1/k of the gathered group for backward, free the rest."""
        if self.state == GroupState.UNSHARDING:
            self.wait_for_unshard()
        if self.state != GroupState.UNSHARDED:
            return
        subgroup_rows = self.gather.rows_for_subgroup(self.reshard_after_forward.subgroup)
        if subgroup_rows is None:
            # Gathered outside this forward (e.g. a manual unshard()), with rows that cannot be
            # rebuilt from the parameters: free all; backward gathers from the shards again.
            self.reshard()
            return
        self._subgroup_rows = subgroup_rows
        self._free_unsharded()
        self.state = GroupState.PARTIALLY_SHARDED

    def _free_unsharded(self) -> None:
        hold_all_sharded(self.params)
        if not self.keep_unsharded_storage:
            free_all_unsharded(self.params)


class _ParamRegistrations:
    """Notices a parameter registered (``module.weight = nn.Parameter(...)``,
    ``load_state_dict(assign=True)``) in a slot of a fully_shard'ed parameter, through nn.Module's
    global registration hook (a process hook, fsdp2.runtime.process_hooks: in place while fsdp2
    modules exist), and sets the group's ``params_replaced``. Eager fsdp2 takes such a parameter
    over when it re-reads the parameters (lazy init, load_state_dict); the compiled step does not
    read the DTensor parameters (fsdp2.runtime.traced.TracedCall.hold), so it reads the flag (one
    guard: a replacement retraces) and refuses the replacement by name rather than keep training
    the old shard."""

    def __init__(self) -> None:
        # module -> {slot name: (its ShardedParam, its ParamGroup)}, both weakly: they refer to
        # the module, which would otherwise never be freed.
        self._slots: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[weakref.ref, weakref.ref]]] = (
            weakref.WeakKeyDictionary()
        )
        self._handle = None

    def watch(self, group: ParamGroup) -> None:
        for p in group.params:
            for slot in p.slots:
                self._slots.setdefault(slot.module, {})[slot.name] = (weakref.ref(p), weakref.ref(group))

    def install(self) -> None:
        self._handle = nn.modules.module.register_module_parameter_registration_hook(self._registered)

    def remove(self) -> None:
        self._handle.remove()
        self._handle = None

    def _registered(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        watched = self._slots.get(module)
        if watched is None or name not in watched:
            return
        sharded, group = (ref() for ref in watched[name])
        if sharded is not None and group is not None and param is not sharded.sharded_param:
            group.params_replaced = True


_registrations = _ParamRegistrations()
PROCESS_HOOKS.register("parameter registration", _registrations.install, _registrations.remove)
