"""The safetensors layout: streaming writes with per-block checksums, and header parsing.

We write the (simple) safetensors layout ourselves instead of calling
``safetensors.torch.save_file`` so that tensor bytes go straight from the tensor's
memory to the file while the block checksums are computed on the same buffer: no
serialized copy of the whole shard in RAM and no second pass over the file. Readers
parse the header (8-byte length + JSON, never code) to find each tensor's byte range
and read those bytes themselves (``tensor_reader.py``).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .errors import CheckpointError
from .format import dtype_from_safetensors, safetensors_dtype
from .integrity import BlockGrid, checksum

_READ_BLOCK = 16 << 20

if sys.byteorder != "little":  # safetensors stores little-endian; we write raw memory
    raise ImportError("fsdp2.checkpoint needs a little-endian machine")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def tensor_bytes(t: torch.Tensor):
    """A zero-copy byte view (numpy uint8 array) of a contiguous CPU tensor."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def safetensors_header(specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The header of a safetensors file holding ``specs`` end to end: 8-byte length, JSON (with
    ``metadata`` first, as ``__metadata__``), spaces up to a multiple of 8."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": safetensors_dtype(spec.dtype),
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data section to 8 bytes
    return struct.pack("<Q", len(blob)) + blob


class SafetensorsStreamWriter:
    """Write a safetensors file tensor by tensor, in the order of ``specs``.

    The header (names, dtypes, shapes, offsets) is known up front, so tensors can be
    produced one at a time (e.g. assembled from slices) and dropped after writing.
    ``header_crc`` is the CRC32C of the header; ``write`` returns the block checksums.
    Metadata known only once the data is written (checksums) goes in with
    :meth:`rewrite_header`, as long as it has the length of the metadata given first.
    """

    def __init__(self, path: str, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None):
        header = safetensors_header(specs, metadata)
        self._specs = list(specs)
        self._next = 0
        self._hasher: ThreadPoolExecutor | None = None
        self._file = open(path, "wb")
        self.size = 0
        self.header_crc = checksum(header)
        self._header_len = len(header)
        self._write(header)

    def rewrite_header(self, metadata: dict[str, str], finish: Callable[[bytes], bytes] | None = None) -> None:
        """Write the header again, now with ``metadata`` (then passed through ``finish``), over the first one."""
        header = safetensors_header(self._specs, metadata)
        if finish is not None:
            header = finish(header)
        if len(header) != self._header_len:
            raise ValueError(f"the new header has {len(header)} bytes, the one written {self._header_len}")
        self._file.flush()
        os.pwrite(self._file.fileno(), header, 0)
        self.header_crc = checksum(header)

    def _write(self, data) -> None:
        self._file.write(data)
        self.size += len(data)

    def write(self, tensor: torch.Tensor, grid: BlockGrid | None = None) -> list[int]:
        """Append the next tensor; returns the CRC32C of each block of ``grid`` (none if None).

        The checksums are computed on a helper thread while this one writes the same bytes
        (both release the GIL), so hashing adds no time to a save that waits on the disk.
        """
        spec = self._specs[self._next]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(
                f"tensor for {spec.name!r} is {tensor.dtype}{list(tensor.shape)}, "
                f"expected {spec.dtype}{list(spec.shape)}"
            )
        data = tensor_bytes(tensor)
        crcs = None
        if grid is not None:
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp2-ckpt-hash")
            crcs = self._hasher.submit(_block_checksums, data, grid)
        self._write(data)
        self._next += 1
        return [] if crcs is None else crcs.result()

    def close(self, fsync: bool = True) -> None:
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None
        if self._next != len(self._specs):
            self._file.close()
            raise ValueError(f"only {self._next} of {len(self._specs)} tensors were written")
        self._file.flush()
        if fsync:
            os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        """Close the file after a failed write (the caller deletes it)."""
        if not self._file.closed:
            self._file.close()


def _block_checksums(data, grid: BlockGrid) -> list[int]:
    return [checksum(data[lo:hi]) for _, lo, hi in grid.blocks(0, grid.rows)]


def file_crc32(path: str) -> tuple[str, int]:
    """(zlib crc32 as 8 hex digits, bytes read) of a whole file: format version 1's checksum."""
    crc, n = 0, 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_READ_BLOCK)
        view = memoryview(buf)
        while True:
            got = f.readinto(buf)
            if not got:
                break
            crc = zlib.crc32(view[:got], crc)
            n += got
    return f"{crc & 0xFFFFFFFF:08x}", n


# ---------------------------------------------------------------- reading the header

# The rules of the safetensors library (its Rust crate's header parsing), which every header we
# read must pass before any tensor byte is read, whoever wrote the file: otherwise two tensors
# could share bytes, or a shape of 8.7 could be read as 8, and the load would succeed silently.
_MAX_HEADER = 100_000_000  # bytes of JSON, the library's limit
# Bits per element of every dtype the format defines (torch may lack some: those load nowhere,
# but their byte counts still have to add up).
_DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
_USIZE = 1 << 64


