"""Where a compiled backward's gradients enter the group's gradient store: per reduce bucket its
sinks and the hand-off to the parameters' DTensor ``.grad``, or to the sums a backward without
sync keeps. Eager code, run by autograd's hooks and by the graph's ``fsdp2::take_kept_sums`` and
``fsdp2::deliver`` ops; the graph itself is emitted by fsdp2.runtime.traced.

A compiled step's backward reduces each bucket once per graph (fsdp2.runtime.traced_graph's port)
and hands the result on by the step's mode, through autograd when backward reached every
parameter of the bucket (the common case: no Python runs per bucket in the graph):

- SYNCED: to ``reduced``, a leaf whose hook writes every parameter's ``.grad`` in one call
  (added to one already there, as eager adds it);
- UNSYNCED (``set_requires_gradient_sync(False)``): to ``unsynced``, a leaf whose hook adds each
  parameter's gradient (in ``reduce_dtype``) to its unsynced sum (``ShardedParam.unsynced_sum``);
- PARTIAL (HSDP, ``set_requires_all_reduce(False)``): to ``partial``, a leaf whose hook adds each
  parameter's reduce-scattered slot to the group's partial sums (``GroupReduce.partial_sums``).

The sums live in one place, eager's, in eager's layout, whichever executor ran the microbatches:
eager's backwards add to them and reduce them; a compiled synced graph takes them into its flat
layout (``fsdp2::take_kept_sums``, once per backward, whichever of its graphs runs first; a graph
includes that op only if sums were kept when it was traced: dynamo guards on the group's flags).
Every write, to ``.grad`` or to the sums, is the group's gradient store's (``GroupReduce.finish``,
which eager's reductions call too), and every take is its ``take_kept_sums``; the hand-off's one
shortcut assigns first gradients of a bucket without padding as views of the reduced shard.

When backward missed some parameters (unused in forward), the graph knows which at trace time and
hands the gradient to ``fsdp2::deliver`` instead, with the indices it reached: SYNCED writes only
those parameters' ``.grad`` (eager and PyTorch's FSDP2 leave the others None), the other modes add
only those to the sums. Every delivery adds, so two compiled forwards before one backward (each
graph reduces its own gradient) sum in ``.grad`` and in the sums.

A backward's mode was fixed when its forward was traced. If the settings changed between the
forward and its backward (eager would follow the new ones), the hand-off raises instead of
writing anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from fsdp2 import compat
from fsdp2.errors import FSDPUsageError
from fsdp2.runtime import traced_ops
from fsdp2.runtime.group_step import Mode
from fsdp2.runtime.sharded_param import weak_hook

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from fsdp2.runtime.dp_mesh import DataParallelMesh
    from fsdp2.runtime.group_step import BucketStep, GroupStep
    from fsdp2.runtime.reduce import GroupReduce
    from fsdp2.runtime.sharded_param import ShardedParam


class SinkOwner(Protocol):
    """What the sinks read of their group (fsdp2.runtime.param_group.ParamGroup, which owns them)."""

    name: str
    params: list["ShardedParam"]
    dp: "DataParallelMesh"
    reduce: "GroupReduce"
    step: "GroupStep"

    def discard_sums(self) -> None: ...

    def configure(self) -> None: ...


def _leaf(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A leaf that only takes gradients: one element of storage, whatever its size."""
    return torch.empty_strided((numel,), (0,), dtype=dtype, device=device).requires_grad_()


