"""Where a saved tensor's chunks are, as a rule: the mesh it was sharded on and its placements.

Format 3 does not list a tensor's chunks. Its manifest entry names a mesh (the global rank at each
mesh coordinate) and one placement per mesh dim, and that fixes every chunk: the copy at
coordinate 0 of each ``Replicate`` dim is the one written, and the rank at coordinate ``c`` of it
holds the box :func:`fsdp2.layout.regions.shard_region` gives for ``c`` (DTensor's rule:
``torch.chunk`` splits, so shards are unpadded and may be uneven or empty) in its own rank file,
under the tensor's key. Empty boxes are not stored. A plain tensor is the one-chunk case: a mesh of
no dims whose only rank is 0.

So the manifest grows with the tensors and the meshes, not with the ranks, and a loading rank
finds the chunks meeting its box without visiting the others (:meth:`ChunkRule.overlapping`).

Placements, as the manifest writes them: ``"R"`` (Replicate), ``"S(d)"`` (Shard(d)) and
``"SS(d,f)"`` (fully_shard's ``_StridedShard(d, split_factor=f)``, which splits after the later
``S(d)`` dims, whose sizes must multiply to ``f``).

Mesh ranks: an affine map ``rank = start + sum(c[i] * strides[i])`` where the mesh is one (every
mesh ``init_device_mesh`` makes and every slice of one), else the ranks listed in row-major order
(which grows with the mesh: the one case where a format-3 manifest does).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch.distributed.tensor import Replicate, Shard

from fsdp2 import compat
from fsdp2.layout.regions import LayoutError, Region, chunk_extent, shard_region, split_order

from .errors import CheckpointError

# Readers refuse larger world sizes: a crafted manifest must not make a reader or ``verify``
# walk billions of ranks (4,194,304 is far above any job that exists).
MAX_WORLD_SIZE = 1 << 22

_SHARD = re.compile(r"S\((\d+)\)")
_STRIDED = re.compile(r"SS\((\d+),(\d+)\)")


def placement_name(placement) -> str:
    """The manifest's name of a placement whose dim is already non-negative."""
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, compat.StridedShard):
        return f"SS({placement.dim},{placement.split_factor})"
    if type(placement) is Shard:
        return f"S({placement.dim})"
    raise LayoutError(
        f"placement {placement!r} cannot be saved (only Shard, Replicate and fully_shard's _StridedShard)"
    )


def placement_from_name(name) -> object:
    """The placement a manifest name stands for (``ValueError`` for anything else)."""
    if name == "R":
        return Replicate()
    if isinstance(name, str):
        m = _SHARD.fullmatch(name)
        if m:
            return Shard(int(m.group(1)))
        m = _STRIDED.fullmatch(name)
        if m and int(m.group(2)) >= 1:
            return compat.StridedShard(int(m.group(1)), split_factor=int(m.group(2)))
    raise ValueError(f"{name!r} is not a placement (R, S(d) or SS(d,f))")


def _int_list(values, what: str) -> tuple[int, ...]:
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        raise ValueError(f"{what} {values!r} is not a list of integers")
    return tuple(values)


