"""On-disk layout of a checkpoint, described in plain JSON.

A checkpoint is a directory::

    PATH/
      manifest.json                 # the commit point: present <=> a complete checkpoint
      gen-000003/                   # data of the generation the manifest names
        rank-00000.safetensors      # local shards written by rank 0
        rank-00001.safetensors
        ...

``manifest.json`` (format version 1)::

    {
      "format": "fsdp2-checkpoint", "version": 1, "generation": 3,
      "world_size": 4,                          # of the saving job (informational)
      "files": {"gen-000003/rank-00000.safetensors": {"size": 123, "crc32": "89abcdef"}},
      "tensors": {
        "model/fc.weight": {
          "shape": [7, 16], "dtype": "float32",
          "chunks": [{"file": "gen-000003/rank-00000.safetensors",
                      "key": "model/fc.weight", "offsets": [0, 0], "shape": [2, 16]}, ...]
        }, ...
      },
      "objects": {"optimizer": {...}, "extra": {...}}   # JSON; tensors as {"__tensor__": key}
    }

Nothing here is ever unpickled: the manifest is JSON and tensor bytes are read with
safetensors, so opening an untrusted checkpoint cannot run code.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from .errors import CheckpointError

FORMAT_NAME = "fsdp2-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


def generation_dir(generation: int) -> str:
    return f"gen-{generation:06d}"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


# torch dtype <-> (manifest name, safetensors header name). Only dtypes safetensors knows.
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _st in [("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                   ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")]:
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _st
_BY_NAME = {str(dt).removeprefix("torch."): dt for dt in _DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPES:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors; cast the tensor first")
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r} in manifest") from None


def safetensors_dtype(dtype: torch.dtype) -> str:
    dtype_name(dtype)  # raises for unsupported dtypes
    return _DTYPES[dtype]


# ---------------------------------------------------------------- regions


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

    def slices_within(self, outer: "Region") -> tuple[slice, ...]:
        """Index of this region inside a tensor holding ``outer``."""
        return tuple(slice(o - oo, o - oo + n) for o, n, oo in zip(self.offsets, self.shape, outer.offsets))


def shard_region(global_shape: Sequence[int], mesh_shape: Sequence[int],
                 coordinate: Sequence[int], placements: Sequence) -> Region:
    """The global box a DTensor's local shard covers, from metadata alone.

    Equivalent of DTensor's own sharding rule: each ``Shard(d)`` mesh dim splits the
    current extent of tensor dim ``d`` into ``ceil(n / mesh_size)``-sized pieces (the
    last ones may be short or empty); ``Replicate()`` leaves it whole. Mesh dims are
    applied in order, so ``(Shard(0), Shard(0))`` nests.
    """
    from torch.distributed.tensor import Replicate, Shard

    offsets = [0] * len(global_shape)
    shape = list(global_shape)
    for mesh_dim in _split_order(placements, mesh_shape, len(global_shape)):
        d = placements[mesh_dim].dim % len(global_shape)
        size, parts, index = shape[d], mesh_shape[mesh_dim], coordinate[mesh_dim]
        piece = -(-size // parts)
        start = min(index * piece, size)
        stop = min(start + piece, size)
        offsets[d] += start
        shape[d] = stop - start
    return Region(tuple(offsets), tuple(shape))


def _split_order(placements: Sequence, mesh_shape: Sequence[int], ndim: int) -> list[int]:
    """Mesh dims in the order their splits apply.

    ``Shard`` dims split in mesh order. ``_StridedShard(d, split_factor=f)`` (fully_shard on a
    tensor that tensor parallelism already split along ``d``) splits *after* the later
    ``Shard(d)`` dims whose sizes multiply to ``f``: TP cuts first, FSDP cuts each TP piece,
    so every rank still holds one box.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    order: list[int] = []
    deferred: list[int] = []
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, _StridedShard):
            d = placement.dim % ndim
            later = [
                m for m in range(mesh_dim + 1, len(placements))
                if type(placements[m]) is Shard and placements[m].dim % ndim == d
            ]
            if math.prod(mesh_shape[m] for m in later) != placement.split_factor:
                raise CheckpointError(
                    f"placement {placement!r} is not supported by fsdp2.checkpoint: its split factor does not "
                    "match the later Shard dims on the same tensor dim; redistribute the tensor first")
            deferred.append(mesh_dim)
            continue
        if type(placement) is not Shard:
            raise CheckpointError(
                f"placement {placement!r} is not supported by fsdp2.checkpoint "
                "(only Shard(d), Replicate() and fully_shard's _StridedShard); redistribute the tensor first")
        order.append(mesh_dim)
    return order + deferred