class BucketSinks:
    """One bucket's gradient sinks and hand-off (module docstring).

    ``step``: the bucket's reduction (its ``BucketStep``, as eager reduces it: its parameters and
    layout, dtypes and hook); ``group``: their ParamGroup (its settings are read at the hand-off,
    its sums kept); ``frozen``: the group's parameters that were frozen when fsdp2 last read them.
    """

    def __init__(self, step: "BucketStep", group: "SinkOwner", frozen: tuple["ShardedParam", ...] = ()):
        self.bucket = bucket = step.bucket
        self.params = params = tuple(bucket.params)
        # The group's parameters frozen when fsdp2 last read them: the graph computes no gradient
        # for them, so one that requires a gradient now is refused (see _unfrozen).
        self.frozen = frozen
        self.group = group
        reduce_dtype = self.reduce_dtype = step.reduce_dtype
        self.hooked = step.hooked
        device = group.dp.device
        self.shard_numel = bucket.numel_per_rank
        self.gathered_numel = step.world * self.shard_numel
        # The shards' dtype (the reduce dtype where they have several: each is cast as it is written).
        self.grad_dtype = step.grad_dtype
        # No padding on this rank, one dtype: the reduced flat shard is the local shards back to back.
        self.packed = all(
            p.layout.local_rows == p.layout.chunk and not p.offload and p.orig_dtype == self.grad_dtype for p in params
        )
        self.shapes = [torch.empty(p.layout.local_shape, dtype=p.orig_dtype, device="meta") for p in params]
        self.reduced = _leaf(self.shard_numel, step.spec.handed_over_dtype(Mode.SYNCED), device)
        self.reduced.register_post_accumulate_grad_hook(weak_hook(self._hand_off))
        self.unsynced = _leaf(self.gathered_numel, reduce_dtype, device)
        self.unsynced.register_post_accumulate_grad_hook(weak_hook(self._summed_unsynced))
        self.partial = None
        if group.dp.is_hybrid:
            self.partial = _leaf(self.shard_numel, reduce_dtype, device)
            self.partial.register_post_accumulate_grad_hook(weak_hook(self._summed_partial))
        self.anchor = _leaf(0, torch.float32, device)  # takes fsdp2::deliver's results
        # Which parameters the sums taken by the running graph reached (its delivery adds them).
        self._taken_reached: set[int] = set()
        self.key = traced_ops.register_route(self)
        self.take_params()

    def serves(self, step: "BucketStep") -> bool:
        """Whether these sinks take the gradients ``step`` reduces (its parameters, dtypes and
        hook: a step decided again under another divide factor is served by the same sinks)."""
        return (
            self.params == tuple(step.bucket.params)
            and self.grad_dtype == step.grad_dtype
            and self.reduce_dtype == step.reduce_dtype
            and self.hooked == step.hooked
        )

    def take_params(self) -> None:
        """Note the parameters' DTensors: at construction and whenever fsdp2 re-reads them (the only
        time ``ShardedParam.sharded_param`` changes)."""
        self.dtensors: list[DTensor] = [p.sharded_param for p in self.params]

    def sink(self, mode: Mode) -> torch.Tensor:
        if mode is Mode.SYNCED:
            return self.reduced
        return self.unsynced if mode is Mode.UNSYNCED else self.partial

    def discard(self) -> None:
        """Forget what a backward left here (``reset_iter_state``; the sums are the group's)."""
        for leaf in (self.reduced, self.unsynced, self.partial, self.anchor):
            if leaf is not None:
                leaf.grad = None
        self._taken_reached = set()

    # -- the graph's run-time calls (traced_ops.take_kept_sums, traced_ops.deliver) ----------------------

    def take(self, grad: torch.Tensor, kind: int) -> torch.Tensor:
        """``grad`` plus the sums of ``kind`` kept for these parameters, taken (the kept sum first,
        as eager adds them; ``GroupReduce.take_kept_sums`` lays them out)."""
        kept, reached = self.group.reduce.take_kept_sums(self.bucket, Mode(kind))
        if kept is None:
            return grad.clone()
        self._taken_reached |= reached
        return kept + grad

    def deliver(self, grad: torch.Tensor, mode: int, reached: list[int]) -> torch.Tensor:
        """A graph's gradient from a backward that reached only the parameters ``reached`` (plus
        those the sums it took in reached)."""
        mode = Mode(mode)
        self._check_mode(mode)
        reached_all = set(reached) | self._taken_reached
        self._taken_reached = set()
        if mode is Mode.SYNCED:
            self.group.reduce.reduced_in_graph = True
            # A copy: ``grad`` is the graph's buffer, and fresh gradients view what they are given.
            self._write(self._finished(grad.clone()), reached_all)
        else:
            self._add_to_sums(mode, grad, sorted(reached_all))
        return grad.new_empty(0, dtype=torch.float32)

    # -- autograd's hooks on the sinks ---------------------------------------------------------------

    def _hand_off(self, sink: torch.Tensor) -> None:
        """A synced backward reached every parameter: write their ``.grad``. Per bucket one call
        (this hook) and the gradients' DTensors in the common case (no padding on this rank,
        first gradients, none frozen): its checks run as plain loops, which make no calls."""
        reduced, sink.grad = sink.grad, None
        if reduced is None:  # autograd runs the hook also when the graph gave the sink nothing
            return
        self._taken_reached = set()
        group = self.group
        group.reduce.gathered_before = True
        group.reduce.reduced_in_graph = True
        if group.step.mode is not Mode.SYNCED:
            self._check_mode(Mode.SYNCED)  # raises: the settings changed since the forward
        for p in self.frozen:
            if p.sharded_param.requires_grad:
                raise self._unfrozen(p)
        if self.hooked:
            reduced = self._finished(reduced)
        fresh = self.packed and not group.reduce.include_unused
        for p, dtensor in zip(self.params, self.dtensors):
            if compat.local_tensor_of(dtensor) is not p.traced_source or dtensor.grad is not None:
                fresh = False
            elif not dtensor.requires_grad:
                fresh = False
        if fresh:
            compat.assign_dtensor_grads(self.dtensors, compat.unflatten_dense_tensors(reduced, self.shapes))
        else:
            self._write(reduced, None)

    def _summed_unsynced(self, sink: torch.Tensor) -> None:
        grad, sink.grad = sink.grad, None
        if grad is None:
            return
        # Under set_reduce_scatter_unused_params(True) every graph hands its gradient here and the end
        # of the backward reduces the sums by the settings then in force, as eager's post-backward
        # would: nothing to refuse, whatever the mode was at the forward.
        if not self.group.reduce.include_unused:
            self._check_mode(Mode.UNSYNCED)
        self._add_to_sums(Mode.UNSYNCED, grad, None)

    def _summed_partial(self, sink: torch.Tensor) -> None:
        grad, sink.grad = sink.grad, None
        if grad is None:
            return
        self._taken_reached = set()  # taken into this sum (an unsynced sum, before the reduce-scatter)
        self._check_mode(Mode.PARTIAL)
        self._add_to_sums(Mode.PARTIAL, grad, None)

    def _add_to_sums(self, mode: Mode, grad: torch.Tensor, reached) -> None:
        reduce = self.group.reduce
        reduce.gathered_before = True
        reduce.finish(self.bucket, grad, mode, reached)

    def _check_mode(self, mode: Mode) -> None:
        """The group's settings now say what its forward's trace said (see the module docstring)."""
        group = self.group
        now = group.step.mode
        if now is mode:
            return
        self.discard()
        group.discard_sums()
        raise FSDPUsageError(
            f"torch.compile over fully_shard({group.name}): this backward's gradients were computed "
            f"{_MODE_WORDS[mode]}, as the settings were when its compiled forward ran, but they now say "
            f"{_MODE_WORDS[now]}: set_requires_gradient_sync / set_requires_all_reduce changed between a "
            "compiled forward and its backward (or between two compiled forwards before one backward). "
            "No gradient was written and the sums kept for this accumulation were dropped; change the "
            "settings before the forward."
        )

    def _unfrozen(self, p: "ShardedParam") -> FSDPUsageError:
        """``p`` was frozen when fsdp2 last read the parameters (fully_shard, or a re-read), so the
        compiled step computed no gradient for it, and it requires one now. The backward is
        refused rather than train without it; the parameters are read again, so the next compiled
        step is traced with it."""
        self.discard()
        group = self.group
        for frozen in self.frozen:
            frozen.trainable = frozen.sharded_param.requires_grad
        group.configure()  # new reduce steps and sinks; dynamo retraces on the step read
        return FSDPUsageError(
            f"torch.compile over fully_shard({group.name}): parameter {p.fqn} was frozen (requires_grad=False) "
            "when this compiled step was traced and requires a gradient now; the step computed none for it, so "
            "this backward is refused rather than train without it. Run the step again: the next compiled step "
            "is traced with it."
        )

    # -- writing .grad ---------------------------------------------------------------------------------

    def _finished(self, reduced: torch.Tensor) -> torch.Tensor:
        """What the graph left undivided in ``reduce_dtype`` (``BucketReduction.hooked``): eager's finish
        (the all-reduce hook, then the division), then the shards' dtype (one for the bucket)."""
        if not self.hooked:
            return reduced
        reduce = self.group.reduce
        reduce.finish_reduced(reduced, reduce.plan(reduced.dtype))
        return reduced if reduced.dtype == self.grad_dtype else reduced.to(self.grad_dtype)  # else per parameter

    def _write(self, reduced: torch.Tensor, reached: set[int] | None) -> None:
        """Add the reduced flat shard to the ``.grad`` of the parameters ``reached`` (None: all),
        as eager's post-backward writes them (``GroupReduce.finish``)."""
        reduce = self.group.reduce
        reduce.gathered_before = True
        if reduce.include_unused:  # set_reduce_scatter_unused_params(True): zeros
            reached = None
        dtensors = self.dtensors
        for p, dtensor in zip(self.params, dtensors):
            if compat.local_tensor_of(dtensor) is not p.traced_source:
                raise _swapped_shard_error(p)
        # As eager: a parameter no backward reached (unused in forward) gets no gradient, nor one
        # frozen after fully_shard (the graph does not see it). CPU offload: the copy to the host
        # waits (no eager root syncs after a compiled backward).
        chosen = [i for i, d in enumerate(dtensors) if d.requires_grad and (reached is None or i in reached)]
        reduce.finish(self.bucket, reduced[: self.shard_numel], Mode.SYNCED, chosen, host_syncs_later=False)


