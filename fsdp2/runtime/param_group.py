"""The parameters of one fully_shard call, which all-gather and reduce-scatter together."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import ClassVar

import torch
import torch.distributed as dist

from fsdp2.runtime import collectives
from fsdp2.runtime.dp_mesh import DataParallelMesh
from fsdp2.errors import FSDPUsageError
from fsdp2.runtime.sharded_param import ShardedParam
from fsdp2.runtime.streams import CommStreams, Completion


class GroupState(Enum):
    SHARDED = auto()  # only shards in memory
    PARTIALLY_SHARDED = auto()  # after forward with reshard_after_forward=k: 1/k of the group kept
    UNSHARDING = auto()  # all-gather issued, not yet waited on
    UNSHARDED = auto()  # full parameters registered on the modules


@dataclass
class FlatBucket:
    """Parameters sharing one dtype, packed side by side in one flat communication buffer."""

    dtype: torch.dtype
    params: list[ShardedParam]
    offsets: list[int] = field(init=False)
    numel_per_rank: int = field(init=False)
    sizes: list[int] = field(init=False)  # padded shard numel per parameter
    all_dim0_even: bool = field(init=False)  # every parameter sharded on dim 0 without padding

    def __post_init__(self) -> None:
        self.sizes = [p.layout.padded_shard_numel for p in self.params]
        self.offsets = list(itertools.accumulate(self.sizes, initial=0))[:-1]
        self.numel_per_rank = sum(self.sizes)
        self.all_dim0_even = all(p.layout.dim == 0 and p.layout.is_even for p in self.params)

    def columns(self, buffer_2d: torch.Tensor):
        """Yield (param, its ``world x padded_shard_numel`` block of a ``world x numel_per_rank`` buffer)."""
        for p, off, size in zip(self.params, self.offsets, self.sizes):
            yield p, buffer_2d[:, off : off + size]


def _buckets(params: list[ShardedParam], dtype_of) -> list[FlatBucket]:
    by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
    for p in params:
        by_dtype.setdefault(dtype_of(p), []).append(p)
    return [FlatBucket(dtype, ps) for dtype, ps in by_dtype.items()]


@dataclass
class PendingGather:
    bucket: FlatBucket
    output: torch.Tensor
    # Gathered from a k-rank subgroup: the output holds rank rows interleaved by k.
    subgroup_size: int | None = None
    # Compute-stream tensors the all-gather stream reads: freed only after compute waited for it.
    inputs: torch.Tensor | None = None

    def rank_rows(self, world: int) -> torch.Tensor:
        """The output as ``world x numel_per_rank``, row r holding shard rank r's slot."""
        n = self.bucket.numel_per_rank
        if self.subgroup_size is None:
            return self.output.view(world, n)
        k = self.subgroup_size
        # Subgroup member j kept rows j, j+k, j+2k, ...: undo the interleave.
        return self.output.view(k, world // k, n).transpose(0, 1).reshape(world, n)


@dataclass
class PendingReduce:
    bucket: FlatBucket
    # Both allocated on the compute stream and kept until it waited for the reduction.
    input: torch.Tensor
    output: torch.Tensor


def _reduce_scatter_input(bucket: FlatBucket, grads: list, world: int, device) -> torch.Tensor:
    """``world x numel_per_rank`` buffer of ``bucket``'s full gradients, each split into padded rank rows."""
    inp = torch.empty(world, bucket.numel_per_rank, dtype=bucket.dtype, device=device)
    if bucket.all_dim0_even and all(g is not None for g in grads):
        # One fused copy: chunk every grad into ``world`` row blocks, cast, concatenate per
        # rank (ShardLayout's dim-0 layout). Only without padding: padding makes the CPU
        # kernel build padded temporaries first (measured: +10% step peak at 1024 ranks).
        torch._chunk_cat(grads, 0, world, out=inp)
        return inp
    for (p, block), grad in zip(bucket.columns(inp), grads):
        if grad is not None:
            p.layout.copy_full_in(grad, block)  # zeroes its padding too
        else:
            # Unused in this forward on this rank: its slot still takes part in the sum.
            block.zero_()
    return inp


def _copy_pairs(pairs) -> None:
    """One fused (casting) copy of every ``(destination, shard)`` pair; ``None`` pairs are skipped."""
    pairs = [pair for pair in pairs if pair is not None]
    if pairs:
        destinations, shards = zip(*pairs)
        # Pinned CPU shards (offload) copy host-to-device without blocking the host.
        torch._foreach_copy_(list(destinations), list(shards), non_blocking=shards[0].is_pinned())


def _copy_shards_in(bucket: FlatBucket, own_slot: torch.Tensor) -> None:
    """Copy every shard of ``bucket`` into its place in this rank's all-gather slot."""
    slots = torch.split_with_sizes(own_slot, bucket.sizes)
    _copy_pairs(p.copy_in_pair(slot) for p, slot in zip(bucket.params, slots))


class ParamGroup:
    """All-gathers a group's shards in one collective per dtype and reduce-scatters its grads."""

    # A one-rank shard group skips its collectives; tests and benchmarks/gpu_check.py turn this
    # off to run the full collective (and stream) path at world size 1.
    one_rank_shortcut: ClassVar[bool] = True

    def __init__(self, params: list[ShardedParam], dp: DataParallelMesh):
        self.params = params
        self.dp = dp
        self.state = GroupState.SHARDED
        self.gather_buckets = _buckets(params, lambda p: p.param_dtype)
        # Reduce buckets hold only parameters that need gradients, which users may change
        # after fully_shard (freezing); cached per requires_grad pattern.
        self._reduce_buckets: dict[tuple[bool, ...], list[FlatBucket]] = {}
        self.reshard_after_backward = True
        # reshard_after_forward=k (1 < k < shard size): after forward keep 1/k of the group,
        # shared within a subgroup of k ranks, so backward all-gathers over k ranks only.
        self.post_forward_subgroup: tuple[dist.ProcessGroup, int, int] | None = None  # (group, position, k)
        self._kept_rows: list[torch.Tensor] = []  # per gather bucket, in PARTIALLY_SHARDED
        self.requires_gradient_sync = True
        self.gradient_divide_factor: float | None = None  # None: average over data-parallel ranks
        self.streams = CommStreams.for_device(dp.device)
        self._pending_gathers: list[PendingGather] = []
        self._gather_completion: Completion | None = None
        self._pending_reduces: list[PendingReduce] = []
        self._reduce_completions: list[Completion] = []
        self._grads_ready: set[int] = set()
        self._grads_expected = 0
        self.reduced_this_backward = False

    # -- unshard / reshard -----------------------------------------------------------------------

    def unshard(self, async_op: bool = False, wait_for_compute: bool = True) -> None:
        """Issue the all-gather(s); with ``async_op`` return before they complete.

        ``wait_for_compute=False`` lets the all-gather stream run ahead of compute: only safe
        when nothing queued on the compute stream since the last full sync writes the shards
        (the root syncs the streams once at the start of its forward).
        """
        if self.state not in (GroupState.SHARDED, GroupState.PARTIALLY_SHARDED):
            return
        if self.dp.shard_size == 1 and self.one_rank_shortcut:
            self._unshard_locally()
            return
        side = self.streams.all_gather
        if wait_for_compute or self.state == GroupState.PARTIALLY_SHARDED:
            side.wait_for_compute()  # kept rows, or shards the optimizer just updated
        completion = Completion(side)
        with side.active():
            self.streams.gather_buffers.release_before_allocating()
            if self.state == GroupState.PARTIALLY_SHARDED:
                self._unshard_from_subgroup(completion)
            else:
                self._unshard_from_shards(completion)
            completion.event = side.record()
        self._gather_completion = completion
        self.state = GroupState.UNSHARDING
        if not async_op:
            self.wait_for_unshard()

    def _check_not_meta(self) -> None:
        for p in self.params:
            # Otherwise the shard copy fails deep inside with "Cannot copy out of meta tensor".
            if p.local_shard.is_meta:
                raise FSDPUsageError(
                    f"parameter {p.fqn} is on the meta device: call module.to_empty(device=...) and "
                    "initialize the parameters (e.g. reset_parameters()) before running the module"
                )

    def _unshard_locally(self) -> None:
        """Shard group of one rank: the shard is the whole parameter, so skip the all-gather and
        its buffer and cast-copy each shard straight into its unsharded storage (compute stream)."""
        self._check_not_meta()
        _copy_pairs(p.copy_in_pair(p.unsharded_storage()) for p in self.params)
        for p in self.params:
            p.hold_unsharded()
        self.state = GroupState.UNSHARDED

    def _unshard_from_shards(self, completion: Completion) -> None:
        self._check_not_meta()
        world, rank = self.dp.shard_size, self.dp.shard_rank
        for bucket in self.gather_buckets:
            output = torch.empty(world * bucket.numel_per_rank, dtype=bucket.dtype, device=self.dp.device)
            # In-place all-gather: our input is our own slot of the output, no separate buffer.
            own_slot = output.narrow(0, rank * bucket.numel_per_rank, bucket.numel_per_rank)
            _copy_shards_in(bucket, own_slot)
            self._issue_gather(completion, output, own_slot, self.dp.shard_group, PendingGather(bucket, output))

    def _unshard_from_subgroup(self, completion: Completion) -> None:
        group, position, k = self.post_forward_subgroup
        for bucket, kept in zip(self.gather_buckets, self._kept_rows):
            output = torch.empty(k * kept.numel(), dtype=bucket.dtype, device=self.dp.device)
            own_slot = output.narrow(0, position * kept.numel(), kept.numel())
            own_slot.copy_(kept.view(-1))
            pending = PendingGather(bucket, output, subgroup_size=k, inputs=kept)
            self._issue_gather(completion, output, own_slot, group, pending)
        self._kept_rows = []

    def _issue_gather(self, completion: Completion, output, own_slot, group, pending: PendingGather) -> None:
        completion.add(collectives.all_gather(output, own_slot, group, async_op=completion.side.async_op))
        self._pending_gathers.append(pending)

    def wait_for_unshard(self) -> None:
        """Complete an issued all-gather and register the full parameters on the modules."""
        if self.state != GroupState.UNSHARDING:
            return
        self._gather_completion.wait()
        for pending in self._pending_gathers:
            rows = pending.rank_rows(self.dp.shard_size)
            targets = [p.gather_target() for p in pending.bucket.params]
            if all(t is not None for t in targets):
                torch.split_with_sizes_copy(rows, pending.bucket.sizes, dim=1, out=targets)  # one copy per bucket
            else:
                for p, block in pending.bucket.columns(rows):
                    p.copy_gathered_out(block)
        self.streams.gather_buffers.consumed(
            [pending.output for pending in self._pending_gathers], self.streams.all_gather.compute_event()
        )
        self._pending_gathers.clear()
        for p in self.params:
            p.hold_unsharded()
        self.state = GroupState.UNSHARDED

    def reshard(self, after_forward: bool = False) -> None:
        """Free the full parameters and register the shards again.

        ``after_forward`` with a post-forward subgroup keeps this rank's 1/k of the gathered
        group for backward instead of dropping everything.
        """
        if self.state == GroupState.UNSHARDING:
            self.wait_for_unshard()  # never leave a collective writing into freed memory
        if self.state == GroupState.PARTIALLY_SHARDED and not after_forward:
            self._kept_rows = []
            self.state = GroupState.SHARDED
        if self.state != GroupState.UNSHARDED:
            return
        keep = after_forward and self.post_forward_subgroup is not None
        if keep:
            self._keep_subgroup_rows()
        for p in self.params:
            p.hold_sharded()
            p.free_unsharded()
        self.state = GroupState.PARTIALLY_SHARDED if keep else GroupState.SHARDED

    def _keep_subgroup_rows(self) -> None:
        _, position, k = self.post_forward_subgroup
        world = self.dp.shard_size
        self._kept_rows = []
        for bucket in self.gather_buckets:
            kept = torch.empty(world // k, bucket.numel_per_rank, dtype=bucket.dtype, device=self.dp.device)
            for p, block in bucket.columns(kept):
                block.copy_(p.gathered_rank_rows()[position::k])
            self._kept_rows.append(kept)

    # -- gradients -------------------------------------------------------------------------------

    def note_grad_ready(self, param: ShardedParam) -> bool:
        """Record that autograd finished ``param``'s gradient; True once every grad param has one."""
        if not self._grads_ready:
            # Counted once per backward: requires_grad may change between iterations, not within.
            self._grads_expected = sum(p.requires_grad for p in self.params)
        self._grads_ready.add(id(param))
        return len(self._grads_ready) == self._grads_expected

    @property
    def has_unreduced_grads(self) -> bool:
        return any(p.has_unreduced_grad for p in self.params)

    def post_backward(self) -> None:
        """After this group's backward: reduce-scatter (or stash) grads, then maybe reshard."""
        self.reduced_this_backward = True
        if self.requires_gradient_sync:
            self._reduce_scatter_grads()
        else:
            for p in self.params:
                if p.unsharded_param is not None and p.requires_grad:
                    p.stash_grad_without_sync()
        if self.reshard_after_backward:
            self.reshard()

    def _reduce_scatter_grads(self) -> None:
        grads = {id(p): p.take_unreduced_grad() for p in self.params if p.requires_grad}
        if all(g is None for g in grads.values()):
            return
        world = self.dp.shard_size
        local = world == 1 and self.one_rank_shortcut  # nothing to communicate across shards
        pending = []
        for bucket in self.reduce_buckets():
            inp = _reduce_scatter_input(bucket, [grads[id(p)] for p in bucket.params], world, self.dp.device)
            if bucket.dtype == torch.float16 and self._divide_factor != 1:
                inp.div_(self._divide_factor)  # fp16 would overflow summing before dividing
            if local:
                out = inp.view(-1)  # a reduce-scatter over one rank is the identity
            else:
                out = torch.empty(bucket.numel_per_rank, dtype=bucket.dtype, device=self.dp.device)
            pending.append(PendingReduce(bucket, inp, out))
        del grads  # copied in: the full gradients can go (same stream, so no hazard)
        side = self.streams.reduce_scatter
        side.wait_for_compute()
        completion = Completion(side)
        with side.active():
            for p in pending:
                if not local:
                    completion.add(
                        collectives.reduce_scatter_sum(p.output, p.input.view(-1), self.dp.shard_group, async_op=side.async_op)
                    )
                if not side.async_op:
                    self._finish_reduction(p)  # queued on the reduce-scatter stream, after the collective
            completion.event = side.record()
        self._pending_reduces.extend(pending)
        self._reduce_completions.append(completion)

    def _finish_reduction(self, pending: PendingReduce) -> None:
        """Across replicas (HSDP) and the average, once the reduce-scatter's result is there."""
        if self.dp.is_hybrid:
            collectives.all_reduce_sum(pending.output, self.dp.replicate_group, async_op=False)
        if pending.bucket.dtype != torch.float16 and self._divide_factor != 1:
            pending.output.div_(self._divide_factor)

    def reduce_buckets(self) -> list[FlatBucket]:
        pattern = tuple(p.requires_grad for p in self.params)
        if pattern not in self._reduce_buckets:
            needed = [p for p in self.params if p.requires_grad]
            self._reduce_buckets[pattern] = _buckets(needed, lambda p: p.reduce_dtype)
        return self._reduce_buckets[pattern]

    @property
    def _divide_factor(self) -> float:
        return self.gradient_divide_factor or float(self.dp.data_parallel_size)

    @property
    def has_pending_reduce(self) -> bool:
        return bool(self._pending_reduces)

    def finish_reduce(self) -> None:
        """Wait for issued reduce-scatters and add the results to the sharded ``.grad``s."""
        for completion in self._reduce_completions:
            completion.wait()
        self._reduce_completions.clear()
        for pending in self._pending_reduces:
            if self.streams.reduce_scatter.async_op:
                self._finish_reduction(pending)  # not queued on a stream at issue time
            for p, slot in zip(pending.bucket.params, torch.split_with_sizes(pending.output, pending.bucket.sizes)):
                p.accumulate_sharded_grad(slot)
        self._pending_reduces.clear()

    def end_backward(self) -> None:
        self._grads_ready.clear()
        self.reduced_this_backward = False
