"""Checksums of stored tensor bytes: the hash, and how a chunk's bytes are cut into blocks.

Hash: CRC32C, chosen by measurement on the 2-core CI machine (``bench_checkpoint.py --hashes``,
benchmarks/RESULTS.md): a hardware instruction on x86-64 and ARMv8; it detects every burst error
up to 32 bits and any odd number of flipped bits. Three implementations compute the same values
(the manifest names the algorithm, not the library), the fastest installed one is used:
``crc32c-rs`` and ``fastcrc`` (the ``fsdp2[fast]`` extra; they fold 64-byte lanes with carry-less
multiplies: 87 and 66 GB/s on 1 MiB windows here, against 33 GB/s), else the ``crc32c`` package.
All release the GIL while they hash, so reader threads hash in parallel; since each release and
re-acquire is a hand-off between a rank's reader threads, several readers hash a whole window per
call and check it against the blocks' checksums combined (:func:`combined`). Before use, each is
checked against CRC32C's check value, against the ``crc32c`` package on buffers of up to 4 KiB
with every tail length, and on 1 MiB buffers at every alignment against itself continued over
the buffer's 4 KiB pieces, so that the vector paths of long buffers run too. An implementation that
fails to import or fails any check (wrong values, or any exception) is skipped: a broken build
or CPU dispatch falls back instead of writing or accepting wrong checksums, or breaking
``import fsdp2.checkpoint``. The checks cost about 1.5 ms at import (the 2-core CI machine).

Blocks (:class:`BlockGrid`): a chunk (one stored box of a tensor, row-major) is cut into runs
of whole dim-0 rows, a power of two of them per block, with block edges at *global* row
indices that are multiples of it. Any reshard that splits dim 0 at multiples of the block
therefore reads and checks exactly the rows it owns. Rows bigger than a block are cut into
pieces of ``block_elems`` elements instead (every row edge is then a block edge).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

HASH_NAME = "crc32c"
# Block sizes; format.py explains the trade-off. A verified read hashes one block per call, so
# blocks as big as its 1 MiB cache window cost one call per window (tensor_reader.py).
BLOCK_BYTES = 1 << 20  # block size of large chunks (16 MiB and more)
MIN_BLOCK_BYTES = 64 << 10  # smaller chunks get about 16 blocks, none below 64 KiB
BLOCKS_PER_CHUNK = 16
MAX_BLOCKS_PER_CHUNK = 4096  # huge chunks get bigger blocks so the manifest stays small
_HEX_DIGITS = 8


_CHECK_INPUT, _CHECK_VALUE = b"123456789", 0xE3069283  # CRC32C's catalogue check value


def _crc32c_rs() -> Callable[[object, int], int]:
    return importlib.import_module("crc32c_rs").crc32c


def _fastcrc() -> Callable[[object, int], int]:
    return importlib.import_module("fastcrc.crc32").iscsi


def _crc32c_package() -> Callable[[object, int], int]:
    return importlib.import_module("crc32c").crc32c


# Fastest first; every one takes (buffer, value to continue from) and returns the CRC32C.
IMPLEMENTATIONS: dict[str, Callable[[], Callable[[object, int], int]]] = {
    "crc32c_rs": _crc32c_rs,
    "fastcrc": _fastcrc,
    "crc32c": _crc32c_package,
}
REFERENCE = "crc32c"  # the core dependency: what the faster ones must agree with


_SEED = 0x5EED  # every check continues from a value, as readers continuing a checksum do
_SHORT = 4096  # short buffers: lengths up to _SHORT + 256 are compared with the reference
_LONG = (1 << 20) + 257  # past the 64 KiB and larger blocks of the vector paths, with an odd tail


def _test_data() -> memoryview:
    """Random bytes, the same every run (a bit generator's raw stream is stable across numpy versions)."""
    return memoryview(np.random.PCG64(24).random_raw((_LONG + 7) // 8 + 1).view(np.uint8))


def _agrees_with(fn: Callable[[object, int], int], reference: Callable[[object, int], int], data: memoryview) -> bool:
    """``fn`` equals ``reference`` on buffers that take vector paths (up to 4 KiB + 256 bytes, so
    folds of 64-256 bytes and every tail length 0-256 run), at odd alignments, continued from a value."""
    for length in (_SHORT, 1024, 512, 256):
        for tail in range(257):
            for start in (0, 3) if tail % 64 == 1 else (tail % 4,):
                piece = data[start : start + length + tail]
                if fn(piece, _SEED) != reference(piece, _SEED):
                    return False
    return True


def _long_buffers_agree(fn: Callable[[object, int], int], data: memoryview) -> bool:
    """``fn`` of a 1 MiB + 257 byte buffer, at each alignment 0-7, equals ``fn`` continued over the
    buffer's 4 KiB pieces one after the other: the long buffer takes the paths the short checks
    never reach, the pieces take the ones they checked."""
    for start in range(8):
        piece = data[start : start + _LONG]
        chained = _SEED
        for i in range(0, _LONG, _SHORT):
            chained = fn(piece[i : i + _SHORT], chained)
        if fn(piece, _SEED) != chained:
            return False
    return True


def choose_implementation(names=None) -> tuple[str, Callable[[object, int], int]]:
    """``(name, function)`` of the first of ``names`` (default: all, fastest first) that imports,
    computes CRC32C's check value whole and continued from a prefix, agrees with the ``crc32c``
    package (:func:`_agrees_with`; the package itself only by the check value) and with itself
    on long buffers (:func:`_long_buffers_agree`). Any exception while importing or checking one
    skips it, as a wrong value does."""
    reference, data = None, None
    for name in names or IMPLEMENTATIONS:
        try:
            fn = IMPLEMENTATIONS[name]()
            ok = fn(_CHECK_INPUT, 0) == _CHECK_VALUE and fn(_CHECK_INPUT[4:], fn(_CHECK_INPUT[:4], 0)) == _CHECK_VALUE
            if ok:
                data = data if data is not None else _test_data()
                if name != REFERENCE:
                    reference = reference or IMPLEMENTATIONS[REFERENCE]()
                    ok = _agrees_with(fn, reference, data)
                ok = ok and _long_buffers_agree(fn, data)
        except Exception:  # an optional extension that fails to load or to run: the next one
            continue
        if ok:
            return name, fn
    raise ImportError("no working CRC32C implementation: pip install crc32c (or crc32c-rs, faster: fsdp2[fast])")


IMPLEMENTATION, _crc32c = choose_implementation()


def checksum(data, value: int = 0) -> int:
    """CRC32C of a buffer (bytes, memoryview, numpy array), continuing from ``value``."""
    return _crc32c(data, value)


def checksum_function() -> Callable[[object, int], int]:
    """The function :func:`checksum` calls, for loops over many blocks (one Python call fewer per block)."""
    return _crc32c


# -- combining block checksums ------------------------------------------------------------------
#
# CRC32C(A + B) = shift(CRC32C(A), len(B)) ^ CRC32C(B), where shift multiplies by x^(8 len(B))
# modulo the polynomial (zlib's crc32_combine; the initial and final XORs cancel out). It lets a
# reader hash a whole window of blocks with ONE call and check it against the manifest's block
# checksums folded together: each call of a hash that releases the GIL is a GIL hand-off, and with
# several reader threads per rank those hand-offs, not the hashing, capped a verified read
# (benchmarks/RESULTS.md, "Checkpoint loads on a 16-core host").

_POLY_REFLECTED = 0x82F63B78  # CRC32C (Castagnoli), bit-reflected: x^0 is bit 31


def _multiply_mod_p(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC32C polynomial, both bit-reflected."""
    m, product = 1 << 31, 0
    while True:
        if a & m:
            product ^= b
            if a & (m - 1) == 0:
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY_REFLECTED if b & 1 else b >> 1


_X_POW_2N = [1 << 30]  # x^(2^n) modulo the polynomial
for _ in range(31):
    _X_POW_2N.append(_multiply_mod_p(_X_POW_2N[-1], _X_POW_2N[-1]))


def _x_pow_8n(nbytes: int) -> int:
    """x^(8 nbytes) modulo the polynomial."""
    product, k = 1 << 31, 3
    while nbytes:
        if nbytes & 1:
            product = _multiply_mod_p(_X_POW_2N[k & 31], product)
        nbytes >>= 1
        k += 1
    return product


_shift_tables: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}


def shift_tables(nbytes: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Four 256-entry tables, one per byte of a checksum ``c``, whose entries XORed give
    ``shift(c, nbytes)`` (the map is linear in ``c``): ``combined = t0[c & 255] ^ t1[c >> 8 & 255]
    ^ t2[c >> 16 & 255] ^ t3[c >> 24] ^ crc_of_next``. Cached per length (a checkpoint has few)."""
    tables = _shift_tables.get(nbytes)
    if tables is None:
        op = _x_pow_8n(nbytes)
        tables = []
        for k in range(4):
            bits = [_multiply_mod_p(op, 1 << (8 * k + i)) for i in range(8)]
            table = [0] * 256
            for b in range(1, 256):
                low = b & -b
                table[b] = table[b ^ low] ^ bits[low.bit_length() - 1]
            tables.append(table)
        tables = _shift_tables[nbytes] = tuple(tables)
    return tables


def combined(checksums: Sequence[int], lengths: Sequence[int]) -> int:
    """CRC32C of the concatenation of blocks whose CRC32Cs are ``checksums`` and byte lengths ``lengths``."""
    total = checksums[0]
    tables_for = -1  # the length the tables in hand shift by: blocks of a window are mostly one length
    for i in range(1, len(checksums)):
        if lengths[i] != tables_for:
            tables_for = lengths[i]
            t0, t1, t2, t3 = shift_tables(tables_for)
        total = t0[total & 255] ^ t1[total >> 8 & 255] ^ t2[total >> 16 & 255] ^ t3[total >> 24] ^ checksums[i]
    return total


def to_hex(values: Sequence[int]) -> str:
    return "".join(f"{v & 0xFFFFFFFF:08x}" for v in values)


def from_hex(text: str) -> list[int]:
    if len(text) % _HEX_DIGITS:
        raise ValueError(f"checksum list of {len(text)} hex digits is not a multiple of {_HEX_DIGITS}")
    return np.frombuffer(bytes.fromhex(text), dtype=">u4").tolist()


def hex_count(text: str) -> int:
    return len(text) // _HEX_DIGITS


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class BlockGrid:
    """The checksummed blocks of one stored chunk, in rows of its dim 0.

    Rows are chunk-relative (0 .. rows); a 0-d chunk is one row of one element. In row mode
    (``block_elems`` a multiple of the row) a block is ``rows_per_block`` rows and block edges
    sit where the *global* row index is a multiple of it. In piece mode (a row is bigger than
    ``block_elems``) each row is cut into ``pieces_per_row`` blocks.
    """

    row0: int  # global index of the chunk's first row
    rows: int
    row_elems: int
    itemsize: int
    block_elems: int

    @classmethod
    def of(cls, offsets: Sequence[int], shape: Sequence[int], itemsize: int, block_elems: int) -> "BlockGrid":
        row_elems = math.prod(shape[1:]) if len(shape) else 1
        grid = cls(offsets[0] if len(shape) else 0, shape[0] if len(shape) else 1, row_elems, itemsize, block_elems)
        if block_elems < 1 or row_elems < 1 or (block_elems >= row_elems and block_elems % row_elems):
            raise ValueError(f"block of {block_elems} elements does not fit rows of {row_elems}")
        return grid

    @staticmethod
    def choose_block_elems(shape: Sequence[int], itemsize: int) -> int:
        """The block size a writer uses for a chunk of ``shape``."""
        row_elems = math.prod(shape[1:]) if len(shape) else 1
        chunk_bytes = math.prod(shape) * itemsize
        target = _pow2_floor(min(BLOCK_BYTES, max(MIN_BLOCK_BYTES, chunk_bytes // BLOCKS_PER_CHUNK)))
        target = max(target, _pow2_ceil(-(-chunk_bytes // MAX_BLOCKS_PER_CHUNK)))
        row_bytes = row_elems * itemsize
        if row_bytes <= target:
            return _pow2_floor(target // row_bytes) * row_elems
        return max(1, target // itemsize)

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.itemsize

    @property
    def row_mode(self) -> bool:
        return self.block_elems >= self.row_elems

    @property
    def rows_per_block(self) -> int:
        return self.block_elems // self.row_elems

    @property
    def pieces_per_row(self) -> int:
        return -(-self.row_elems // self.block_elems)

    @property
    def count(self) -> int:
        if not self.row_mode:
            return self.rows * self.pieces_per_row
        k = self.rows_per_block
        return (self.row0 + self.rows - 1) // k - self.row0 // k + 1

    def expand_rows(self, lo: int, hi: int) -> tuple[int, int]:
        """The smallest block-aligned row range holding rows ``[lo, hi)``."""
        if not self.row_mode:
            return lo, hi
        k = self.rows_per_block
        g_lo = (self.row0 + lo) // k * k
        g_hi = -(-(self.row0 + hi) // k) * k
        return max(0, g_lo - self.row0), min(self.rows, g_hi - self.row0)

    def is_edge(self, row: int) -> bool:
        """True if a block starts (or the chunk ends) at chunk row ``row``."""
        return not self.row_mode or row in (0, self.rows) or (self.row0 + row) % self.rows_per_block == 0

    def edges(self, lo: int, hi: int) -> tuple[int, list[int]]:
        """``(index of the first block, byte edges)`` (chunk-relative) of the blocks in the aligned
        rows ``[lo, hi)``: block ``first + i`` is bytes ``[edges[i], edges[i + 1])``.

        Built with ``range`` arithmetic, not a Python loop per block: a load walks every block
        of what it reads, and small chunks have many small blocks.
        """
        rb = self.row_bytes
        if not self.row_mode:
            piece = self.block_elems * self.itemsize
            m = self.pieces_per_row
            inner = range(0, self.row_bytes, piece)  # m piece starts within a row
            edges = [r * rb + p for r in range(lo, hi) for p in inner]
            edges.append(hi * rb)
            return lo * m, edges
        k = self.rows_per_block
        g_lo = (self.row0 + lo) // k
        step = k * rb
        first_inner = ((g_lo + 1) * k - self.row0) * rb  # first block edge after lo
        return g_lo - self.row0 // k, [lo * rb, *range(first_inner, hi * rb, step), hi * rb]

    def blocks(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``(index, first byte, end byte)`` (chunk-relative) of the blocks in the aligned rows ``[lo, hi)``."""
        first, edges = self.edges(lo, hi)
        return [(first + i, a, b) for i, (a, b) in enumerate(zip(edges, edges[1:]))]