_MODE_WORDS = {
    Mode.SYNCED: "for a synced reduction",
    Mode.UNSYNCED: "without gradient sync (set_requires_gradient_sync(False))",
    Mode.PARTIAL: "without the HSDP all-reduce (set_requires_all_reduce(False))",
}


def _swapped_shard_error(p: "ShardedParam") -> FSDPUsageError:
    """``p``'s DTensor holds a local shard other than the one its graph input (``traced_leaf``) was
    made from: swapped in from outside fsdp2 (``_apply`` on a submodule that is not fully_shard'ed
    swaps DTensor parameters), so the step gathered the old values. Eager reads the new ones;
    writing gradients of the old would train them silently."""
    return FSDPUsageError(
        f"torch.compile over fully_shard({p.owner}): the local shard of parameter {p.fqn} was replaced from "
        "outside fsdp2 (torch.utils.swap_tensors, or _apply/to() on a submodule that is not fully_shard'ed) "
        "after this step was compiled, so it computed with the old values; no gradient was written. Convert "
        "the fully_shard'ed module itself (module.to(...)), or have fsdp2 re-read its parameters with "
        "model.load_state_dict(model.state_dict())."
    )


class GradSinks:
    """A group's :class:`BucketSinks`, one per reduce step of its trainable parameters (what a
    compiled backward reduces). ``follow`` runs with every ``ParamGroup.configure``: a bucket whose
    parameters, dtypes and hook are unchanged keeps its sinks, since re-reading parameters also
    happens inside functorch transforms (``torch.func.jvp`` over the module), where no new leaf may
    be made, and a graph traced before names them."""

    def __init__(self, group: "SinkOwner"):
        self.group = group
        self._by_dtype: dict[torch.dtype, BucketSinks] = {}

    def follow(self, steps: "tuple[BucketStep, ...]") -> None:
        group, sinks = self.group, {}
        frozen = tuple(p for p in group.params if not p.trainable)
        for step in steps:
            if not takes_grad(step.grad_dtype):
                continue
            current = self._by_dtype.get(step.reduce_dtype)
            if current is None or not current.serves(step):
                current = BucketSinks(step, group, frozen)
            else:
                current.frozen = frozen
                current.take_params()
            sinks[step.reduce_dtype] = current
        self._by_dtype = sinks

    def of(self, step: "BucketStep") -> BucketSinks:
        """``step``'s sinks; refused where the parameters changed without fsdp2 re-reading them
        (their gradient would be dropped)."""
        sinks = self._by_dtype.get(step.reduce_dtype)
        if sinks is None or not sinks.serves(step):
            raise FSDPUsageError(
                f"torch.compile over fully_shard({self.group.name}): its parameters changed dtype or shape "
                "without fsdp2 re-reading them; convert the model with module.to()/load_state_dict, not in place."
            )
        return sinks

    def discard(self) -> None:
        for sinks in self._by_dtype.values():
            sinks.discard()


def takes_grad(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex
