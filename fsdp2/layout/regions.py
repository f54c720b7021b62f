"""Which box of a global tensor each rank holds, from metadata alone.

One rule splits a tensor dim over ``parts`` ranks everywhere in fsdp2, the one ``torch.chunk``
and DTensor's ``Shard`` use: pieces of ``ceil(size / parts)`` rows, so the last ranks may hold
fewer rows or none (:func:`chunk_extent`). The runtime's padded shards
(:mod:`fsdp2.layout.shard_layout`), loading full tensors into sharded modules, and checkpoints
(which bytes a rank writes, which it reads) all derive from it.

Errors here are :class:`LayoutError`; callers turn them into their own error types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2 import compat


class LayoutError(ValueError):
    """A placement or box this module cannot describe; the message says which and why."""


def chunk_extent(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of piece ``index`` when ``size`` rows are split in ``parts`` (torch.chunk)."""
    piece = -(-size // parts)
    start = min(index * piece, size)
    return start, min(piece, size - start)


@dataclass(frozen=True)
class Region:
    """A box inside a tensor: ``offsets`` and ``shape`` per dimension."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "Region":
        """The box covering a whole tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: "Region") -> "Region | None":
        offs, shape = [], []
        for a0, an, b0, bn in zip(self.offsets, self.shape, other.offsets, other.shape):
            lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
            if hi <= lo:
                return None
            offs.append(lo)
            shape.append(hi - lo)
        return Region(tuple(offs), tuple(shape))

    def slices(self) -> tuple[slice, ...]:
        """Index of this box in the global tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.shape))

    def slices_within(self, outer: "Region") -> tuple[slice, ...]:
        """Index of this box inside a tensor holding ``outer``."""
        return tuple(slice(o - oo, o - oo + n) for o, n, oo in zip(self.offsets, self.shape, outer.offsets))


def shard_region(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence
) -> Region:
    """The global box of the local shard at mesh ``coordinate``, DTensor's sharding rule.

    Each ``Shard(d)`` mesh dim splits the current extent of tensor dim ``d`` with
    :func:`chunk_extent`; ``Replicate()`` leaves it whole. Mesh dims apply in order, so
    ``(Shard(0), Shard(0))`` nests.
    """
    offsets = [0] * len(global_shape)
    shape = list(global_shape)
    for mesh_dim in split_order(placements, mesh_shape, len(global_shape)):
        d = placements[mesh_dim].dim % len(global_shape)
        start, length = chunk_extent(shape[d], mesh_shape[mesh_dim], coordinate[mesh_dim])
        offsets[d] += start
        shape[d] = length
    return Region(tuple(offsets), tuple(shape))


def split_order(placements: Sequence, mesh_shape: Sequence[int], ndim: int) -> list[int]:
    """Mesh dims in the order their splits apply.

    ``Shard`` dims split in mesh order. ``_StridedShard(d, split_factor=f)`` (fully_shard on a
    tensor that tensor parallelism already split along ``d``) splits *after* the later
    ``Shard(d)`` dims whose sizes multiply to ``f``: TP cuts first, FSDP cuts each TP piece,
    so every rank still holds one box.
    """
    order: list[int] = []
    deferred: list[int] = []
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, compat.StridedShard):
            d = placement.dim % ndim
            later = [
                m
                for m in range(mesh_dim + 1, len(placements))
                if type(placements[m]) is Shard and placements[m].dim % ndim == d
            ]
            if math.prod(mesh_shape[m] for m in later) != placement.split_factor:
                raise LayoutError(
                    f"placement {placement!r}: its split factor does not match the later Shard dims on the "
                    "same tensor dim; redistribute the tensor first"
                )
            deferred.append(mesh_dim)
            continue
        if type(placement) is not Shard:
            raise LayoutError(
                f"placement {placement!r} is not supported (only Shard(d), Replicate() and fully_shard's "
                "_StridedShard); redistribute the tensor first"
            )
        order.append(mesh_dim)
    return order + deferred


def local_region(value: torch.Tensor) -> Region | None:
    """The global box this rank holds of ``value``: all of a plain tensor; None if this rank is
    not on a DTensor's mesh. Raises if a DTensor's local shard disagrees with its placements."""
    if not isinstance(value, DTensor):
        return Region.whole(value.shape)
    mesh = value.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    region = shard_region(tuple(value.shape), tuple(mesh.shape), coord, value.placements)
    local_shape = tuple(compat.local_tensor(value).shape)
    if local_shape != region.shape:
        raise LayoutError(
            f"local shard shape {list(local_shape)} of a DTensor with placements {value.placements} "
            f"does not match the box its placements give ({list(region.shape)})"
        )
    return region


def local_part_like(template: DTensor, full: torch.Tensor) -> DTensor:
    """This rank's box of the full tensor ``full``, as a DTensor laid out like ``template``.

    No communication: every rank slices its own box out of the full tensor it already has. The
    box goes where the template's shard is, unless that is the meta device (a model built on
    meta and loaded with ``assign=True``): then it stays where ``full`` is.
    """
    local = full[local_region(template).slices()]
    device = compat.local_tensor(template).device
    return compat.dtensor_like(template, local if device.type == "meta" else local.to(device))
