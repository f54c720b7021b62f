"""On-disk layout of a checkpoint, described in plain JSON.

A checkpoint is a directory::

    PATH/
      manifest.json                 # the commit point: present <=> a complete checkpoint
      gen-000003/                   # data of the generation the manifest names
        rank-00000.safetensors      # local shards written by rank 0
        rank-00001.safetensors
        ...

``manifest.json`` (format version 3) says what the checkpoint holds and by which rule each
tensor's chunks are spread over the rank files, never chunk by chunk, so it is as long for 16,384
ranks as for 2::

    {
      "format": "fsdp2-checkpoint", "version": 3, "generation": 3,
      "world_size": 4,                          # rank files gen-000003/rank-00000 .. 00003.safetensors
      "hash": "crc32c",
      "save_id": "0f1e2d3c4b5a6978",            # every rank file of this save carries it
      "rank_extra": false,                      # whether rank files hold per-rank extras
      "meshes": [{"shape": [], "start": 0, "strides": []},      # rank 0 alone: plain tensors
                 {"shape": [2, 2], "start": 0, "strides": [2, 1]}],
      "tensors": {
        "model/fc.weight": {"shape": [7, 16], "dtype": "float32", "mesh": 1, "placements": ["R", "S(0)"]},
        "optim/state/fc.weight/step": {"shape": [], "dtype": "float32", "mesh": 0, "placements": []},
        ...
      },
      "objects": {"optimizer": {...}, "extra": {...}}   # JSON; tensors as {"__tensor__": key}
    }

``chunk_rule.py`` turns a mesh and placements into the chunks (which rank's file holds which box
of the tensor); each rank file's header lists its own chunks' offsets and block checksums
(``file_index.py``), so a loading rank reads the manifest and the headers of the files it reads,
nothing else.

Integrity: the bytes of each chunk are cut into blocks (``integrity.BlockGrid``) and the file's
index lists the CRC32C of every block (8 hex digits each, concatenated); the header carries the
CRC32C of itself. A loading rank reads the blocks holding the bytes it owns and checks exactly
those, in the same pass as it reads them.

The trade-off is the block size. A rank that owns part of a block must read all of it to check
it, so with verification on, bytes read exceed bytes owned by less than one block at each end
of a needed row range; smaller blocks mean less excess but a longer index and more hashing
calls. Blocks are a power of two of whole dim-0 rows with edges at multiples of that count in
*global* row indices (rows larger than a block are cut into pieces), sized per chunk: about 16
blocks per chunk, between 64 KiB and 1 MiB (larger only for chunks over 4 GiB, which get at most
4096). Each block is a hash call on every verified read, and Python work around it: checkpoints
written by earlier versions have 4-16 KiB to 128 KiB blocks, about 64 per chunk, and take ~10%
longer to verify (benchmarks/RESULTS.md); readers take any block size a file or manifest lists.
Consequences:

- a load on the saving layout, and any reshard whose dim-0 splits fall on multiples of the
  block (power-of-two world sizes dividing power-of-two-friendly row counts), reads exactly
  the owned bytes (ratio 1.00);
- other dim-0 reshards read at most one block more per edge (measured for a 125M GPT + AdamW
  saved on 2 ranks: 1.007 loaded on 3, 1.013 on its worst rank; 1.001 with the earlier smaller
  blocks; see benchmarks/RESULTS.md);
- a rank owning a column range of row-major chunks (tensor parallelism splitting dim 1 of a
  checkpoint saved without it) reads and checks whole rows;
- ``verify=False`` reads exactly the owned bytes (column ranges as one read per row run).

Earlier versions, still loaded and verified: version 2 lists every chunk in the manifest
(``"tensors": {key: {"shape", "dtype", "chunks": [{"file", "key", "offsets", "shape",
"block_elems", "crc32c"}]}}``) and every file (``"files": {name: {"size", "header_crc32c"}}``);
version 1 is version 2 without block checksums, its files carrying ``"crc32"`` (zlib CRC-32 of the
whole file), so verifying reads every byte of every file a rank touches.

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

from .chunk_rule import MAX_WORLD_SIZE, ChunkRule, MeshRanks, check_rule, rule_from_json
from .errors import CheckpointError
from .integrity import HASH_NAME, BlockGrid, from_hex, hex_count

FORMAT_NAME = "fsdp2-checkpoint"
FORMAT_VERSION = 3  # written; 1 (per-file CRC-32) and 2 (chunks listed in the manifest) are still read
READABLE_VERSIONS = (1, 2, 3)
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
for _name, _st in [
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
]:
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


_BY_SAFETENSORS = {st: dt for dt, st in _DTYPES.items()}


def dtype_from_safetensors(name: str) -> torch.dtype | None:
    """The torch dtype of a safetensors header dtype name, or None if torch lacks it."""
    return _BY_SAFETENSORS.get(name)


# ---------------------------------------------------------------- tiling


def check_tiling(key: str, shape: Sequence[int], regions: Sequence[Region]) -> None:
    """Raise unless ``regions`` cover ``shape`` exactly: in bounds, disjoint, no gaps."""
    whole = Region.whole(shape)
    for r in regions:
        if len(r.shape) != len(shape) or r.numel == 0 or r.intersect(whole) != r:
            raise CheckpointError(f"chunk {r} of {key!r} lies outside its tensor of shape {list(shape)}")
    # Disjoint + total volume equal => exact cover. A tensor has a chunk per saving rank: compare
    # each chunk only with those that start before it ends along dim 0 (sorted by that start), so
    # dim-0 splits cost n log n, not the n^2 pairs (0.8 s per tensor at 1024 ranks).
    ordered = sorted(regions, key=lambda r: r.offsets[:1])
    for i, a in enumerate(ordered):
        end = a.offsets[0] + a.shape[0] if a.shape else None
        for b in ordered[i + 1 :]:
            if end is not None and b.offsets[0] >= end:
                break
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
    # Version 2: the block size and the CRC32C of every block, as concatenated hex.
    block_elems: int | None = None
    crc32c: str | None = None
    # Decoded once per manifest read (validation decodes, the reader reuses): see grid, checksums.
    _grid: BlockGrid | None = field(default=None, init=False, repr=False, compare=False)
    _checksums: list[int] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def region(self) -> Region:
        return Region(self.offsets, self.shape)

    def grid(self, itemsize: int) -> BlockGrid | None:
        """How this chunk's bytes are cut into checksummed blocks (None: version 1, no checksums)."""
        if self.block_elems is None:
            return None
        grid = self._grid
        if grid is None or grid.itemsize != itemsize:
            grid = self._grid = BlockGrid.of(self.offsets, self.shape, itemsize, self.block_elems)
        return grid

    def with_checksums(self, block_elems: int, crc32c: str, grid: BlockGrid | None = None) -> "Chunk":
        """This chunk with its block size and checksums (format 3: from its file's index, whose check
        built ``grid`` already)."""
        chunk = Chunk(self.file, self.key, self.offsets, self.shape, block_elems, crc32c)
        chunk._grid = grid
        return chunk

    def checksums(self) -> list[int] | None:
        """The block checksums (a list the caller must not change)."""
        if self._checksums is None and self.crc32c is not None:
            self._checksums = from_hex(self.crc32c)
        return self._checksums

    def to_json(self) -> dict:
        d = {"file": self.file, "key": self.key, "offsets": list(self.offsets), "shape": list(self.shape)}
        if self.block_elems is not None:
            d.update(block_elems=self.block_elems, crc32c=self.crc32c)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Chunk":
        block = d.get("block_elems")
        crc = d.get("crc32c")
        return cls(
            str(d["file"]),
            str(d["key"]),
            _sizes(d["offsets"]),
            _sizes(d["shape"]),
            None if block is None else _count(block),
            None if crc is None else _hex(crc),
        )


