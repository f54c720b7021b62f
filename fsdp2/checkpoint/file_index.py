"""The index a format-3 rank file carries in its own safetensors header.

What only the readers of one file need lives in that file, so a rank reads it only for the files
it reads: where each chunk sits in its tensor, how its bytes are cut into blocks and the CRC32C of
every block, the save it belongs to, and the rank's own ``rank_extra``. The header's
``__metadata__`` (a map of strings, as safetensors requires) holds two entries, first in the
header::

    {"__metadata__":{"fsdp2.header_crc32c":"89abcdef","fsdp2.index":"<JSON text>"}, "model/w": {...}, ...}

``fsdp2.index`` is JSON text::

    {"save_id": "0f1e2d3c4b5a6978",                   # the manifest's: this file belongs to that save
     "chunks": {"model/w": {"offsets": [4, 0],         # where the stored tensor "model/w" sits in
                            "block_elems": 32768,      # the global one, its blocks (integrity.BlockGrid)
                            "crc32c": "0123abcd..."}}, # and their CRC32Cs, 8 hex digits each
     "rank_extra": {...}}                              # this rank's rank_extra (JSON, tensor references)

Every tensor of the file has an entry, and every entry a tensor. ``fsdp2.header_crc32c`` is the
CRC32C of the whole header -- the 8-byte length, the JSON and its padding -- computed with its own
8 digits read as ``00000000``. So the header checks itself, and nothing outside the file lists
it: a writer fills the checksums in once the data is written (same length, the header is rewritten
in place), a reader checks them before trusting any of it.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointError
from .format import MAX_OBJECT_DEPTH, check_depth
from .integrity import BlockGrid, checksum, hex_count
from .safetensors_io import SafetensorsHeader

CRC_KEY = "fsdp2.header_crc32c"
INDEX_KEY = "fsdp2.index"
# A sealed header starts with these bytes after its 8-byte length; the 8 hex digits follow.
HEADER_PREFIX = ('{"__metadata__":{"' + CRC_KEY + '":"').encode()
_CRC_AT = 8 + len(HEADER_PREFIX)
_PLACEHOLDER = "0" * 8
SAVE_ID_DIGITS = 16


@dataclass(frozen=True)
class ChunkRecord:
    """One stored tensor of a rank file: its place in the global tensor and its block checksums."""

    offsets: tuple[int, ...]
    block_elems: int
    crc32c: str  # 8 hex digits per block
    grid: BlockGrid | None = field(default=None, compare=False)  # built when the index was checked

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "block_elems": self.block_elems, "crc32c": self.crc32c}


@dataclass
class FileIndex:
    save_id: str
    chunks: dict[str, ChunkRecord]
    rank_extra: Any = None

    def metadata(self) -> dict[str, str]:
        """The header's ``__metadata__``, its checksum still a placeholder (see :func:`seal`)."""
        index: dict = {"save_id": self.save_id, "chunks": {k: c.to_json() for k, c in self.chunks.items()}}
        if self.rank_extra is not None:
            index["rank_extra"] = self.rank_extra
        return {CRC_KEY: _PLACEHOLDER, INDEX_KEY: json.dumps(index, separators=(",", ":"))}

    @classmethod
    def of_header(cls, header: SafetensorsHeader) -> "FileIndex":
        """The index of a parsed (and safetensors-validated) header, checked against its tensors."""
        where = header.path

        def bad(why: str) -> CheckpointError:
            return CheckpointError(
                f"{where}: the fsdp2 index in its header is malformed ({why}); the file is damaged or was "
                "not written for this checkpoint: restore it or load an earlier checkpoint"
            )

        _require_index(header)
        text = header.metadata[INDEX_KEY]
        try:
            d = json.loads(text, object_pairs_hook=_unique, parse_constant=_no_constant)
            if not isinstance(d, dict) or not isinstance(d.get("chunks"), dict):
                raise ValueError("no 'chunks' object")
            save_id = d.get("save_id")
            if not isinstance(save_id, str):
                raise ValueError("no 'save_id' string")
            chunks = {key: _record(key, value, header) for key, value in d["chunks"].items()}
            rank_extra = d.get("rank_extra")
            check_depth(rank_extra, MAX_OBJECT_DEPTH)
        except RecursionError:
            raise bad("nested too deeply") from None
        except (ValueError, KeyError, TypeError, OverflowError) as e:
            raise bad(str(e)) from None
        unlisted = sorted(set(header.tensors) - set(chunks))
        if unlisted:
            raise bad(f"tensor {unlisted[0]!r} of the file has no entry")
        return cls(save_id, chunks, rank_extra)


