"""The reduce side of one group: full gradients in, one reduce-scatter per dtype, sharded ``.grad`` out.

A group's gradients are packed into a ``world x numel_per_rank`` buffer per reduce dtype, summed
across shard ranks with one reduce-scatter, all-reduced across replicas (HSDP) and divided by
the number of data-parallel ranks with the reduce ops and divisions PyTorch's FSDP2 would use
(fsdp2.runtime.reduce_plan); this rank's rows are then added to the sharded ``.grad``s. What
each buffer's reduction does is its :class:`BucketStep` (fsdp2.runtime.group_step), made here
and emitted unchanged by the compiled step.
Each issued reduction is a :class:`Reduction`; the root's :class:`ReduceWindow` bounds how many
are in flight. ``GroupReduce`` is also the group's gradient store: ``finish`` writes a reduced
bucket to ``.grad`` or adds it to the sums kept for a later backward, and ``take_kept_sums``
hands those sums to the reduction that adds them in, for eager and compiled backwards alike.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from fsdp2 import compat
from fsdp2.runtime import collectives
from fsdp2.runtime.buckets import FlatBucket, ReusedBuffer, buckets_by_dtype
from fsdp2.runtime.dp_mesh import DataParallelMesh
from fsdp2.runtime.group_step import BucketStep, Mode, ReduceSettings
from fsdp2.runtime.reduce_plan import ReducePlan
from fsdp2.runtime.schedule import DEFAULT_MAX_REDUCES_IN_FLIGHT
from fsdp2.runtime.sharded_param import ShardedParam, accumulate_sharded_grads, take_unreduced_grads
from fsdp2.runtime.streams import CommStreams, Completion


class PaddedScatterInput(ReusedBuffer):
    """A padded bucket's reduce-scatter input, reused from step to step with its copy views built once.

    Padding takes a bucket off the one-``_chunk_cat`` path (on CPU that kernel pads every gradient
    into a temporary first, which raises the step's peak memory), and slicing a fresh buffer per
    parameter and per padded rank range costs ops that grow with the world size. Here the views
    of one buffer are built once (ShardLayout.copy_in_views), so packing is one ``_foreach_copy_``
    of the gradients at any world size (and one ``_foreach_zero_`` of the padding where a hook
    reads it). The storage exists only from ``fill`` to ``release`` (see ReusedBuffer).
    """

    def __init__(self, bucket: FlatBucket, world: int, device):
        super().__init__((world, bucket.numel_per_rank), bucket.dtype, device)
        self._views = [p.layout.copy_in_views(block) for p, block in bucket.columns(self.buffer)]
        self._destinations = [d for views in self._views for d in views.destinations]
        self._padding = [z for views in self._views for z in views.padding]
        self.release()

    def fill(self, grads: list[torch.Tensor], zero_padding: bool) -> torch.Tensor:
        """The buffer, allocated and holding ``grads`` (one per bucket parameter, none missing).

        ``zero_padding``: someone reads the whole reduced output (a user's hook or collective).
        Otherwise the padding is left as the allocator gave it: the sum is element-wise, so
        padding lands only in the output's padding, which no shard reads (at large world sizes much of a
        small model's reduce-scatter bytes; benchmarks/RESULTS.md, "Host work per step").
        """
        self.allocate()
        if zero_padding and self._padding:
            compat.foreach_zero_(self._padding)
        sources = []
        for views, grad in zip(self._views, grads):
            if views.takes_whole:  # one row per rank (the common padded case): no view per step
                sources.append(grad)
            else:
                sources += views.sources(grad)
        if sources:
            compat.foreach_copy_(self._destinations, sources)
        return self.buffer


@dataclass
class PendingReduce:
    step: BucketStep
    # Both allocated on the compute stream and held until it waited for the reduction.
    input: torch.Tensor
    output: torch.Tensor
    reused_input: PaddedScatterInput | None = None  # owns ``input``: released once it is done

    def release(self) -> None:
        if self.reused_input is not None:
            self.reused_input.release()


def _reduce_scatter_input(bucket: FlatBucket, grads: list, world: int, device) -> torch.Tensor:
    """A fresh ``world x numel_per_rank`` buffer of ``bucket``'s full gradients, each split into padded rank rows."""
    inp = torch.empty(world, bucket.numel_per_rank, dtype=bucket.dtype, device=device)
    dtype = grads[0].dtype if grads[0] is not None else None
    # One dtype: kept sums (reduce dtype) beside fresh gradients (param dtype) take the copies below.
    if bucket.all_dim0_even and all([g is not None and g.dtype is dtype for g in grads]):
        # One fused copy: chunk every grad into ``world`` row blocks, cast, concatenate per
        # rank (ShardLayout's dim-0 layout). Only without padding (see PaddedScatterInput).
        compat.chunk_cat(grads, 0, world, out=inp)
        return inp
    for (p, block), grad in zip(bucket.columns(inp), grads):
        if grad is not None:
            p.layout.copy_full_in(grad, block)  # zeroes its padding too
        else:
            block.zero_()  # unused parameter, reduced as zeros (set_reduce_scatter_unused_params)
    return inp


class Reduction:
    """One group's issued reductions; ``finish()`` adds the results to the sharded ``.grad``s."""

    def __init__(self, reduce: "GroupReduce", completion: Completion, pending: list[PendingReduce]):
        self._reduce = reduce
        self._completion = completion
        self._pending = pending

    def finish(self) -> None:
        self._completion.wait()
        for pending in self._pending:
            self._reduce.finish(pending.step.bucket, pending.output, Mode.SYNCED)
            if pending.reused_input is not None:  # pending.release(), inlined: no call per bucket and step
                pending.reused_input.release()
        self._pending = []

    def abandon(self) -> None:
        """Drop the results unread (an aborted iteration), freeing the buffers as finish() would."""
        for pending in self._pending:
            pending.release()
        self._pending = []


class ReduceWindow:
    """The reductions in flight under one root, oldest first; at most ``limit`` stay unfinished."""

    def __init__(self, limit: int = DEFAULT_MAX_REDUCES_IN_FLIGHT):
        self.limit = limit
        self._in_flight: list[Reduction] = []

    def add(self, reduction: Reduction) -> None:
        self._in_flight.append(reduction)
        while len(self._in_flight) > self.limit:
            self._in_flight.pop(0).finish()

    def drain(self) -> None:
        while self._in_flight:
            self._in_flight.pop(0).finish()

    def discard(self) -> None:
        """Forget reductions of an aborted iteration (their gradients are lost, as in PyTorch)."""
        for reduction in self._in_flight:
            reduction.abandon()
        self._in_flight.clear()


class GroupReduce:
    """Reduces one group's gradients: runs its :class:`BucketStep`s (fsdp2.runtime.group_step),
    which it makes once per set of reduced parameters and settings, for eager backwards and the
    compiled step's alike."""

    def __init__(self, params: list[ShardedParam], dp: DataParallelMesh, streams: CommStreams, local_only: bool):
        self.params = params
        self.dp = dp
        self.streams = streams
        self.local_only = local_only  # one-rank shard group: the reduce-scatter is the identity
        self.settings = ReduceSettings()  # what the steps are decided from (configure changes them)
        # Switches of a backward, not of its steps: set per microbatch, so plain attributes.
        self.include_unused = False  # set_reduce_scatter_unused_params: unreached parameters reduced as zeros
        # The group was gathered (eager or compiled): with include_unused its parameters are reduced
        # from then on, as PyTorch's FSDP2 reduces those that have their unsharded form.
        self.gathered_before = False
        # A compiled graph reduced the group in the backward running now (reset as it begins).
        self.reduced_in_graph = False
        # Per pattern of reduced parameters: its buckets (the layout, reused while the parameters
        # are) and its steps (decided again when a setting changes).
        self._buckets: dict[tuple[bool, ...], list[FlatBucket]] = {}
        self._steps: dict[tuple[bool, ...], list[BucketStep]] = {}
        self._plans: dict[torch.dtype, ReducePlan] = {}  # by reduce dtype, under the current settings
        self._reused_inputs: dict[int, PaddedScatterInput] = {}  # per padded dim-0 bucket, by id
        # The sums eager backwards keep for the next reduction (a compiled backward takes them too,
        # fsdp2.runtime.grad_sinks): gradients kept in the parameters without gradient sync
        # (ShardedParam.add_to_unsynced_sum; the group sets this flag), and under HSDP without
        # the all-reduce the reduce-scattered sums, per parameter until the next all-reduce.
        self.holds_unsynced_sums = False
        self.partial_sums: dict[int, torch.Tensor] = {}  # HSDP without the all-reduce, by id(param)

    def rebuild(self) -> None:
        """The parameters were re-read (their dtypes may have changed): new buckets and steps."""
        self._buckets.clear()
        self._steps.clear()
        self._reused_inputs.clear()

    def configure(self, **changes: Any) -> None:
        """Change settings (``ReduceSettings``' fields): every step is decided again, now (the
        compiled step reads them while dynamo traces, which must find them made)."""
        self.settings = dataclasses.replace(self.settings, **changes)
        self._plans.clear()
        self._steps = {pattern: [self._step(bucket) for bucket in self._buckets[pattern]] for pattern in self._steps}

    @property
    def _group(self) -> dist.ProcessGroup:
        return self.settings.reduce_scatter_group or self.dp.shard_group

    def steps_of(self, pattern: tuple[bool, ...]) -> list[BucketStep]:
        """The steps (one per reduce dtype) that reduce the parameters ``pattern`` picks, in
        ``params`` order: made once per pattern and settings."""
        steps = self._steps.get(pattern)
        if steps is None:
            steps = self._steps[pattern] = [self._step(bucket) for bucket in self._buckets_of(pattern)]
        return steps

    def _buckets_of(self, pattern: tuple[bool, ...]) -> list[FlatBucket]:
        buckets = self._buckets.get(pattern)
        if buckets is None:
            chosen = [p for p, keep in zip(self.params, pattern) if keep]
            buckets = self._buckets[pattern] = buckets_by_dtype(chosen, lambda p: p.reduce_dtype)
        return buckets

    def plan(self, reduce_dtype: torch.dtype) -> ReducePlan:
        """PyTorch FSDP2's reduce ops and divisions for gradients reduced in ``reduce_dtype``,
        under the current settings (chosen once per dtype and settings)."""
        plan = self._plans.get(reduce_dtype)
        if plan is None:
            settings, dp = self.settings, self.dp
            # A custom reduce-scatter takes the op PyTorch would give it, whatever the backend.
            premul = settings.custom_reduce_scatter is not None or collectives.supports_premul_sum(self._group)
            plan = self._plans[reduce_dtype] = ReducePlan.choose(
                shard_size=dp.shard_size,
                replicate_size=dp.replicate_size,
                reduce_dtype=reduce_dtype,
                divide_factor=settings.divide_factor,
                force_sum=settings.force_sum,
                premul_sum_supported=premul,
                device_type=dp.device.type,
            )
        return plan

    def _step(self, bucket: FlatBucket) -> BucketStep:
        dp, settings = self.dp, self.settings
        shard_dtypes = {p.orig_dtype for p in bucket.params}
        custom = settings.custom_reduce_scatter
        return BucketStep(
            bucket,
            self.plan(bucket.dtype),
            world=dp.shard_size,
            shard_group=self._group,
            replicate_group=dp.replicate_group if dp.is_hybrid else None,
            grad_dtype=shard_dtypes.pop() if len(shard_dtypes) == 1 else bucket.dtype,
            hooked=settings.all_reduce_hook is not None,
            custom_reduce_scatter=None if custom is None else collectives.register_user_comm(custom),
            out_collectives=collectives.out_variants_usable(self._group),
        )

    def _steps_for(self, grads: dict[int, torch.Tensor | None]) -> list[BucketStep]:
        # Which parameters are reduced changes with freezing and with unused parameters.
        # A parameter with a kept partial sum is reduced also when this backward did not reach it;
        # with include_unused, so is every one of a group gathered before.
        partial, include_unused = self.partial_sums, self.include_unused and self.gathered_before
        pattern = tuple(
            [
                p.sharded_param.requires_grad and (grads.get(id(p)) is not None or include_unused or id(p) in partial)
                for p in self.params
            ]
        )
        if pattern in self._steps:  # no call per step once made
            return self._steps[pattern]
        return self.steps_of(pattern)

    def issue(self, grads: dict[int, torch.Tensor | None], mode: Mode = Mode.SYNCED) -> Reduction | None:
        """Pack and reduce-scatter ``grads`` (param id -> full local gradient or None); ``mode``:
        SYNCED (on to ``.grad``) or PARTIAL (HSDP: the reduce-scattered sums are kept here)."""
        steps = self._steps_for(grads)
        if not steps:
            return None
        pending = []
        for step in steps:
            bucket, plan = step.bucket, step.plan
            inp, reused_input = self._pack(bucket, [grads.get(id(p)) for p in bucket.params])
            for divisor in plan.divide_before:
                inp.div_(divisor)  # fp16 would overflow summing before dividing
            if self.local_only:
                out = inp.view(-1)  # a reduce-scatter over one rank is the identity
            else:
                out = self._allocate(bucket.numel_per_rank, bucket.dtype)
            pending.append(PendingReduce(step, inp, out, reused_input))
        grads.clear()  # copied in: the full gradients can go (same stream, so no hazard)
        group = self._group
        comm = self.settings.custom_reduce_scatter or collectives.reduce_scatter
        with self.streams.reduce_scatter.launch() as completion:
            for p in pending:
                if not self.local_only:
                    op = p.step.plan.reduce_scatter_op.c10d()
                    completion.collective(comm, p.output, p.input.view(-1), group, op=op)
                # Runs once the reduce-scatter is done (one call: no lambda in between).
                completion.then(functools.partial(p.step.spec.after_reduce_scatter, p.output, mode, self, p))
        if mode is Mode.PARTIAL:
            completion.wait()  # the sums stay here: nothing reaches .grad yet
            for p in pending:
                p.release()
            return None
        return Reduction(self, completion, pending)

    def _pack(self, bucket: FlatBucket, grads: list) -> tuple[torch.Tensor, PaddedScatterInput | None]:
        """The reduce-scatter input of ``bucket`` and, if it is a reused buffer, its owner."""
        world = self.dp.shard_size
        if bucket.all_dim0 and not bucket.all_dim0_even and all([g is not None for g in grads]):
            reused = self._reused_inputs.get(id(bucket))
            if reused is None:
                reused = self._reused_inputs[id(bucket)] = PaddedScatterInput(bucket, world, self.dp.device)
            if not reused.in_use:  # else an earlier reduction of this bucket still reads it
                return reused.fill(grads, zero_padding=self._output_seen_whole), reused
        return _reduce_scatter_input(bucket, grads, world, self.dp.device), None

    @property
    def _output_seen_whole(self) -> bool:
        """Someone reads the padding: a user's hook or collective sees the reduced buffer whole
        (give it zeros there, as PyTorch's FSDP2 does), or a GPU backend may check collective
        inputs for NaN (NCCL's ``TORCH_NCCL_NAN_CHECK``; uninitialized padding could trip it, and
        zeroing costs a GPU one kernel). Only CPU steps skip it, where it costs bytes per step."""
        settings = self.settings
        return (
            settings.all_reduce_hook is not None
            or settings.custom_reduce_scatter is not None
            or self.dp.device.type != "cpu"
        )

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        custom = self.settings.custom_reduce_scatter
        if custom is not None:
            return custom.allocate((numel,), dtype=dtype, device=self.dp.device)
        return torch.empty(numel, dtype=dtype, device=self.dp.device)

    # -- the pieces of ReduceSpec.after_reduce_scatter, eager: in place on a pending reduction's output

    def keep_partial(self, pending: PendingReduce, reduced: torch.Tensor) -> torch.Tensor:
        self.finish(pending.step.bucket, reduced, Mode.PARTIAL)
        return reduced

    def add_partial(self, pending: PendingReduce, reduced: torch.Tensor) -> torch.Tensor:
        if self.partial_sums:
            bucket = pending.step.bucket
            for p, slot in zip(bucket.params, torch.split_with_sizes(reduced, bucket.sizes)):
                summed = self.partial_sums.pop(id(p), None)
                if summed is not None:
                    slot.add_(summed)
        return reduced

    def all_reduce(self, pending: PendingReduce, reduced: torch.Tensor) -> torch.Tensor:
        collectives.all_reduce(reduced, self.dp.replicate_group, False, pending.step.plan.all_reduce_op.c10d())
        return reduced

    def hook_and_divide(self, pending: PendingReduce, reduced: torch.Tensor) -> torch.Tensor:
        self.finish_reduced(reduced, pending.step.plan)
        return reduced

    def finish_reduced(self, output: torch.Tensor, plan: ReducePlan) -> None:
        """A reduced bucket after its collectives: the user's all-reduce hook on it, then the
        division, in place (PyTorch FSDP2's order). The compiled step's hand-off calls it too."""
        hook = self.settings.all_reduce_hook
        if hook is not None:
            hook(output)
        if plan.divide_after != 1:
            output.div_(plan.divide_after)

    # -- the gradient store: where a reduced bucket goes, whichever executor reduced it ----------

    def finish(
        self,
        bucket: FlatBucket,
        reduced: torch.Tensor,
        mode: Mode,
        reached: Sequence[int] | None = None,
        host_syncs_later: bool = True,
    ) -> None:
        """Put a bucket's gradient where ``mode`` says, for the parameters ``reached`` (indices in
        ``bucket.params``; None: all): SYNCED, the reduced flat shard added to their ``.grad``;
        PARTIAL (HSDP without the all-reduce), the reduce-scattered flat shard added to the
        partial sums kept here; UNSYNCED (a compiled backward without sync), the unreduced
        ``world x numel`` rows added to each parameter's unsynced sum. Eager reductions and the
        compiled graph's sinks (fsdp2.runtime.grad_sinks) both write gradients through it."""
        params = bucket.params
        if mode is Mode.SYNCED:
            slots = torch.split_with_sizes(reduced, bucket.sizes)
            if reached is None:
                accumulate_sharded_grads(params, slots, host_syncs_later)
            else:
                accumulate_sharded_grads([params[i] for i in reached], [slots[i] for i in reached], host_syncs_later)
            return
        chosen = range(len(params)) if reached is None else reached
        if mode is Mode.PARTIAL:
            slots = torch.split_with_sizes(reduced, bucket.sizes)
            for i in chosen:
                key = id(params[i])
                summed = self.partial_sums.get(key)
                # A copy: the slot views a reduction's buffer (eager's, or the graph's).
                self.partial_sums[key] = slots[i].clone() if summed is None else summed.add_(slots[i])
            return
        blocks = torch.split_with_sizes(reduced.view(self.dp.shard_size, -1), bucket.sizes, dim=1)
        for i in chosen:
            p = params[i]
            full = p.layout.full_from_rank_rows(blocks[i])
            # Owned: a copy only where ``full`` still views the graph's buffer (decoding a column of
            # several parameters' rows has copied already).
            aliases = full.untyped_storage().data_ptr() == reduced.untyped_storage().data_ptr()
            p.add_compiled_unsynced(full.clone() if aliases else full)
        self.holds_unsynced_sums = True

    def take_kept_sums(self, bucket: FlatBucket, mode: Mode) -> tuple[torch.Tensor | None, set[int]]:
        """The sums earlier backwards kept for ``bucket``'s parameters, taken, laid out for the
        reduction that adds them in (a compiled synced backward's): UNSYNCED, the full gradients
        as the reduce-scatter input eager packs (``world x numel`` rows, flat); PARTIAL, the
        reduce-scattered flat shard. With the indices of the parameters they reached; None and
        none where nothing was kept."""
        params = bucket.params
        if mode is Mode.UNSYNCED:
            if not self.holds_unsynced_sums:
                return None, set()
            grads = take_unreduced_grads(params)
            self.holds_unsynced_sums = any([p.has_unreduced_grad for p in self.params])
            pieces = [grads.get(id(p)) for p in params]
        else:
            if not self.partial_sums:
                return None, set()
            pieces = [self.partial_sums.pop(id(p), None) for p in params]
        reached = {i for i, piece in enumerate(pieces) if piece is not None}
        if not reached:
            return None, reached
        if mode is Mode.UNSYNCED:
            return _reduce_scatter_input(bucket, pieces, self.dp.shard_size, self.dp.device).view(-1), reached
        flat = torch.empty(bucket.numel_per_rank, dtype=bucket.dtype, device=self.dp.device)
        for piece, slot in zip(pieces, torch.split_with_sizes(flat, bucket.sizes)):
            if piece is None:
                slot.zero_()
            else:
                slot.copy_(piece)
        return flat, reached

    @property
    def holds_partial_sums(self) -> bool:
        """HSDP backwards without the all-reduce (Mode.PARTIAL) kept sums for the next all-reduce."""
        return bool(self.partial_sums)

    def discard_partial(self) -> None:
        self.partial_sums.clear()