def check_tiling(key: str, shape: Sequence[int], regions: Sequence[Region]) -> None:
    """Raise unless ``regions`` cover ``shape`` exactly: in bounds, disjoint, no gaps."""
    whole = Region(tuple(0 for _ in shape), tuple(shape))
    for r in regions:
        if len(r.shape) != len(shape) or r.numel == 0 or r.intersect(whole) != r:
            raise CheckpointError(f"chunk {r} of {key!r} lies outside its tensor of shape {list(shape)}")
    # Disjoint + total volume equal => exact cover. Chunks are few (<= ranks), O(n^2) is fine.
    for i, a in enumerate(regions):
        for b in regions[i + 1:]:
            if a.intersect(b) is not None:
                raise CheckpointError(f"chunks {a} and {b} of {key!r} overlap")
    covered = sum(r.numel for r in regions)
    if covered != whole.numel:
        raise CheckpointError(f"chunks of {key!r} cover {covered} of {whole.numel} elements (gap)")


# ---------------------------------------------------------------- manifest


@dataclass
class Chunk:
    """One stored piece of a tensor: where it is in the tensor and where in the files."""

    file: str
    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def region(self) -> Region:
        return Region(self.offsets, self.shape)

    def to_json(self) -> dict:
        return {"file": self.file, "key": self.key, "offsets": list(self.offsets), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, d: dict) -> "Chunk":
        return cls(d["file"], d["key"], tuple(d["offsets"]), tuple(d["shape"]))


@dataclass
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "chunks": [c.to_json() for c in self.chunks]}

    @classmethod
    def from_json(cls, d: dict) -> "TensorEntry":
        return cls(tuple(d["shape"]), d["dtype"], [Chunk.from_json(c) for c in d["chunks"]])


@dataclass
class FileEntry:
    size: int
    crc32: str  # 8 lowercase hex digits; zlib.crc32 runs at several GB/s, sha256 at ~1.5

    def to_json(self) -> dict:
        return {"size": self.size, "crc32": self.crc32}


@dataclass
class Manifest:
    generation: int
    world_size: int
    files: dict[str, FileEntry]
    tensors: dict[str, TensorEntry]
    objects: dict

    def to_json(self) -> str:
        # One line per file and per tensor: readable with less/grep, still plain JSON.
        def block(items: dict) -> str:
            rows = [f"  {json.dumps(k)}: {json.dumps(v.to_json(), separators=(',', ':'))}"
                    for k, v in sorted(items.items())]
            return "{\n" + ",\n".join(rows) + "\n }" if rows else "{}"

        head = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "generation": self.generation,
                "world_size": self.world_size}
        return ("{\n" + "".join(f" {json.dumps(k)}: {json.dumps(v)},\n" for k, v in head.items())
                + f' "files": {block(self.files)},\n'
                + f' "tensors": {block(self.tensors)},\n'
                + f' "objects": {json.dumps(self.objects)}\n}}\n')

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> "Manifest":
        try:
            d = json.loads(text)
            if d.get("format") != FORMAT_NAME:
                raise CheckpointError(f"{where} is not an fsdp2 checkpoint manifest")
            if d.get("version") != FORMAT_VERSION:
                raise CheckpointError(
                    f"{where} has format version {d.get('version')}; this fsdp2 reads version "
                    f"{FORMAT_VERSION}: upgrade fsdp2 to load it")
            return cls(
                generation=int(d["generation"]),
                world_size=int(d["world_size"]),
                files={k: FileEntry(int(v["size"]), str(v["crc32"])) for k, v in d["files"].items()},
                tensors={k: TensorEntry.from_json(v) for k, v in d["tensors"].items()},
                objects=d.get("objects", {}),
            )
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{where} is malformed ({type(e).__name__}: {e})") from e

    def validate_files(self) -> None:
        for name in self.files:
            # An untrusted manifest must not make us read outside the checkpoint directory.
            parts = name.replace("\\", "/").split("/")
            if name.startswith(("/", "\\")) or ".." in parts or ":" in name:
                raise CheckpointError(f"manifest lists file {name!r} outside the checkpoint directory")

    def validate(self, keys: Iterable[str] | None = None) -> None:
        """Check file names, that every chunk names a listed file and chunks tile their tensor."""
        self.validate_files()
        for key in self.tensors if keys is None else keys:
            entry = self.tensors[key]
            dtype_from_name(entry.dtype)
            for c in entry.chunks:
                if c.file not in self.files:
                    raise CheckpointError(f"chunk of {key!r} refers to unlisted file {c.file!r}")
            check_tiling(key, entry.shape, [c.region for c in entry.chunks])
