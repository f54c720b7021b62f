"""Read boxes of stored tensors from files: several threads, one pass, checking what is read.

A request says: this stored chunk (a row-major box of a tensor at some offset of a file), the
part of it I need (a box in global coordinates), and the tensor to put it in (shaped like the
part, any dtype: a dtype conversion happens in the copy). :class:`ReadPass` turns requests
into tasks of at most :data:`PIECE_BYTES`, runs them on :func:`read_threads` threads and
returns how many bytes it read and checked.

What a task reads:
- needed part spans whole rows (dim-0 splits, the FSDP case): one contiguous range;
  with checksums, widened to block edges (``integrity.BlockGrid``);
- needed part is a column range: whole rows when checking (blocks are rows), otherwise just
  the runs, one ``pread`` each.

Where it lands: straight in the destination when the dtype matches and the rows are
contiguous there (the edge bytes outside the owned rows go to small side buffers, one
``preadv`` call scatters them), else in a per-thread scratch buffer that is checked and then
copied out. With checksums, a task reads in windows of whole blocks of about
``Hashing.window_bytes`` and hashes each window as soon as it lands, as :func:`hashing_for` the
number of reader threads says: block by block, or with one call checked against the blocks'
manifest checksums combined (``integrity.combined``). A mismatch raises :class:`CheckpointError`
naming the file, key, block and byte range.

Why it depends on the reader threads: the hash releases the GIL for each call, and with several
reader threads per rank every release and re-acquire is a hand-off between them. On a 16-core
host (2 ranks, 8 threads each) the hand-offs, not the hashing, capped verified reads: a call per
128 KiB block cost 0.7-0.8x of the unverified load, one call per 1 MiB window 0.23-0.32x, one per
16 MiB task 0.17-0.25x. With one or two reader threads the hand-offs are few, and a window still in
the CPU cache hashes faster (``crc32c-rs``: 87 GB/s in cache, ~32 GB/s from memory). On the 2-core
CI machine, one rank reading the 1.6 GB benchmark state with two threads paid +21.6 ms for 1 MiB
windows against +27.5 ms for whole tasks (medians of 5 paired runs; 2.9 GB: +17.8 against
+46.8 ms), and one thread per rank on 2 ranks pays 0.06-0.14x of the unverified load at
13 MB-2.9 GB (benchmarks/RESULTS.md, "Checkpoint loads by size vs DCP").
"""

from __future__ import annotations

import bisect
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import torch

from fsdp2.layout.regions import Region
from fsdp2.tools.progress import SILENT, ByteProgress

from .errors import CheckpointError
from .integrity import BlockGrid, checksum_function, combined
from .paths import open_checkpoint_file
from .safetensors_io import SafetensorsHeader, read_header

MAX_READ_THREADS = 8
PIECE_BYTES = 16 << 20  # bytes per task: enough to amortize a syscall, small enough to spread
CACHE_WINDOW_BYTES = 1 << 20  # few reader threads: hashed while still in the CPU cache (see above)
CACHE_WINDOW_THREADS = 2  # up to this many reader threads per rank hash block by block in cache windows


@dataclass(frozen=True)
class Hashing:
    """How a verified read hashes: in windows of about ``window_bytes``, with one call per window
    checked against the blocks' checksums combined (``combine``) or one call per block."""

    window_bytes: int
    combine: bool


class OpenFiles:
    """Data files opened once each (through :func:`fsdp2.checkpoint.paths.open_checkpoint_file`) and their
    parsed headers.

    A context manager: every file is closed on exit.
    """

    def __init__(self, root: str, links_may_leave_root: bool = False):
        self.root = root
        self._links_may_leave_root = links_may_leave_root
        self._fds: dict[str, tuple[int, int]] = {}
        self._headers: dict[str, SafetensorsHeader] = {}

    def __enter__(self) -> "OpenFiles":
        return self

    def __exit__(self, *exc) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def full_path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def open(self, rel: str) -> tuple[int, int]:
        """(fd, size) of ``rel``."""
        if rel not in self._fds:
            self._fds[rel] = open_checkpoint_file(self.root, rel, self._links_may_leave_root)
        return self._fds[rel]

    def header_bytes(self) -> int:
        """Bytes of the headers read so far."""
        return sum(len(h.raw) for h in self._headers.values())

    def header(self, rel: str) -> SafetensorsHeader:
        if rel not in self._headers:
            fd, size = self.open(rel)
            self._headers[rel] = read_header(fd, self.full_path(rel), size)
        return self._headers[rel]


