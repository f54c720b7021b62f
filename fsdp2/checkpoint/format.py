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

from fsdp2.layout.regions import Region

from .errors import CheckpointError

FORMAT_NAME = "fsdp2-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_OBJECT_DEPTH = 128  # nesting of "objects"; deeper would exhaust Python's recursion limit


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


# ---------------------------------------------------------------- tiling


def check_tiling(key: str, shape: Sequence[int], regions: Sequence[Region]) -> None:
    """Raise unless ``regions`` cover ``shape`` exactly: in bounds, disjoint, no gaps."""
    whole = Region.whole(shape)
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
        return cls(str(d["file"]), str(d["key"]), _sizes(d["offsets"]), _sizes(d["shape"]))


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
        return cls(_sizes(d["shape"]), str(d["dtype"]), [Chunk.from_json(c) for c in d["chunks"]])


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
                generation=_count(d["generation"]),
                world_size=_count(d["world_size"]),
                files={k: FileEntry(_count(v["size"]), str(v["crc32"])) for k, v in d["files"].items()},
                tensors={k: TensorEntry.from_json(v) for k, v in d["tensors"].items()},
                objects=_objects(d.get("objects", {})),
            )
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
            raise CheckpointError(f"{where} is malformed ({type(e).__name__}: {e})") from e
        except RecursionError:
            raise CheckpointError(f"{where} is malformed (nested too deeply)") from None

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


def _count(value) -> int:
    """A manifest number that must be a non-negative integer (not 1.5, 1e400, true or "3")."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _sizes(values) -> tuple[int, ...]:
    if not isinstance(values, list):
        raise ValueError(f"{values!r} is not a list of sizes")
    return tuple(_count(v) for v in values)


def _objects(objects) -> dict:
    """The manifest's "objects", after checking it is a dict nested at most MAX_OBJECT_DEPTH deep."""
    if not isinstance(objects, dict):
        raise ValueError(f"objects is a {type(objects).__name__}, not a dict")
    level, depth = [objects], 0
    while level:
        depth += 1
        if depth > MAX_OBJECT_DEPTH:
            raise ValueError(f"objects are nested deeper than {MAX_OBJECT_DEPTH} levels")
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)
                 if isinstance(c, (dict, list))]
    return objects