@dataclass
class TensorEntry:
    """A saved tensor: its shape and dtype, and where its chunks are: by ``rule`` (format 3) or
    listed in ``chunks`` (formats 1 and 2)."""

    shape: tuple[int, ...]
    dtype: str
    chunks: list[Chunk] = field(default_factory=list)
    rule: ChunkRule | None = None

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
    crc32: str | None = None  # version 1: zlib CRC-32 of the whole file (8 hex digits)
    header_crc32c: str | None = None  # version 2: CRC32C of the safetensors header

    def to_json(self) -> dict:
        d: dict = {"size": self.size}
        if self.crc32 is not None:
            d["crc32"] = self.crc32
        if self.header_crc32c is not None:
            d["header_crc32c"] = self.header_crc32c
        return d

    @classmethod
    def from_json(cls, d: dict) -> "FileEntry":
        crc, header = d.get("crc32"), d.get("header_crc32c")
        return cls(_count(d["size"]), None if crc is None else _hex(crc), None if header is None else _hex(header))


def _rows(items: dict) -> str:
    """One line per entry: readable with less/grep, still plain JSON."""
    rows = [f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in sorted(items.items())]
    return "{\n" + ",\n".join(rows) + "\n }" if rows else "{}"


@dataclass
class Manifest:
    generation: int
    world_size: int
    files: dict[str, FileEntry]  # formats 1 and 2; format 3 names its files by rule (file_names)
    tensors: dict[str, TensorEntry]
    objects: dict
    version: int = FORMAT_VERSION
    save_id: str = ""  # format 3: the id every rank file of this save carries
    rank_extra: bool = False  # format 3: rank files hold per-rank extras
    json_bytes: int = field(default=0, compare=False)  # bytes of manifest.json this was read from

    # -- files and chunks, any version ------------------------------------------------------------

    def rank_file(self, rank: int) -> str:
        """Format 3: the file rank ``rank`` wrote, relative to the checkpoint directory."""
        return f"{generation_dir(self.generation)}/{rank_file_name(rank)}"

    def file_names(self) -> list[str]:
        """Every data file of the checkpoint, relative to its directory."""
        if self.version >= 3:
            return [self.rank_file(rank) for rank in range(self.world_size)]
        return list(self.files)

    def chunks_in(self, key: str, region: Region) -> list[Chunk]:
        """The stored chunks of ``key`` that meet ``region`` (a non-empty box). Format 3's come
        without block checksums: those are in each file's own index (``file_index.py``)."""
        entry = self.tensors[key]
        if entry.rule is None:
            return [c for c in entry.chunks if c.region.intersect(region) is not None]
        return [
            Chunk(self.rank_file(rank), key, box.offsets, box.shape)
            for rank, box in entry.rule.overlapping(entry.shape, region)
        ]

    def chunks_of(self, key: str) -> list[Chunk]:
        """Every stored chunk of ``key`` (for format 3, computed: one per writing rank)."""
        entry = self.tensors[key]
        return self.chunks_in(key, Region.whole(entry.shape)) if math.prod(entry.shape) else []

    # -- JSON ---------------------------------------------------------------------------------------

    def to_json(self) -> str:
        head = {
            "format": FORMAT_NAME,
            "version": self.version,
            "generation": self.generation,
            "world_size": self.world_size,
        }
        if self.version >= 2:
            head["hash"] = HASH_NAME
        if self.version >= 3:
            head.update(save_id=self.save_id, rank_extra=self.rank_extra)
            meshes: dict[str, int] = {}  # a mesh's JSON -> its index: tensors sharing a mesh share one entry
            tensors = {}
            for key, entry in self.tensors.items():
                mesh = json.dumps(entry.rule.mesh.to_json(), separators=(",", ":"))
                tensors[key] = {
                    "shape": list(entry.shape),
                    "dtype": entry.dtype,
                    "mesh": meshes.setdefault(mesh, len(meshes)),
                    "placements": entry.rule.placement_names(),
                }
            body = (
                ' "meshes": [\n' + ",\n".join(f"  {m}" for m in meshes) + "\n ],\n" if meshes else ' "meshes": [],\n'
            ) + f' "tensors": {_rows(tensors)},\n'
        else:
            body = (
                f' "files": {_rows({k: v.to_json() for k, v in self.files.items()})},\n'
                f' "tensors": {_rows({k: v.to_json() for k, v in self.tensors.items()})},\n'
            )
        return (
            "{\n"
            + "".join(f" {json.dumps(k)}: {json.dumps(v)},\n" for k, v in head.items())
            + body
            + f' "objects": {json.dumps(self.objects)}\n}}\n'
        )

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> "Manifest":
        try:
            d = json.loads(text)
            if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
                raise CheckpointError(f"{where} is not an fsdp2 checkpoint manifest")
            version = d.get("version")
            if version not in READABLE_VERSIONS:
                raise CheckpointError(
                    f"{where} has format version {version}; this fsdp2 reads versions "
                    f"{', '.join(map(str, READABLE_VERSIONS))}: upgrade fsdp2 to load it"
                )
            if version >= 2 and d.get("hash") != HASH_NAME:
                raise CheckpointError(f"{where} uses checksum {d.get('hash')!r}; this fsdp2 knows {HASH_NAME!r}")
            common = dict(
                generation=_count(d["generation"]),
                world_size=_count(d["world_size"]),
                objects=_objects(d.get("objects", {})),
                version=int(version),
            )
            if version >= 3:
                return cls(
                    files={}, tensors=_rule_tensors(d), save_id=_save_id(d["save_id"]), rank_extra=_flag(d), **common
                )
            return cls(
                files={k: FileEntry.from_json(v) for k, v in d["files"].items()},
                tensors={k: TensorEntry.from_json(v) for k, v in d["tensors"].items()},
                **common,
            )
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
            raise CheckpointError(f"{where} is malformed ({type(e).__name__}: {e})") from e
        except RecursionError:
            raise CheckpointError(f"{where} is malformed (nested too deeply)") from None

    # -- validation ---------------------------------------------------------------------------------

    def validate_files(self) -> None:
        """Formats 1 and 2: every listed file inside the directory, with its checksum. Format 3
        names its files itself (``gen-NNNNNN/rank-NNNNN.safetensors``), from integers."""
        if self.version >= 3:
            if not 1 <= self.world_size <= MAX_WORLD_SIZE:
                raise CheckpointError(
                    f"the manifest's world size {self.world_size} is not between 1 and {MAX_WORLD_SIZE}; "
                    "the manifest is damaged"
                )
            return
        for name, entry in self.files.items():
            # An untrusted manifest must not make us read outside the checkpoint directory.
            parts = name.replace("\\", "/").split("/")
            if name.startswith(("/", "\\")) or ".." in parts or ":" in name:
                raise CheckpointError(f"manifest lists file {name!r} outside the checkpoint directory")
            integrity = entry.crc32 if self.version == 1 else entry.header_crc32c
            if integrity is None:
                field = "crc32" if self.version == 1 else "header_crc32c"
                raise CheckpointError(
                    f"manifest entry of {name!r} lacks its {field!r} checksum; re-save the checkpoint"
                )

    def validate(self, keys: Iterable[str] | None = None) -> None:
        """Check file names and how chunks cover each tensor (:meth:`validate_entry`)."""
        self.validate_files()
        for key in self.tensors if keys is None else keys:
            self.validate_entry(key)

    def validate_entry(self, key: str) -> None:
        """Format 3: the tensor's rule describes it on this world; formats 1 and 2: every chunk
        names a listed file and the chunks tile the tensor. (File names: :meth:`validate_files`.)"""
        entry = self.tensors[key]
        dtype_from_name(entry.dtype)
        if entry.rule is not None:
            check_rule(key, entry.rule, entry.shape, self.world_size)
            return
        for c in entry.chunks:
            if c.file not in self.files:
                raise CheckpointError(f"chunk of {key!r} refers to unlisted file {c.file!r}")
            if self.version >= 2:
                _check_chunk_checksums(key, entry, c)
        check_tiling(key, entry.shape, [c.region for c in entry.chunks])