@dataclass(frozen=True)
class StoredChunk:
    """A row-major box of a tensor stored contiguously in an open file."""

    path: str  # for messages
    fd: int
    offset: int  # absolute file offset of the first byte
    region: Region  # global box it holds
    dtype: torch.dtype
    label: str  # e.g. "key 'model/fc.weight'"
    grid: BlockGrid | None = None  # with ``checksums``: what verification checks
    checksums: Sequence[int] | None = None

    @property
    def rows(self) -> int:
        return self.region.shape[0] if self.region.shape else 1

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.region.shape[1:])

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * self.dtype.itemsize


@dataclass
class ReadCounts:
    bytes_read: int = 0
    bytes_verified: int = 0


@dataclass
class _Task:
    chunk: StoredChunk
    lo: int  # chunk rows [lo, hi) to read
    hi: int
    own_lo: int  # of which [own_lo, own_hi) are needed
    own_hi: int
    cols: tuple[slice, ...]  # needed part of a row (chunk-relative); full slices when whole rows
    dest: torch.Tensor | None  # rows [own_lo, own_hi) of the destination (None: only check)
    direct: bool  # read straight into ``dest``
    runs: bool  # read only the column runs (no checksums)
    verify: bool

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * self.chunk.row_bytes


def read_threads() -> int:
    """Reader threads per rank: this process's CPUs shared among the ranks of its host, 1 to 8.

    Ranks on one host read at the same time, so more threads than its cores oversubscribe them
    (2 ranks on 2 cores: 13 MB and 329 MB loads took 0.30-0.50x DCP's time with one thread per rank,
    0.32-0.63x with two; benchmarks/RESULTS.md). The ranks per host come from ``LOCAL_WORLD_SIZE``,
    which torchrun sets; without it a rank counts as alone on its host (2 threads at least, as before).
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        local_ranks = 0
    if local_ranks < 1:
        return max(2, min(MAX_READ_THREADS, cpus))
    return max(1, min(MAX_READ_THREADS, cpus // local_ranks))


def hashing_for(threads: int) -> Hashing:
    """How verified reads hash when ``threads`` reader threads run at once: one or two, block by
    block in cache-sized windows; more, whole tasks with one call each (see above)."""
    if threads <= CACHE_WINDOW_THREADS:
        return Hashing(CACHE_WINDOW_BYTES, combine=False)
    return Hashing(PIECE_BYTES, combine=True)


@dataclass
class ReadPass:
    """Collect requests with :meth:`add`, then :meth:`run` them; reusable scratch per thread."""

    verify: bool = True
    threads: int | None = None  # default: read_threads()
    tasks: list[_Task] = field(default_factory=list)

    def add(self, chunk: StoredChunk, part: Region, dest: torch.Tensor | None) -> None:
        """Read ``part`` (global box inside ``chunk.region``) into ``dest`` (shaped like ``part``)."""
        if part.numel == 0:
            return
        scalar = not part.shape
        rel = [o - co for o, co in zip(part.offsets, chunk.region.offsets)]
        lo, hi = (0, 1) if scalar else (rel[0], rel[0] + part.shape[0])
        cols = tuple(slice(o, o + n) for o, n in zip(rel[1:], part.shape[1:]))
        whole_rows = tuple(part.shape[1:]) == chunk.row_shape
        verify = self.verify and chunk.checksums is not None
        runs = dest is not None and not verify and not whole_rows
        a, b = chunk.grid.expand_rows(lo, hi) if verify else (lo, hi)
        if dest is not None:
            dest = dest.reshape(1, *dest.shape) if scalar else dest
            if dest.device.type != "cpu":
                raise CheckpointError(f"internal: read destination of {chunk.label} is on {dest.device}")
        direct = dest is not None and whole_rows and dest.dtype == chunk.dtype and dest.is_contiguous()
        step = max(1, PIECE_BYTES // max(1, chunk.row_bytes))
        start = a
        while start < b:
            end = min(b, start + step)
            if verify and end < b:  # pieces end on block edges so each block is checked by one task
                end = chunk.grid.expand_rows(end - 1, end)[1]
            own_lo, own_hi = max(start, lo), min(end, hi)
            piece_dest = None if dest is None else dest[own_lo - lo : own_hi - lo]
            self.tasks.append(_Task(chunk, start, end, own_lo, own_hi, cols, piece_dest, direct, runs, verify))
            start = end

    @property
    def nbytes(self) -> int:
        """Bytes the added requests will read."""
        return sum(t.nbytes for t in self.tasks)

    def run(self, progress: ByteProgress = SILENT) -> ReadCounts:
        counts = ReadCounts()
        if not self.tasks:
            return counts
        tasks = sorted(self.tasks, key=lambda t: (t.chunk.path, t.chunk.offset + t.lo * t.chunk.row_bytes))
        local = threading.local()
        lock = threading.Lock()
        stop = threading.Event()

        threads = read_threads() if self.threads is None else self.threads
        threads = max(1, min(threads, len(tasks)))
        hashing = hashing_for(threads)

        def work(task: _Task) -> None:
            if stop.is_set():
                return
            try:
                read, verified = _run_task(task, local, hashing)
            except OSError as e:
                stop.set()
                raise CheckpointError(f"{task.chunk.path}: reading {task.chunk.label} failed ({e})") from e
            except BaseException:
                stop.set()
                raise
            with lock:
                counts.bytes_read += read
                counts.bytes_verified += verified
            progress.advance(read)

        if threads == 1:
            for t in tasks:
                work(t)
        else:
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fsdp2-ckpt-read") as pool:
                futures = [pool.submit(work, t) for t in tasks]
                for f in futures:
                    f.result()  # the first error, in file order
        self.tasks = []
        return counts


def _scratch(local: threading.local, nbytes: int) -> torch.Tensor:
    buf = getattr(local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = local.buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    return buf[:nbytes]


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


_HAS_PREADV = hasattr(os, "preadv")  # not on every platform Python runs on


def _preadv(chunk: StoredChunk, views: list[memoryview], offset: int) -> None:
    """Fill ``views`` from ``offset`` on (scatter read, retried until complete)."""
    views = [v for v in views if len(v)]  # empty side buffers are read-only: preadv refuses them
    if _HAS_PREADV and views and os.preadv(chunk.fd, views, offset) == sum(map(len, views)):
        return  # the usual case: one call (a verified load makes one per 1 MiB window)
    while views:  # a short read: read it all again, as long as bytes come
        n = os.preadv(chunk.fd, views, offset) if _HAS_PREADV else _pread_into(chunk.fd, views[0], offset)
        if n <= 0:
            raise CheckpointError(
                f"{chunk.path}: {chunk.label} ends past the end of the file (truncated?); "
                "restore it or load an earlier checkpoint"
            )
        offset += n
        while n and views:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0] = views[0][n:]
                n = 0


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


def _block_checksums(segments: list[memoryview], edges: list[int]) -> list[int]:
    """CRC32C of each range ``[edges[i], edges[i + 1])`` of the concatenation of ``segments``.

    Blocks inside one segment are hashed by one comprehension calling the CRC32C implementation
    itself (no Python frame per block); only the (at most one per segment boundary) block that
    straddles a boundary is hashed in parts.
    """
    crc = checksum_function()
    out: list[int] = []
    pos = 0  # where the current segment starts in the concatenation
    j = 0  # next block
    carry: int | None = None  # CRC of the first part of block j, begun in an earlier segment
    for view in segments:
        end = pos + len(view)
        if carry is not None:
            stop = min(edges[j + 1], end)
            carry = crc(view[: stop - pos], carry)
            if edges[j + 1] > end:
                pos = end
                continue
            out.append(carry)
            carry, j = None, j + 1
        k = bisect.bisect_right(edges, end, lo=j) - 1  # blocks j .. k-1 end inside this segment
        out += [crc(view[a - pos : b - pos], 0) for a, b in zip(edges[j:k], edges[j + 1 : k + 1])]
        j = k
        if j + 1 < len(edges) and edges[j] < end:
            carry = crc(view[edges[j] - pos :], 0)
        pos = end
    return out


def _read_checked(task: _Task, segments: list[memoryview], file_offset: int, hashing: Hashing) -> int:
    """Fill ``segments`` (rows [lo, hi) of the chunk, concatenated) from ``file_offset`` on and verify
    every block; bytes checked.

    Reads go in windows of whole blocks of about ``hashing.window_bytes``, each hashed right after
    it lands (see :class:`Hashing`).
    """
    chunk = task.chunk
    grid = chunk.grid
    base = task.lo * chunk.row_bytes
    first, edges = grid.edges(task.lo, task.hi)
    if base:
        edges = [e - base for e in edges]  # from 0: positions in the concatenation of ``segments``
    segments = [view for view in segments if len(view)]  # side buffers are usually empty
    n = len(edges) - 1
    expected = list(chunk.checksums[first : first + n])
    step = max(1, hashing.window_bytes // (grid.block_elems * grid.itemsize))  # blocks per window
    # Most tasks are one segment (the rows straight into the destination) hashed block by block:
    # each window's blocks are then checked inline, without a _window or _check_window call (a
    # 1.6 GB load runs ~800 windows per rank, mostly of one block). _check_window takes the rest,
    # and names a bad block.
    inline = segments[0] if len(segments) == 1 and not hashing.combine else None
    crc = checksum_function()
    for i in range(0, n, step):
        j = min(n, i + step)
        lo, hi = edges[i], edges[j]
        views = _window(segments, lo, hi) if inline is None else [inline[lo:hi]]
        _preadv(chunk, views, file_offset + lo)
        if inline is not None:
            if j - i == 1:
                if crc(views[0], 0) == expected[i]:
                    continue
            elif [crc(inline[a:b], 0) for a, b in zip(edges[i:j], edges[i + 1 : j + 1])] == expected[i:j]:
                continue
        _check_window(
            task, views, [e - lo for e in edges[i : j + 1]], expected[i:j], first + i, file_offset + lo, hashing.combine
        )
    return edges[-1] - edges[0]


def _check_window(
    task: _Task,
    views: list[memoryview],
    edges: list[int],
    expected: list[int],
    first: int,
    file_offset: int,
    combine: bool,
) -> None:
    """Blocks ``first ..`` of ``task``'s chunk (the bytes of ``views``, cut at ``edges`` from 0, read
    from ``file_offset``) against their manifest checksums ``expected``: with ``combine``, one hash
    of the whole window against them combined (block by block only to name a bad one)."""
    if combine:
        crc = checksum_function()
        value = 0
        for view in views:
            value = crc(view, value)
        if value == combined(expected, [b - a for a, b in zip(edges, edges[1:])]):
            return
    got = _block_checksums(views, edges)
    if got == expected:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)  # counts: Manifest.validate
    chunk = task.chunk
    start = file_offset + edges[i]
    raise CheckpointError(
        f"{chunk.path} is corrupted (crc32c {got[i]:08x}, manifest says {expected[i]:08x} for bytes "
        f"[{start}, {file_offset + edges[i + 1]}) of {chunk.label}, block {first + i}); restore the file or load "
        "an earlier checkpoint"
    )


def _window(segments: list[memoryview], lo: int, hi: int) -> list[memoryview]:
    """Bytes [lo, hi) of the concatenation of ``segments``, as views of them."""
    out, pos = [], 0
    for view in segments:
        end = pos + len(view)
        if end > lo and pos < hi:
            out.append(view[max(lo, pos) - pos : min(hi, end) - pos])
        pos = end
    return out


def _run_task(task: _Task, local: threading.local, hashing: Hashing) -> tuple[int, int]:
    """Read one piece; returns (bytes read, bytes checked)."""
    chunk = task.chunk
    rb = chunk.row_bytes
    file_offset = chunk.offset + task.lo * rb
    if task.runs:
        return _run_column_runs(task, local), 0
    if task.direct:
        head = _scratch_side(local, "head", (task.own_lo - task.lo) * rb)
        tail = _scratch_side(local, "tail", (task.hi - task.own_hi) * rb)
        segments = [head, _bytes_of(task.dest), tail]
    else:
        buf = _scratch(local, task.nbytes)
        segments = [memoryview(buf.numpy())]
    if task.verify:
        checked = _read_checked(task, segments, file_offset, hashing)
    else:
        _preadv(chunk, list(segments), file_offset)
        checked = 0
    if task.direct:
        return task.nbytes, checked
    if task.dest is not None:
        rows = buf.view(chunk.dtype).view(task.hi - task.lo, *chunk.row_shape)
        owned = rows[task.own_lo - task.lo : task.own_hi - task.lo]
        task.dest.copy_(owned[(slice(None), *task.cols)])
    return task.nbytes, checked


def _scratch_side(local: threading.local, name: str, nbytes: int) -> memoryview:
    if nbytes == 0:
        return memoryview(b"")
    buf = getattr(local, name, None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        setattr(local, name, buf)
    return memoryview(buf[:nbytes].numpy())


def _run_column_runs(task: _Task, local: threading.local) -> int:
    """Read only the needed column runs of rows [lo, hi) (no checksums); bytes read."""
    chunk = task.chunk
    itemsize = chunk.dtype.itemsize
    row_shape = chunk.row_shape
    part_shape = tuple(s.stop - s.start for s in task.cols)
    # The trailing dims a run spans whole, and the dim where it starts being partial.
    k = len(row_shape) - 1
    while k > 0 and part_shape[k] == row_shape[k]:
        k -= 1
    run_elems = math.prod(part_shape[k:])
    outer = [range(s.start, s.stop) for s in task.cols[:k]]
    strides = [math.prod(row_shape[d + 1 :]) for d in range(len(row_shape))]
    rows = task.hi - task.lo
    n_runs = math.prod(part_shape[:k]) if k else 1
    buf = _scratch(local, rows * n_runs * run_elems * itemsize)
    out = memoryview(buf.numpy())
    run_bytes = run_elems * itemsize
    pos = 0
    for r in range(task.lo, task.hi):
        row_start = chunk.offset + r * chunk.row_bytes
        for idx in _product(outer):
            elem = sum(i * strides[d] for d, i in enumerate(idx)) + task.cols[k].start * strides[k]
            _preadv(chunk, [out[pos : pos + run_bytes]], row_start + elem * itemsize)
            pos += run_bytes
    task.dest.copy_(buf.view(chunk.dtype).view(rows, *part_shape))
    return pos


def _product(ranges: list[range]):
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)