def chunk_record(
    index: FileIndex, full: str, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]
) -> ChunkRecord:
    """The index entry of the chunk of ``key`` the manifest's layout puts at ``offsets`` in the file
    ``full``, or a ``CheckpointError`` saying what the file holds instead."""
    record = index.chunks.get(key)
    if record is None:
        raise CheckpointError(
            f"{full}, key {key!r}: missing from the file, where the manifest's layout puts chunk "
            f"{list(offsets)}+{list(shape)}; the checkpoint is damaged, load an earlier one"
        )
    if record.offsets != offsets:
        raise CheckpointError(
            f"{full}, key {key!r}: the file holds the chunk at {list(record.offsets)}, the manifest's "
            f"layout puts it at {list(offsets)}; the checkpoint is damaged, load an earlier one"
        )
    return record


def _require_index(header: SafetensorsHeader) -> None:
    if INDEX_KEY not in header.metadata or CRC_KEY not in header.metadata:
        raise CheckpointError(
            f"{header.path} has no fsdp2 index in its header, so it is not a rank file of a format-3 checkpoint; "
            "restore the file or load an earlier checkpoint"
        )


def _record(key: str, value, header: SafetensorsHeader) -> ChunkRecord:
    info = header.tensors.get(key)
    if info is None:
        raise ValueError(f"entry {key!r} names no tensor of the file")
    if not isinstance(value, dict):
        raise ValueError(f"entry {key!r} is not an object")
    offsets, block, crc = value["offsets"], value["block_elems"], value["crc32c"]
    if not isinstance(offsets, list) or len(offsets) != len(info.shape) or any(_not_count(o) for o in offsets):
        raise ValueError(f"offsets of {key!r} are not {len(info.shape)} non-negative integers")
    if _not_count(block) or block < 1:
        raise ValueError(f"block_elems of {key!r} is not a positive integer")
    if not isinstance(crc, str) or crc.strip("0123456789abcdefABCDEF"):
        raise ValueError(f"crc32c of {key!r} is not a string of hex digits")
    dtype = info.dtype
    if dtype is None:
        raise ValueError(f"{key!r} has dtype {info.dtype_name}, which this torch cannot hold")
    if 0 in info.shape:  # an empty rank_extra tensor: stored for its shape and dtype, no blocks
        if crc:
            raise ValueError(f"{key!r} is empty but lists block checksums")
        return ChunkRecord(tuple(offsets), block, crc)
    grid = BlockGrid.of(tuple(offsets), info.shape, dtype.itemsize, block)  # ValueError if blocks do not fit rows
    if len(crc) % 8 or hex_count(crc) != grid.count:
        raise ValueError(f"{key!r} lists {len(crc) / 8:g} block checksums, its shape needs {grid.count}")
    return ChunkRecord(tuple(offsets), block, crc, grid)


def _not_count(value) -> bool:
    return type(value) is not int or value < 0


def _unique(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _zeroed_checksum(raw: bytes) -> int:
    """CRC32C of ``raw`` with the 8 digits of its own checksum read as zeros (one hash call)."""
    return checksum(raw[:_CRC_AT] + _PLACEHOLDER.encode() + raw[_CRC_AT + 8 :])


def seal(raw: bytes) -> bytes:
    """``raw`` (a header whose metadata came from :meth:`FileIndex.metadata`) with its checksum filled in."""
    if raw[8:_CRC_AT] != HEADER_PREFIX:
        raise ValueError("the header does not start with the fsdp2 header checksum")
    return raw[:_CRC_AT] + f"{_zeroed_checksum(raw):08x}".encode() + raw[_CRC_AT + 8 :]


def check_seal(header: SafetensorsHeader) -> None:
    """``CheckpointError`` naming the file unless its header's checksum matches its bytes."""
    _require_index(header)
    raw = header.raw
    stored = raw[_CRC_AT : _CRC_AT + 8]
    if raw[8:_CRC_AT] != HEADER_PREFIX or raw[_CRC_AT + 8 : _CRC_AT + 9] != b'"':
        raise CheckpointError(
            f"{header.path} is corrupted (its header does not start with the fsdp2 header checksum); restore "
            "the file or load an earlier checkpoint"
        )
    crc = f"{_zeroed_checksum(raw):08x}"
    if stored.decode("ascii", "replace") != crc:
        raise CheckpointError(
            f"{header.path} is corrupted (crc32c of its header {crc}, the header says "
            f"{stored.decode('ascii', 'replace')}); restore the file or load an earlier checkpoint"
        )


def new_save_id() -> int:
    """A random number naming one save (rank 0 draws it, every rank writes it; 63 bits: an int64)."""
    return secrets.randbits(63)


def save_id_text(value: int) -> str:
    return f"{value:0{SAVE_ID_DIGITS}x}"