@dataclass(frozen=True)
class MeshRanks:
    """The global rank at each coordinate of a mesh: affine (``start``, ``strides``) or listed (``ranks``)."""

    shape: tuple[int, ...]
    start: int = 0
    strides: tuple[int, ...] | None = None
    ranks: tuple[int, ...] | None = None  # row-major, when no affine map fits
    _coordinates: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @classmethod
    def single(cls, rank: int = 0) -> "MeshRanks":
        """The mesh of no dims: one coordinate, ``()``, at ``rank`` (where plain tensors live)."""
        return cls((), rank, ())

    @classmethod
    def of(cls, ranks: torch.Tensor) -> "MeshRanks":
        """From a ``DeviceMesh.mesh`` tensor: affine when it is one, else listed."""
        shape = tuple(ranks.shape)
        flat = ranks.reshape(-1)
        start = int(flat[0])
        strides = []
        for dim, size in enumerate(shape):
            step = tuple(1 if d == dim else 0 for d in range(len(shape)))
            strides.append(int(ranks[step]) - start if size > 1 else 0)
        expected = torch.full(shape, start, dtype=torch.int64)
        for dim, (size, stride) in enumerate(zip(shape, strides)):
            view = [1] * len(shape)
            view[dim] = size
            expected = expected + torch.arange(size, dtype=torch.int64).view(view) * stride
        if torch.equal(expected, ranks.to(torch.int64)):
            return cls(shape, start, tuple(strides))
        return cls(shape, ranks=tuple(int(r) for r in flat.tolist()))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def rank(self, coordinate: Sequence[int]) -> int:
        if self.ranks is not None:
            index = 0
            for c, n in zip(coordinate, self.shape):
                index = index * n + c
            return self.ranks[index]
        return self.start + sum(c * s for c, s in zip(coordinate, self.strides))

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """The coordinate holding ``rank``, None if it is not on the mesh (a table built on first use)."""
        if not self._coordinates:
            for index in range(self.size):
                coord, rest = [], index
                for n in reversed(self.shape):
                    coord.append(rest % n)
                    rest //= n
                coord = tuple(reversed(coord))
                self._coordinates[self.rank(coord)] = coord
        return self._coordinates.get(rank)

    def to_json(self) -> dict:
        if self.ranks is not None:
            return {"shape": list(self.shape), "ranks": list(self.ranks)}
        return {"shape": list(self.shape), "start": self.start, "strides": list(self.strides)}

    @classmethod
    def from_json(cls, d) -> "MeshRanks":
        if not isinstance(d, dict):
            raise ValueError(f"mesh {d!r} is not an object")
        shape = _int_list(d["shape"], "mesh shape")
        if "ranks" in d:
            return cls(shape, ranks=_int_list(d["ranks"], "mesh ranks"))
        start = d["start"]
        if type(start) is not int:
            raise ValueError(f"mesh start {start!r} is not an integer")
        return cls(shape, start, _int_list(d["strides"], "mesh strides"))

    def check(self, world_size: int) -> None:
        """Raise ``ValueError`` unless every coordinate holds a distinct rank in ``[0, world_size)``."""
        if any(n < 1 for n in self.shape):
            raise ValueError(f"mesh shape {list(self.shape)} has a dim smaller than 1")
        if self.size > world_size:
            raise ValueError(f"mesh of {self.size} ranks in a world of {world_size}")
        if self.ranks is not None:
            if len(self.ranks) != self.size:
                raise ValueError(f"mesh of shape {list(self.shape)} lists {len(self.ranks)} ranks")
            if any(not 0 <= r < world_size for r in self.ranks) or len(set(self.ranks)) != len(self.ranks):
                raise ValueError(f"mesh ranks are not distinct ranks of a world of {world_size}")
            return
        if len(self.strides) != len(self.shape):
            raise ValueError(f"mesh of shape {list(self.shape)} has {len(self.strides)} strides")
        low = self.start + sum(min(0, s * (n - 1)) for s, n in zip(self.strides, self.shape))
        high = self.start + sum(max(0, s * (n - 1)) for s, n in zip(self.strides, self.shape))
        if low < 0 or high >= world_size:
            raise ValueError(f"mesh ranks {low}..{high} lie outside a world of {world_size}")
        # Distinct ranks: ordered by stride, each dim must step over everything the smaller ones reach.
        reach = 0
        for s, n in sorted((abs(s), n) for s, n in zip(self.strides, self.shape) if n > 1):
            if s <= reach:
                raise ValueError(f"mesh strides {list(self.strides)} give two coordinates the same rank")
            reach += s * (n - 1)


