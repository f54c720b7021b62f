"""How one tensor is split into per-rank shards, and the copies in and out of flat comm buffers.

Along ``dim`` every rank gets the rows :func:`fsdp2.layout.regions.chunk_extent` gives it (``torch.chunk``
and DTensor's ``Shard`` rule: ``chunk = ceil(size / world)`` rows, high ranks fewer or none).
In communication buffers every rank's shard is padded to ``chunk`` rows, so all ranks send
equal-sized pieces and one all-gather / reduce-scatter serves a whole group of parameters.

A flat buffer with ``world`` rows and one column block per parameter looks like::

            param A (n_A cols)   param B (n_B cols)
    rank 0  [A shard 0, padded] [B shard 0, padded]
    rank 1  [A shard 1, padded] [B shard 1, padded]

All functions here are pure tensor copies (no communication), so they can be tested alone.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from fsdp2.layout.regions import chunk_extent


@dataclass(frozen=True)
class ShardLayout:
    """Split of a tensor of ``full_shape`` along ``dim`` across ``world`` ranks, seen from ``rank``.

    Immutable, so the derived sizes are computed once, at construction (they are read per
    parameter per step, and torch.compile's tracer reads them as plain attributes).
    """

    full_shape: torch.Size
    dim: int
    world: int
    rank: int
    # Derived, set in __post_init__:
    chunk: int = field(init=False, repr=False, compare=False)  # rows along ``dim`` of every padded shard
    local_rows: int = field(init=False, repr=False, compare=False)
    local_offset: int = field(init=False, repr=False, compare=False)  # global index of this rank's first row
    local_shape: torch.Size = field(init=False, repr=False, compare=False)
    padded_shard_shape: torch.Size = field(init=False, repr=False, compare=False)
    padded_shard_numel: int = field(init=False, repr=False, compare=False)
    full_numel: int = field(init=False, repr=False, compare=False)
    full_strides: tuple[int, ...] = field(init=False, repr=False, compare=False)  # contiguous strides of full_shape
    is_even: bool = field(init=False, repr=False, compare=False)
    ranks_with_rows: int = field(
        init=False, repr=False, compare=False
    )  # the first ranks hold real rows, the rest only padding

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)  # frozen
        set_("chunk", -(-self.full_shape[self.dim] // self.world))
        set_("local_rows", self.rows_of(self.rank))
        set_("local_offset", self.offset_of(self.rank))
        set_("local_shape", self.shape_of(self.rank))
        set_("padded_shard_shape", self._with_rows(self.chunk))
        set_("padded_shard_numel", math.prod(self.padded_shard_shape))
        set_("full_numel", math.prod(self.full_shape))
        strides, step = [], 1
        for n in reversed(self.full_shape):
            strides.append(step)
            step *= max(n, 1)
        set_("full_strides", tuple(reversed(strides)))
        set_("is_even", self.full_shape[self.dim] == self.chunk * self.world)
        set_("ranks_with_rows", min(self.world, -(-self.full_shape[self.dim] // self.chunk)) if self.chunk else 0)

    def rows_of(self, rank: int) -> int:
        """Real (unpadded) rows along ``dim`` held by ``rank``; 0 for ranks past the tail."""
        return chunk_extent(self.full_shape[self.dim], self.world, rank)[1]

    def offset_of(self, rank: int) -> int:
        """Global index along ``dim`` of ``rank``'s first row."""
        return chunk_extent(self.full_shape[self.dim], self.world, rank)[0]

    def shape_of(self, rank: int) -> torch.Size:
        """Shape of ``rank``'s (unpadded) shard."""
        return self._with_rows(self.rows_of(rank))

    def _with_rows(self, rows: int) -> torch.Size:
        shape = list(self.full_shape)
        shape[self.dim] = rows
        return torch.Size(shape)

    # -- sharding a full tensor -------------------------------------------------------------

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``full`` (a view)."""
        return full.narrow(self.dim, self.local_offset, self.local_rows)

    # -- all-gather: shard -> padded slot -> full ---------------------------------------------

    def copy_full_out(self, gathered: torch.Tensor, padded_full: torch.Tensor) -> torch.Tensor:
        """Rebuild the full tensor from ``gathered`` (``world x padded_shard_numel``, may be strided).

        ``padded_full`` is a 1-D buffer of ``world * padded_shard_numel`` elements that receives
        the result; returns the full tensor as a view of its first ``full_numel`` elements.
        """
        full = padded_full[: self.full_numel].view(self.full_shape)
        if self.dim == 0:
            # Rank blocks stacked along dim 0 *are* the padded full tensor: a single copy.
            padded_full.view(self.world, self.padded_shard_numel).copy_(gathered)
        elif self.full_numel:
            blocks = gathered.reshape(self.world, *self.padded_shard_shape).unbind(0)
            full.copy_(torch.cat(blocks, dim=self.dim).narrow(self.dim, 0, self.full_shape[self.dim]))
        return full

    # -- the same copies as tensor expressions (autograd and torch.compile trace them) -----------

    def padded_slot(self, shard: torch.Tensor) -> torch.Tensor:
        """What this rank sends in the all-gather, in row-major order (the traced path packs it
        flat): ``shard`` itself when it has ``chunk`` rows, else a new tensor padded with zero rows
        to ``chunk`` along ``dim`` (its gradient is the shard's rows of the slot's)."""
        missing = self.chunk - shard.shape[self.dim]
        if not missing:
            return shard
        pad_shape = list(shard.shape)
        pad_shape[self.dim] = missing
        return torch.cat([shard, shard.new_zeros(pad_shape)], dim=self.dim)

    def full_from_rank_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """The full tensor from ``gathered`` (``world x padded_shard_numel``), as :meth:`copy_full_out`
        builds it, but as a view or a new tensor instead of a copy into a given buffer. Contiguous,
        as that copy is: kernels choose their path by strides (``F.linear`` adds a strided bias
        apart from its matmul, rounding a 16-bit result twice), so a strided view (a column of one
        element per rank) would compute differently."""
        if self.dim == 0:
            return gathered.reshape(-1)[: self.full_numel].view(self.full_shape).contiguous()
        blocks = gathered.reshape(self.world, *self.padded_shard_shape).unbind(0)
        return torch.cat(blocks, dim=self.dim).narrow(self.dim, 0, self.full_shape[self.dim]).contiguous()

    # -- reduce-scatter: full gradient -> padded slots -> shard --------------------------------

    def copy_full_in(self, full: torch.Tensor, slots: torch.Tensor) -> None:
        """Scatter ``full`` into ``slots`` (``world x padded_shard_numel``), zeroing the padding."""
        if not self.padded_shard_numel:
            return
        if self.dim == 0:
            self._copy_rows_in(full, slots)
            return
        for rank in range(self.world):
            rows = self.rows_of(rank)
            block = slots[rank].view(self.padded_shard_shape)
            if rows:
                block.narrow(self.dim, 0, rows).copy_(full.narrow(self.dim, rank * self.chunk, rows))
            if rows < self.chunk:
                block.narrow(self.dim, rows, self.chunk - rows).zero_()

    def _copy_rows_in(self, full: torch.Tensor, slots: torch.Tensor) -> None:
        # Along dim 0 rank blocks are consecutive rows: complete ranks in one copy, then the
        # partial tail rank, then zeros; no per-rank loop (it dominates at 1024 ranks).
        complete = self.full_shape[0] // self.chunk
        rows = complete * self.chunk
        if complete:
            slots[:complete].copy_(full[:rows].reshape(complete, self.padded_shard_numel))
        if complete == self.world:
            return
        tail = self.full_shape[0] - rows
        if tail:
            block = slots[complete].view(self.padded_shard_shape)
            block[:tail].copy_(full[rows:])
            block[tail:].zero_()
            complete += 1
        slots[complete:].zero_()

    def copy_in_views(self, slots: torch.Tensor) -> "CopyInViews":
        """Views of ``slots`` (``world x padded_shard_numel``, may be strided) for :meth:`copy_full_in`
        along dim 0 as fused ops: built once, they let a caller that keeps ``slots`` (its storage
        freed and regrown between uses) copy every step with no per-rank and few per-tensor ops."""
        assert self.dim == 0, "copy_in_views: only dim-0 layouts are rank blocks of rows"
        rows, chunk = self.full_shape[0], self.chunk
        if not self.padded_shard_numel:
            return CopyInViews([], [], [])
        if chunk == 1:
            # One row per rank: the real rows are an evenly strided view shaped like the tensor,
            # so the full gradient is copied as it is (no per-step view).
            return CopyInViews([slots[:rows].view(self.full_shape)], _nonempty([slots[rows:]]), [(0, rows, None)])
        complete = rows // chunk
        tail = rows - complete * chunk
        destinations, sources = [slots[:complete]], [(0, complete * chunk, (complete, self.padded_shard_numel))]
        padding = [slots[complete + (1 if tail else 0) :]]
        if tail:
            row_numel = self.padded_shard_numel // chunk
            destinations.append(slots[complete, : tail * row_numel])
            sources.append((complete * chunk, rows, (tail * row_numel,)))
            padding.append(slots[complete, tail * row_numel :])
        return CopyInViews(destinations, _nonempty(padding), sources)

    def shard_rows(self, slot: torch.Tensor) -> torch.Tensor:
        """This rank's real rows of its padded ``slot`` (1-D): a view of ``local_shape``."""
        if self.local_rows == self.chunk:
            return slot.view(self.local_shape)  # no padding on this rank
        return slot.view(self.padded_shard_shape).narrow(self.dim, 0, self.local_rows)


def _nonempty(views: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v for v in views if v.numel()]


@dataclass
class CopyInViews:
    """One tensor's copy into its padded rank slots, as views built once (:meth:`ShardLayout.copy_in_views`).

    ``destinations[i]`` receives rows ``start:stop`` of the full tensor, viewed as ``shape`` (None:
    the tensor as it is); ``padding`` is what must be zeroed.
    """

    destinations: list[torch.Tensor]
    padding: list[torch.Tensor]
    source_rows: list[tuple[int, int, tuple[int, ...] | None]]

    @functools.cached_property
    def takes_whole(self) -> bool:
        """The one destination takes the full tensor as it is (no per-copy view of it)."""
        return len(self.source_rows) == 1 and self.source_rows[0][2] is None

    def sources(self, full: torch.Tensor) -> list[torch.Tensor]:
        """The pieces of ``full`` that go to ``destinations``, in order."""
        pieces = []
        for start, stop, shape in self.source_rows:
            if shape is None:
                pieces.append(full)
            else:
                rows = full if start == 0 and stop == full.shape[0] else full[start:stop]
                pieces.append(rows.reshape(shape))
        return pieces


def rank_rows_from_subgroups(gathered: torch.Tensor, k: int, world: int) -> torch.Tensor:
    """``world x n`` rows in shard-rank order from ``gathered``, an all-gather over a k-rank subgroup
    of what each member kept after forward (``reshard_after_forward=k``): member j kept shard ranks
    j, j + k, j + 2k, ...; undo that interleave."""
    return gathered.view(k, world // k, -1).transpose(0, 1).reshape(world, -1)
