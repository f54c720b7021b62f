"""The all-gather side of one group: shards in, one collective, full parameters out.

Each parameter's gather codec (fsdp2.runtime.codecs) says which columns it takes in the group's
buffer (fsdp2.runtime.buckets.GatherBucket) and packs / unpacks them. With only default codecs
and one dtype (the common case), copy-in is one fused cast-copy of every shard into this rank's
slot of the output buffer (the all-gather is in place: our input is our own slot) and copy-out
one ``split_with_sizes_copy`` of every dim-0 parameter's rows into its unsharded storage (on CPU one
``_foreach_copy_`` of the rank slots holding real rows, from an output reused with its views). Other
codecs add what is not a copy (quantize, dequantize, a tensor subclass's hooks) and hand their
plain copies to one fused ``_foreach_copy_``.

With ``reshard_after_forward=k`` backward gathers over a k-rank subgroup from this rank's subgroup
rows (its 1/k of the gathered rows, held from forward) instead of from the shards: rebuilt from the
unsharded parameters where every codec allows it, else taken from the gathered buffer itself when
forward's gather ends.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdp2 import compat
from fsdp2.errors import FSDPUsageRuntimeError
from fsdp2.layout.shard_layout import rank_rows_from_subgroups
from fsdp2.runtime import collectives
from fsdp2.runtime.buckets import GatherBucket, ReusedBuffer
from fsdp2.runtime.codecs import Column
from fsdp2.runtime.dp_mesh import DataParallelMesh
from fsdp2.runtime.group_step import GatherStep
from fsdp2.runtime.sharded_param import (
    ShardedParam,
    copy_in_pairs,
    gather_real_row_targets,
    gather_targets,
    unsharded_storages,
)
from fsdp2.runtime.streams import CommStreams, Completion


@dataclass(frozen=True)
class Subgroup:
    """The k ranks a group is re-gathered over after ``reshard_after_forward=k``, and our place in it."""

    group: dist.ProcessGroup
    position: int
    size: int
    across: dist.ProcessGroup  # the ranks at our position in every subgroup (dp_mesh.across_subgroups)


class ReusedGatherOutput(ReusedBuffer):
    """A plain dim-0 bucket's all-gather output on CPU, reused from step to step with its views built once.

    Copy-out then writes only the rank slots that hold real rows (``ShardLayout.ranks_with_rows``),
    one ``_foreach_copy_`` for the bucket, instead of every padded slot, padding written and read
    for nothing (the unsharded parameter views only the real rows; the bytes written at 1024 ranks
    are in benchmarks/RESULTS.md, "Host work per step"). CPU only (no side streams): there ``split_with_sizes_copy``
    is a copy per parameter anyway, while on an accelerator it is one kernel for the bucket and
    the padding bytes cost the device, not the host. The storage exists only from ``allocate`` to
    ``release`` (see ReusedBuffer).
    """

    def __init__(self, bucket: GatherBucket, world: int, rank: int, device):
        n = bucket.numel_per_rank
        super().__init__((world * n,), bucket.dtype, device)
        self.own_slot = self.buffer.narrow(0, rank * n, n)
        self.own_slots = torch.split_with_sizes(self.own_slot, bucket.widths)
        columns = torch.split_with_sizes(self.buffer.view(world, n), bucket.widths, dim=1)
        self._sources = [column[: p.layout.ranks_with_rows] for p, column in zip(bucket.params, columns)]
        self.release()

    def copy_out(self, params: list[ShardedParam]) -> None:
        compat.foreach_copy_(gather_real_row_targets(params), self._sources)


@dataclass
class PendingGather:
    bucket: GatherBucket
    output: torch.Tensor
    # Gathered from a k-rank subgroup: the output holds rank rows interleaved by k.
    subgroup_size: int | None = None
    # Compute-stream tensors the all-gather stream reads: freed only after compute waited for it.
    inputs: torch.Tensor | None = None
    reused_output: ReusedGatherOutput | None = None  # owns ``output``: released once copied out

    def rank_rows(self, world: int) -> torch.Tensor:
        """The output as ``world x numel_per_rank``, row r holding shard rank r's slot."""
        n = self.bucket.numel_per_rank
        if self.subgroup_size is None:
            return self.output.view(world, n)
        return rank_rows_from_subgroups(self.output, self.subgroup_size, world)

    def copy_out(self, world: int) -> None:
        """Build every parameter's unsharded form from the gathered rows."""
        if self.reused_output is not None:
            self.reused_output.copy_out(self.bucket.params)
            return
        rows = self.rank_rows(world)
        bucket = self.bucket
        if bucket.plain:
            targets = gather_targets(bucket.params)
            if targets is not None:
                torch.split_with_sizes_copy(rows, bucket.widths, dim=1, out=targets)  # one copy per bucket
                return
        pairs = []
        for p, blocks in bucket.pieces(rows):
            pairs += p.codec.unpack(blocks)
        _copy_pairs(pairs)
        for p in bucket.params:
            p.codec.finish()


