"""Parameters packed side by side in one flat communication buffer.

A buffer is ``world x numel_per_rank``: row ``r`` is shard rank ``r``'s slot, and each parameter
owns column blocks of it. Gradients (:class:`FlatBucket`) take one block of ``padded_shard_numel``
per parameter, per reduce dtype (see fsdp2.layout.shard_layout for how a tensor maps to its padded
shards). The all-gather (:class:`GatherBucket`) takes whatever columns
(fsdp2.runtime.codecs.Column) each parameter's gather codec asks for, all of a group in one buffer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from fsdp2.runtime.codecs import CodecParam, Column


@dataclass
class FlatBucket:
    dtype: torch.dtype
    params: list[CodecParam]
    sizes: list[int] = field(init=False)  # padded shard numel per parameter
    offsets: list[int] = field(init=False)
    numel_per_rank: int = field(init=False)
    all_dim0: bool = field(init=False)  # every parameter sharded on dim 0 (its rank blocks are rows)
    all_dim0_even: bool = field(init=False)  # ... and without padding

    def __post_init__(self) -> None:
        self.sizes = [p.layout.padded_shard_numel for p in self.params]
        self.offsets = list(itertools.accumulate(self.sizes, initial=0))[:-1]
        self.numel_per_rank = sum(self.sizes)
        self.all_dim0 = all(p.layout.dim == 0 for p in self.params)
        self.all_dim0_even = self.all_dim0 and all(p.layout.is_even for p in self.params)

    def columns(self, buffer_2d: torch.Tensor) -> Iterator[tuple[CodecParam, torch.Tensor]]:
        """(param, its ``world x padded_shard_numel`` block of a ``world x numel_per_rank`` buffer)."""
        for p, off, size in zip(self.params, self.offsets, self.sizes):
            yield p, buffer_2d[:, off : off + size]


def buckets_by_dtype(params: list[CodecParam], dtype_of: Callable[[CodecParam], torch.dtype]) -> list[FlatBucket]:
    by_dtype: dict[torch.dtype, list[CodecParam]] = {}
    for p in params:
        by_dtype.setdefault(dtype_of(p), []).append(p)
    return [FlatBucket(dtype, ps) for dtype, ps in by_dtype.items()]


# -- all-gather ----------------------------------------------------------------------------------


# In a buffer of mixed dtypes every column starts this many bytes apart at least, so a column
# views as its own dtype in place (and a quantized slot's scales as theirs).
COLUMN_ALIGN = 16


def gather_row(columns: Sequence[Column]) -> tuple[torch.dtype, list[int]]:
    """The all-gather buffer's dtype and each column's width in it (buffer elements), for one
    group's ``columns`` in order. Columns of one dtype sit side by side in that dtype; mixed
    dtypes travel as bytes, each column padded to ``COLUMN_ALIGN`` bytes (one collective per
    group either way, as PyTorch's FSDP2 does)."""
    dtypes = {c.dtype for c in columns}
    if len(dtypes) <= 1:
        return (dtypes.pop() if dtypes else torch.uint8), [c.numel for c in columns]
    return torch.uint8, [-(-c.nbytes // COLUMN_ALIGN) * COLUMN_ALIGN for c in columns]


def gather_row_bytes(columns: Sequence[Column]) -> int:
    """Bytes of one rank's row of the all-gather of ``columns`` (shared with the estimator)."""
    dtype, widths = gather_row(columns)
    return sum(widths) * dtype.itemsize


@dataclass
class GatherBucket:
    """One group's all-gather buffer: every parameter's columns side by side in each rank's row.

    ``plain``: every parameter uses the default codec and one dtype, so copy-in and copy-out can
    each be one fused copy over ``widths`` (one column per parameter).
    """

    params: list[CodecParam]
    columns: list[tuple[Column, ...]]  # per parameter
    dtype: torch.dtype = field(init=False)
    widths: list[int] = field(init=False)  # per column, all parameters' in order
    numel_per_rank: int = field(init=False)
    plain: bool = field(init=False)
    rebuilt_from_unsharded: bool = field(init=False)  # reshard_after_forward=k rebuilds subgroup rows from the params

    def __post_init__(self) -> None:
        flat = [c for cols in self.columns for c in cols]
        self.dtype, self.widths = gather_row(flat)
        self.numel_per_rank = sum(self.widths)
        codecs = [p.codec for p in self.params]
        self.plain = all(c.plain for c in codecs) and len({c.dtype for c in flat}) <= 1
        self.rebuilt_from_unsharded = all(c.rebuilt_from_unsharded for c in codecs)

    def pieces(self, buffer: torch.Tensor) -> Iterator[tuple[CodecParam, list[torch.Tensor]]]:
        """(param, its columns of ``buffer`` viewed as their dtypes) for a 1-D rank slot
        (``numel_per_rank``) or a 2-D ``rows x numel_per_rank`` buffer."""
        split = torch.split_with_sizes(buffer, self.widths, dim=-1)
        index = 0
        for p, cols in zip(self.params, self.columns):
            yield p, [self._typed(piece, col) for piece, col in zip(split[index : index + len(cols)], cols)]
            index += len(cols)

    def row_pieces(self, wire: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What this rank's row is the concatenation of, from each column's tensor (``wire``, in
        column order; a compiled step concatenates them, eager writes each into its slot of the
        row): the tensors as they are where all have the row's dtype; else their bytes, each
        padded to its column's aligned width (the padding lands only in padding)."""
        if all(t.dtype == self.dtype for t in wire):
            return list(wire)
        pieces = []
        for t, width in zip(wire, self.widths):
            piece = t.reshape(-1).view(torch.uint8)
            pieces.append(piece)
            if width > piece.numel():
                pieces.append(piece.new_empty(width - piece.numel()))
        return pieces

    def _typed(self, piece: torch.Tensor, column: Column) -> torch.Tensor:
        if column.dtype == self.dtype:
            return piece
        return piece[..., : column.nbytes].view(column.dtype)


class ReusedBuffer:
    """A bucket's communication buffer reused from step to step, so that views of it are built once.

    Its storage exists only from ``allocate`` to ``release`` (freed and regrown: views survive
    that), as a fresh buffer's would, so peak memory is unchanged. Subclasses build their views in
    ``__init__`` while the storage is there, then call ``release()``.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        self.buffer = torch.empty(shape, dtype=dtype, device=device)
        self._nbytes = self.buffer.untyped_storage().nbytes()
        self.in_use = True

    def allocate(self) -> torch.Tensor:
        self.buffer.untyped_storage().resize_(self._nbytes)
        self.in_use = True
        return self.buffer

    def release(self) -> None:
        """Free the storage (the collective that read it is done, or abandoned)."""
        if self.in_use:
            self.buffer.untyped_storage().resize_(0)
            self.in_use = False