@dataclass(frozen=True)
class ChunkRule:
    """A tensor's chunks: those the mesh's ranks hold under ``placements`` (one per mesh dim)."""

    mesh: MeshRanks
    placements: tuple

    @classmethod
    def whole_on_rank0(cls) -> "ChunkRule":
        return cls(MeshRanks.single(0), ())

    def placement_names(self) -> list[str]:
        return [placement_name(p) for p in self.placements]

    def check(self, shape: Sequence[int], world_size: int) -> None:
        """Raise ``ValueError`` unless the rule describes ``shape`` on a world of ``world_size``."""
        self.mesh.check(world_size)
        if len(self.placements) != len(self.mesh.shape):
            raise ValueError(f"{len(self.placements)} placements for a mesh of {len(self.mesh.shape)} dims")
        for p in self.placements:
            if not isinstance(p, Replicate) and not 0 <= p.dim < len(shape):
                raise ValueError(f"placement {placement_name(p)} of a tensor of {len(shape)} dims")
        split_order(self.placements, self.mesh.shape, len(shape))  # LayoutError (a ValueError) if it cannot

    def _written(self) -> list[int]:
        """Mesh dims whose coordinate varies among the copies written (the others are 0: Replicate)."""
        return [m for m, p in enumerate(self.placements) if not isinstance(p, Replicate)]

    def overlapping(self, shape: Sequence[int], box: Region) -> Iterator[tuple[int, Region]]:
        """``(rank, chunk)`` of every stored chunk that meets ``box`` (a non-empty box of the tensor).

        Walks the splits in the order they apply and keeps, at each, only the pieces that meet the
        box along the split dim: the work is the number of chunks found, not the mesh's size.
        """
        ndim = len(shape)
        order = split_order(self.placements, self.mesh.shape, ndim)
        coordinate = [0] * len(self.mesh.shape)

        def walk(level: int, offsets: list[int], sizes: list[int]):
            if level == len(order):
                if math.prod(sizes):
                    yield self.mesh.rank(coordinate), Region(tuple(offsets), tuple(sizes))
                return
            mesh_dim = order[level]
            d = self.placements[mesh_dim].dim
            parts, start, length = self.mesh.shape[mesh_dim], offsets[d], sizes[d]
            piece = -(-length // parts)
            if piece == 0:
                return  # an empty extent: no chunk holds anything
            lo, hi = box.offsets[d] - start, box.offsets[d] + box.shape[d] - start
            for index in range(max(0, lo // piece), min(parts - 1, (hi - 1) // piece) + 1):
                begin, size = chunk_extent(length, parts, index)
                if size == 0:
                    continue
                coordinate[mesh_dim] = index
                yield from walk(
                    level + 1,
                    offsets[:d] + [start + begin] + offsets[d + 1 :],
                    sizes[:d] + [size] + sizes[d + 1 :],
                )
            coordinate[mesh_dim] = 0

        return walk(0, [0] * ndim, list(shape))

    def chunks(self, shape: Sequence[int]) -> Iterator[tuple[int, Region]]:
        """``(rank, chunk)`` of every stored chunk (as many as the mesh has writing ranks)."""
        return self.overlapping(shape, Region.whole(shape))

    def chunk_of(self, shape: Sequence[int], rank: int) -> Region | None:
        """The chunk ``rank``'s file holds, None if it holds none."""
        coordinate = self.mesh.coordinate(rank)
        if coordinate is None or any(coordinate[m] for m, p in enumerate(self.placements) if isinstance(p, Replicate)):
            return None
        region = shard_region(tuple(shape), self.mesh.shape, coordinate, self.placements)
        return region if region.numel else None


def rule_from_json(mesh: MeshRanks, placements, key: str) -> ChunkRule:
    if not isinstance(placements, list):
        raise ValueError(f"placements of {key!r} are not a list")
    return ChunkRule(mesh, tuple(placement_from_name(p) for p in placements))


def check_rule(key: str, rule: ChunkRule, shape: Sequence[int], world_size: int) -> None:
    """``CheckpointError`` unless ``rule`` describes ``key``'s chunks on ``world_size`` ranks."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise CheckpointError(f"the manifest's world size {world_size} is not between 1 and {MAX_WORLD_SIZE}")
    try:
        rule.check(shape, world_size)
    except ValueError as e:
        raise CheckpointError(f"the layout of {key!r} is malformed ({e}); the manifest is damaged") from None