def _copy_pairs(pairs) -> None:
    """One fused (casting) copy of every ``(destination, shard)`` pair; ``None`` pairs are skipped."""
    if not isinstance(pairs, list) or None in pairs:
        pairs = [pair for pair in pairs if pair is not None]
    if pairs:
        destinations, shards = zip(*pairs)
        # Pinned CPU shards (offload) copy host-to-device without blocking the host.
        compat.foreach_copy_(list(destinations), list(shards), non_blocking=shards[0].is_pinned())


def _check_not_meta(params: list[ShardedParam]) -> None:
    for p, shard in zip(params, compat.local_tensors([p.sharded_param for p in params])):
        # Otherwise the shard copy fails deep inside with "Cannot copy out of meta tensor".
        if shard.is_meta:
            raise FSDPUsageRuntimeError(
                f"parameter {p.fqn} is on the meta device: call module.to_empty(device=...) and "
                "initialize the parameters (e.g. reset_parameters()) before running the module"
            )


class GroupGather:
    """Packs, all-gathers and unpacks one group's parameters; holds the gathers in flight."""

    def __init__(self, params: list[ShardedParam], dp: DataParallelMesh, streams: CommStreams):
        self.params = params
        self.dp = dp
        self.streams = streams
        out_collectives = collectives.out_variants_usable(dp.shard_group)
        self.step = GatherStep(dp.shard_size, dp.shard_group, out_collectives=out_collectives)
        self.rebuild()
        self._pending: list[PendingGather] = []
        self._completion: Completion | None = None
        self._rows_at_finish: list[torch.Tensor | None] = []  # per bucket: see finish(for_subgroup=...)

    def set_custom_all_gather(self, comm: Any) -> None:
        """``FSDPModule.set_custom_all_gather``: eager gathers call ``comm``, compiled ones by its key."""
        self.step = dataclasses.replace(self.step, custom=comm)

    def rebuild(self) -> None:
        """Lay the buffer out anew: codecs or dtypes (``module.to(dtype)``) changed (at the next
        gather where a tensor subclass's hook decides its columns)."""
        self._buckets: list[GatherBucket] | None = None
        self._all_plain = all(p.codec.plain for p in self.params)
        # Codecs whose columns are known only after their prepare() (a tensor subclass's hook).
        self._preparing = [p.codec for p in self.params if p.codec.prepares]
        self._prepared_columns: list = []
        if self.layout_fixed:
            self._lay_out()  # now, outside any trace: the compiled step reads it

    @property
    def buckets(self) -> list[GatherBucket]:
        """The group's one all-gather buffer layout (none without parameters)."""
        if self._buckets is None:
            self._lay_out()
        return self._buckets

    def _lay_out(self) -> None:
        self._buckets = [GatherBucket(self.params, [p.codec.columns() for p in self.params])] if self.params else []
        self._prepared_columns = [codec.columns() for codec in self._preparing]
        # Per bucket: its reused output, False where none can serve, None until its first gather.
        self._reused_outputs: list[ReusedGatherOutput | bool | None] = [None] * len(self._buckets)

    def _reused_output(self, index: int, bucket: GatherBucket) -> ReusedGatherOutput | None:
        """``bucket``'s reused output, allocated, where it can serve (see ReusedGatherOutput); else None."""
        if self.step.custom is not None:
            return None  # the user's collective allocates
        reused = self._reused_outputs[index]
        if reused is None:  # decided once per layout: plain dim-0 columns, and no side streams (with
            # streams GatherBuffers holds each output until the all-gather stream may reuse it)
            no_streams = self.streams.all_gather.stream is None
            servable = bucket.plain and no_streams and all([p.layout.dim == 0 for p in bucket.params])
            dp = self.dp
            reused = self._reused_outputs[index] = (
                ReusedGatherOutput(bucket, dp.shard_size, dp.shard_rank, dp.device) if servable else False
            )
        if not reused or reused.in_use:
            return None  # not servable, or an earlier gather of this bucket is unfinished: a fresh buffer
        reused.allocate()
        return reused

    @property
    def layout_fixed(self) -> bool:
        """Every codec's columns are known before a gather (no tensor subclass's hook decides
        them): ``buckets`` is the layout of every gather, eager and compiled."""
        return not self._preparing

    def _buckets_after_prepare(self) -> list[GatherBucket]:
        if self._preparing and [codec.columns() for codec in self._preparing] != self._prepared_columns:
            self._buckets = None  # a hook's inputs changed shape or dtype: lay the buffer out again
        return self.buckets

    @property
    def gathered_numel_per_rank(self) -> int:
        return sum(b.numel_per_rank for b in self.buckets)

    # -- the functional form: what a compiled graph traces -------------------------------------------

    def encode_row(self, shards: list[torch.Tensor]) -> tuple[list, GatherBucket, list[torch.Tensor]]:
        """Each parameter's wire tensors and context (its codec's ``encode`` of its shard in
        ``shards``), the bucket they are laid out in (the group's, or where a tensor subclass's hook
        decides its columns, as this encoding gave them) and the pieces of this rank's row of it
        (``GatherBucket.row_pieces``), side by side."""
        params = self.params
        encoded = [p.codec.encode(shard) for p, shard in zip(params, shards)]
        if self.layout_fixed:
            (bucket,) = self.buckets
        else:
            bucket = GatherBucket(params, [tuple(Column(t.dtype, t.numel()) for t in wire) for wire, _ in encoded])
        return encoded, bucket, bucket.row_pieces([t for tensors, _ in encoded for t in tensors])

    @staticmethod
    def decode_rows(encoded: list, bucket: GatherBucket, rows: torch.Tensor, shards) -> list[torch.Tensor]:
        """Each parameter unsharded from the gathered ``rows`` (``world x row``): its codec's
        ``decode`` of its columns, viewed as their dtypes (``GatherBucket.pieces``)."""
        return [
            p.codec.decode(shard, tensors, context, typed)
            for (p, typed), shard, (tensors, context) in zip(bucket.pieces(rows), shards, encoded)
        ]

    # -- issue ------------------------------------------------------------------------------------

    def unshard_locally(self) -> None:
        """Shard group of one rank: the shard is the whole parameter, so skip the all-gather and
        its buffer and cast-copy each shard straight into its unsharded storage (compute stream)."""
        _check_not_meta(self.params)
        if self._all_plain:
            _copy_pairs(copy_in_pairs(self.params, unsharded_storages(self.params)))
            return
        pairs = []
        for p in self.params:
            pairs += p.codec.unshard_locally()
        _copy_pairs(pairs)
        for p in self.params:
            p.codec.finish()

    def issue_from_shards(self, wait_for_compute: bool) -> None:
        _check_not_meta(self.params)
        world, rank = self.dp.shard_size, self.dp.shard_rank
        with self.streams.all_gather.launch(wait_for_compute) as completion:
            self.streams.gather_buffers.release_before_allocating()
            for codec in self._preparing:
                codec.prepare()
            for index, bucket in enumerate(self._buckets_after_prepare()):
                reused = self._reused_output(index, bucket)
                if reused is not None:
                    _copy_pairs(copy_in_pairs(bucket.params, reused.own_slots))
                    pending = PendingGather(bucket, reused.buffer, reused_output=reused)
                    self._issue(completion, reused.buffer, reused.own_slot, self.dp.shard_group, pending)
                    continue
                output = self._allocate(world * bucket.numel_per_rank, bucket.dtype)
                # In-place all-gather: our input is our own slot of the output, no separate buffer.
                own_slot = output.narrow(0, rank * bucket.numel_per_rank, bucket.numel_per_rank)
                if bucket.plain:
                    _copy_pairs(copy_in_pairs(bucket.params, torch.split_with_sizes(own_slot, bucket.widths)))
                else:
                    pairs = []
                    for p, slots in bucket.pieces(own_slot):
                        pairs += p.codec.pack(slots)
                    _copy_pairs(pairs)
                self._issue(completion, output, own_slot, self.dp.shard_group, PendingGather(bucket, output))
        self._completion = completion

    def issue_from_subgroup_rows(self, subgroup_rows: list[torch.Tensor], subgroup: Subgroup) -> None:
        """Re-gather over ``subgroup`` from this rank's subgroup rows, held since forward."""
        with self.streams.all_gather.launch(wait_for_compute=True) as completion:
            self.streams.gather_buffers.release_before_allocating()
            for bucket, rows in zip(self.buckets, subgroup_rows):
                output = self._allocate(subgroup.size * rows.numel(), bucket.dtype)
                own_slot = output.narrow(0, subgroup.position * rows.numel(), rows.numel())
                own_slot.copy_(rows.view(-1))
                pending = PendingGather(bucket, output, subgroup_size=subgroup.size, inputs=rows)
                self._issue(completion, output, own_slot, subgroup.group, pending)
        self._completion = completion

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        custom = self.step.custom
        if custom is not None:
            return custom.allocate((numel,), dtype=dtype, device=self.dp.device)
        return torch.empty(numel, dtype=dtype, device=self.dp.device)

    def _issue(self, completion: Completion, output, own_slot, group, pending: PendingGather) -> None:
        custom = self.step.custom
        comm = custom if custom is not None else collectives.all_gather
        completion.collective(comm, output, own_slot, group)
        self._pending.append(pending)

    # -- finish -----------------------------------------------------------------------------------

    def finish(self, for_subgroup: Subgroup | None = None) -> None:
        """Wait for the issued all-gathers and copy them out into the unsharded parameters.

        ``for_subgroup``: forward will reshard to this subgroup (reshard_after_forward=k); for buffers
        whose subgroup rows cannot be rebuilt from the unsharded parameters (quantized or hook
        columns), take this rank's 1/k of the gathered rows now, as they were communicated.
        """
        self._completion.wait()
        self._completion = None
        world = self.dp.shard_size
        for pending in self._pending:
            pending.copy_out(world)
        self._rows_at_finish = [
            pending.rank_rows(world)[for_subgroup.position :: for_subgroup.size].clone()
            if for_subgroup is not None and pending.subgroup_size is None and not pending.bucket.rebuilt_from_unsharded
            else None
            for pending in self._pending
        ]
        self.streams.gather_buffers.consumed(
            [pending.output for pending in self._pending if pending.reused_output is None],
            self.streams.all_gather.compute_event(),
        )
        for pending in self._pending:
            if pending.reused_output is not None:
                pending.reused_output.release()  # no side streams: nothing reads it any more
        self._pending.clear()

    def rows_for_subgroup(self, subgroup: Subgroup) -> list[torch.Tensor] | None:
        """This rank's subgroup rows: its 1/k of the gathered group (every k-th rank row), held for
        backward; None if some of it can only come from the gather's own rows and those were not taken."""
        world, k = self.dp.shard_size, subgroup.size
        subgroup_rows = []
        rows_at_finish = self._rows_at_finish + [None] * (len(self.buckets) - len(self._rows_at_finish))
        self._rows_at_finish = []
        for bucket, rows in zip(self.buckets, rows_at_finish):
            if bucket.rebuilt_from_unsharded:
                rows = torch.empty(world // k, bucket.numel_per_rank, dtype=bucket.dtype, device=self.dp.device)
                for p, blocks in bucket.pieces(rows):
                    blocks[0].copy_(p.gathered_rank_rows()[subgroup.position :: k])
            elif rows is None:
                return None
            subgroup_rows.append(rows)
        return subgroup_rows