def _unique_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:  # json would keep the last one: which tensor is meant is ambiguous
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _count(value, what: str) -> int:
    if type(value) is not int or not 0 <= value < _USIZE:  # bool, 8.0 and 8.7 are not counts
        raise ValueError(f"{what} is {value!r}, not a non-negative integer")
    return value


def parse_header_json(blob: bytes, data_bytes: int) -> tuple[dict[str, tuple[str, tuple[int, ...], int, int]], dict]:
    """Validate a safetensors header (the JSON after the length) for a file with ``data_bytes``
    bytes after it: ({name: (dtype, shape, begin, end)} with offsets relative to the data, metadata).

    Raises ``ValueError`` saying what is wrong. Checks what the safetensors library checks and
    more: UTF-8, one JSON object with no duplicate keys (at any depth), ``__metadata__`` a
    string -> string map, each tensor a known dtype, a shape of non-negative integers and two
    integer data offsets whose length is the shape's bytes, and the tensors' byte ranges laid
    end to end from 0 to exactly ``data_bytes``: no overlap, no gap, nothing after the last.
    """
    parsed = json.loads(blob.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_not_json)
    if not isinstance(parsed, dict):
        raise ValueError("the header is not a JSON object")
    metadata = parsed.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ is not a map of strings to strings")
    tensors = {}
    for name, d in parsed.items():
        if not isinstance(d, dict) or not {"dtype", "shape", "data_offsets"} <= d.keys():
            raise ValueError(f"tensor {name!r} lacks its dtype, shape or data_offsets")
        dtype, shape, offsets = d["dtype"], d["shape"], d["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
            raise ValueError(f"tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
            raise ValueError(f"tensor {name!r}: shape must be a list and data_offsets a list of two integers")
        shape = tuple(_count(n, f"tensor {name!r}: a dimension") for n in shape)
        begin, end = (_count(x, f"tensor {name!r}: a data offset") for x in offsets)
        bits = math.prod(shape) * _DTYPE_BITS[dtype]
        if bits % 8 or end < begin or end - begin != bits // 8:
            raise ValueError(f"tensor {name!r}: bytes [{begin}, {end}) do not hold {dtype}{list(shape)}")
        tensors[name] = (dtype, shape, begin, end)
    covered = 0
    for name, (_, _, begin, end) in sorted(tensors.items(), key=lambda item: item[1][2:]):
        if begin != covered:
            raise ValueError(
                f"tensor {name!r} starts at byte {begin} of the data, but the tensors before it end at "
                f"{covered}: tensors must lie end to end, without overlap or gap"
            )
        covered = end
    if covered > data_bytes:
        raise ValueError(f"the tensors need {covered} data bytes but the file holds {data_bytes}: it is truncated")
    if covered != data_bytes:
        raise ValueError(f"the tensors cover {covered} data bytes but the file holds {data_bytes}")
    return tensors, metadata


@dataclass(frozen=True)
class StoredTensorInfo:
    """Where one tensor's bytes lie in a safetensors file (absolute offsets)."""

    dtype_name: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def dtype(self) -> torch.dtype | None:
        return dtype_from_safetensors(self.dtype_name)


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    raw: bytes  # the 8-byte length and the JSON, as stored (what ``header_crc`` covers)
    tensors: dict[str, StoredTensorInfo]
    metadata: dict

    @property
    def data_start(self) -> int:
        return len(self.raw)

    def info(self, key: str) -> StoredTensorInfo:
        try:
            return self.tensors[key]
        except KeyError:
            raise CheckpointError(
                f"{self.path}, key {key!r}: missing from the file; the checkpoint is damaged or the index is wrong"
            ) from None


def read_header(fd: int, path: str, file_size: int) -> SafetensorsHeader:
    """Parse and validate (``parse_header_json``) the header of the safetensors file open as ``fd``:
    plain JSON, nothing is executed."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path} is not a readable safetensors file ({why}); restore it or re-create it")

    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise bad(f"{file_size} bytes, shorter than a header")
    (length,) = struct.unpack("<Q", head)
    if length > min(_MAX_HEADER, file_size - 8):
        raise bad(f"header length {length} exceeds the file or the {_MAX_HEADER:,} byte limit")
    blob = os.pread(fd, length, 8)
    if len(blob) != length:
        raise bad("file shorter than its header")
    try:
        parsed, metadata = parse_header_json(blob, file_size - 8 - length)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and json's errors are ValueErrors
        raise bad(str(e) if not isinstance(e, RecursionError) else "nested too deeply") from None
    start = 8 + length
    tensors = {
        name: StoredTensorInfo(dtype, shape, start + begin, start + end)
        for name, (dtype, shape, begin, end) in parsed.items()
    }
    return SafetensorsHeader(path, head + blob, tensors, metadata)


def fsync_dir(path: str) -> None:
    """Make a rename/creation inside ``path`` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
