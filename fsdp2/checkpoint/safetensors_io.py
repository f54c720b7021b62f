"""Streaming safetensors writing with a running checksum, and file checksums.

We write the (simple) safetensors layout ourselves instead of calling
``safetensors.torch.save_file`` so that tensor bytes go straight from the tensor's
memory to the file while the CRC is computed on the same buffer: no serialized
copy of the whole shard in RAM and no second pass over the file. Files are read
back with the real ``safetensors`` library.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

from .format import safetensors_dtype

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


class SafetensorsStreamWriter:
    """Write a safetensors file tensor by tensor, in the order of ``specs``.

    The header (names, dtypes, shapes, offsets) is known up front, so tensors can be
    produced one at a time (e.g. assembled from slices) and dropped after writing.
    """

    def __init__(self, path: str, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None):
        header: dict = {}
        if metadata:
            header["__metadata__"] = metadata
        offset = 0
        for spec in specs:
            header[spec.name] = {"dtype": safetensors_dtype(spec.dtype), "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # safetensors aligns the data section to 8 bytes
        self._specs = list(specs)
        self._next = 0
        self._file = open(path, "wb")
        self.crc = 0
        self.size = 0
        self._write(struct.pack("<Q", len(blob)) + blob)

    def _write(self, data) -> None:
        self._file.write(data)
        self.crc = zlib.crc32(data, self.crc)  # releases the GIL on large buffers
        self.size += len(data)

    def write(self, tensor: torch.Tensor) -> None:
        spec = self._specs[self._next]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(f"tensor for {spec.name!r} is {tensor.dtype}{list(tensor.shape)}, "
                             f"expected {spec.dtype}{list(spec.shape)}")
        self._write(tensor_bytes(tensor))
        self._next += 1

    def close(self, fsync: bool = True) -> None:
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

    @property
    def crc_hex(self) -> str:
        return f"{self.crc & 0xFFFFFFFF:08x}"


def file_crc32(path: str) -> tuple[str, int]:
    """(crc32 as 8 hex digits, bytes read) of a whole file."""
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