def _rule_tensors(d: dict) -> dict[str, TensorEntry]:
    """Format 3's tensors, each with its rule (meshes shared through the "meshes" table)."""
    meshes = d["meshes"]
    if not isinstance(meshes, list):
        raise ValueError("meshes is not a list")
    meshes = [MeshRanks.from_json(m) for m in meshes]
    tensors = {}
    for key, t in d["tensors"].items():
        mesh = t["mesh"]
        if type(mesh) is not int or not 0 <= mesh < len(meshes):
            raise ValueError(f"tensor {key!r} names mesh {mesh!r}, not one of the {len(meshes)} listed")
        tensors[key] = TensorEntry(
            _sizes(t["shape"]), str(t["dtype"]), rule=rule_from_json(meshes[mesh], t["placements"], key)
        )
    return tensors


def _save_id(value) -> str:
    if not isinstance(value, str) or not value or value.strip("0123456789abcdef"):
        raise ValueError(f"save_id {value!r} is not a string of hex digits")
    return value


def _flag(d: dict) -> bool:
    value = d.get("rank_extra", False)
    if not isinstance(value, bool):
        raise ValueError(f"rank_extra is {value!r}, not true or false")
    return value


def _count(value) -> int:
    """A manifest number that must be a non-negative integer (not 1.5, 1e400, true or "3")."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _hex(value) -> str:
    """A checksum list: a string of hex digits (not a number, not 'zz')."""
    # strip() leaves a non-hex character and whatever lies between it and the ends: at C speed
    # (a checksum list has 8 digits per block, every load parses them all).
    if not isinstance(value, str) or value.strip("0123456789abcdefABCDEF"):
        raise ValueError(f"{value!r} is not a string of hex digits")
    return value


def _sizes(values) -> tuple[int, ...]:
    if not isinstance(values, list):
        raise ValueError(f"{values!r} is not a list of sizes")
    return tuple(_count(v) for v in values)


def check_depth(value, limit: int) -> None:
    """``ValueError`` if the JSON value ``value`` nests dicts and lists deeper than ``limit``."""
    level, depth = [value] if isinstance(value, (dict, list)) else [], 0
    while level:
        depth += 1
        if depth > limit:
            raise ValueError(f"objects are nested deeper than {limit} levels")
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list))]


def _objects(objects) -> dict:
    """The manifest's "objects", after checking it is a dict nested at most MAX_OBJECT_DEPTH deep."""
    if not isinstance(objects, dict):
        raise ValueError(f"objects is a {type(objects).__name__}, not a dict")
    check_depth(objects, MAX_OBJECT_DEPTH)
    return objects


def _check_chunk_checksums(key: str, entry: TensorEntry, chunk: Chunk) -> None:
    where = f"chunk {list(chunk.offsets)}+{list(chunk.shape)} of {key!r}"
    if chunk.block_elems is None or chunk.crc32c is None:
        raise CheckpointError(f"{where} has no checksums; the manifest is damaged, re-save the checkpoint")
    if len(chunk.shape) != len(entry.shape) or any(n <= 0 for n in chunk.shape):
        return  # check_tiling reports the bad box
    try:
        expected = chunk.grid(entry.torch_dtype.itemsize).count
        chunk.checksums()  # decodes: a bad hex digit raises here
    except ValueError as e:
        raise CheckpointError(f"{where}: bad checksum list ({e}); the manifest is damaged") from None
    if hex_count(chunk.crc32c) != expected:
        raise CheckpointError(
            f"{where} lists {hex_count(chunk.crc32c)} block checksums, its shape needs "
            f"{expected}; the manifest is damaged"
        )
