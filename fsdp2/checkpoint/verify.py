"""Check a whole checkpoint offline: manifest, tiling, file headers and every checksum.

``verify_checkpoint(path)`` returns every problem found (an empty list: all good). It reads
every byte once: formats 2 and 3 check the header and each block of each chunk (with the read
pass's threads), format 1 the CRC-32 of each whole file. Format 3 also checks that every rank
file holds exactly the chunks its tensors' rules place there, where they place them, and
belongs to the manifest's save. ``python -m fsdp2.checkpoint verify PATH`` prints the result.
"""

from __future__ import annotations

import math
import os

from fsdp2.layout.regions import Region
from fsdp2.tools.progress import SILENT, ByteProgress

from . import gc_pause
from .errors import CheckpointError
from .file_index import FileIndex, check_seal, chunk_record
from .format import Chunk, Manifest, TensorEntry, safetensors_dtype
from .integrity import BlockGrid, checksum, from_hex
from .paths import checkpoint_file
from .reader import read_manifest, stored_chunk
from .safetensors_io import file_crc32
from .tensor_reader import OpenFiles, ReadPass, StoredChunk


def verify_checkpoint(path: str) -> list[str]:
    """Every problem found in the checkpoint at ``path`` (empty list: all good)."""
    with gc_pause.paused():  # as load's: thousands of short-lived objects, none kept
        return _problems(path)


def _problems(path: str) -> list[str]:
    try:
        m = read_manifest(path)
    except CheckpointError as e:
        return [str(e)]
    try:
        m.validate_files()
    except CheckpointError as e:
        return [str(e)]  # never open files an untrusted manifest points at outside PATH
    problems, good = [], []
    for key in m.tensors:
        try:
            m.validate_entry(key)
            good.append(key)
        except CheckpointError as e:
            problems.append(str(e))
    if m.version >= 3:
        return problems + _verify_rank_files(path, m, good)
    chunks_by_file: dict[str, list[tuple[TensorEntry, Chunk]]] = {}
    for key, t in m.tensors.items():
        for c in t.chunks:
            chunks_by_file.setdefault(c.file, []).append((t, c))
    total = sum(f.size for f in m.files.values())
    with OpenFiles(path) as files, ByteProgress("verify", path, total) as progress:
        end = 0
        for name in m.files:
            try:
                problems += _verify_file(m, files, name, chunks_by_file.get(name, []), progress)
            except CheckpointError as e:  # e.g. a dtype this fsdp2 cannot read: a problem to report
                problems.append(str(e))
            end += m.files[name].size
            progress.advance_to(end)  # headers, and whole-file checks of format 1
    return problems


def _verify_file(
    m: Manifest, files: OpenFiles, name: str, chunks: list[tuple[TensorEntry, Chunk]], progress: ByteProgress = SILENT
) -> list[str]:
    full = files.full_path(name)
    expected = m.files[name]
    try:
        _, size = files.open(name)
    except CheckpointError as e:
        return [f"{full}: missing or unreadable ({e})"]
    if size != expected.size:
        return [f"{full}: {size} bytes, manifest says {expected.size} (truncated?)"]
    if m.version == 1:
        crc, _ = file_crc32(full)
        if crc != expected.crc32:
            return [f"{full}: crc32 {crc}, manifest says {expected.crc32} (corrupted)"]
    try:
        header = files.header(name)
    except CheckpointError as e:
        return [str(e)]
    if m.version >= 2 and f"{checksum(header.raw):08x}" != expected.header_crc32c:
        return [f"{full}: header crc32c {checksum(header.raw):08x}, manifest says {expected.header_crc32c} (corrupted)"]
    problems = []
    reads = ReadPass(verify=True)
    for t, c in chunks:
        if c.key not in header.tensors:
            problems.append(f"{full}: key {c.key!r} is missing")
            continue
        info = header.tensors[c.key]
        if info.shape != c.shape or info.dtype_name != safetensors_dtype(t.torch_dtype):
            problems.append(
                f"{full}: key {c.key!r} is {info.dtype_name}{list(info.shape)}, manifest says {t.dtype}{list(c.shape)}"
            )
            continue
        if m.version >= 2:
            try:
                grid = c.grid(t.torch_dtype.itemsize)
            except ValueError:
                continue  # reported by validate()
            reads.add(
                StoredChunk(
                    full,
                    files.open(name)[0],
                    info.begin,
                    c.region,
                    t.torch_dtype,
                    f"key {c.key!r}",
                    grid,
                    c.checksums(),
                ),
                c.region,
                None,
            )
    return problems + _read_unless(problems, reads, progress)


def _verify_rank_files(path: str, m: Manifest, keys: list[str]) -> list[str]:
    """Format 3: every rank file, each against what the rules of ``keys`` place in it."""
    problems = []
    sizes = []
    for rank in range(m.world_size):
        try:
            sizes.append(os.path.getsize(checkpoint_file(path, m.rank_file(rank))))
        except (CheckpointError, OSError):
            sizes.append(0)  # reported below, when the file is opened
    with OpenFiles(path) as files, ByteProgress("verify", path, sum(sizes)) as progress:
        end = 0
        for rank in range(m.world_size):
            try:
                problems += _verify_rank_file(m, files, rank, keys, progress)
            except CheckpointError as e:
                problems.append(str(e))
            end += sizes[rank]
            progress.advance_to(end)
    return problems


def _verify_rank_file(m: Manifest, files: OpenFiles, rank: int, keys: list[str], progress: ByteProgress) -> list[str]:
    name = m.rank_file(rank)
    full = files.full_path(name)
    try:
        fd, _ = files.open(name)
        header = files.header(name)
    except CheckpointError as e:
        return [str(e)]
    try:
        check_seal(header)
        index = FileIndex.of_header(header)
    except CheckpointError as e:
        return [str(e)]
    if index.save_id != m.save_id:
        return [f"{full}: belongs to another save (id {index.save_id}, the manifest's is {m.save_id})"]
    problems = []
    reads = ReadPass(verify=True)
    expected = set()
    for key in keys:
        entry = m.tensors[key]
        box = entry.rule.chunk_of(entry.shape, rank)
        if box is None:
            continue
        expected.add(key)
        chunk = Chunk(name, key, box.offsets, box.shape)
        try:  # the loader's checks, with its messages
            record = chunk_record(index, full, key, box.offsets, box.shape)
            source = stored_chunk(
                files, entry, chunk.with_checksums(record.block_elems, record.crc32c, record.grid), True
            )
        except CheckpointError as e:
            problems.append(str(e))
            continue
        reads.add(source, box, None)
    for key in sorted(set(index.chunks) - expected):
        info, record = header.tensors[key], index.chunks[key]
        if not (m.rank_extra and key.startswith("rank_extra/")):
            problems.append(f"{full}: holds {key!r}, which the manifest's layout does not place in this file")
        elif math.prod(info.shape) and info.dtype is not None:
            box = Region(record.offsets, info.shape)
            reads.add(_stored(full, fd, info, box, info.dtype, key, record), box, None)
    return problems + _read_unless(problems, reads, progress)


def _stored(full: str, fd: int, info, box: Region, dtype, key: str, record) -> StoredChunk:
    """A format-3 chunk to check whole: its bytes in the file and its blocks from the index."""
    grid = BlockGrid.of(box.offsets, box.shape, dtype.itemsize, record.block_elems)
    return StoredChunk(full, fd, info.begin, box, dtype, f"key {key!r}", grid, from_hex(record.crc32c))


def _read_unless(problems: list[str], reads, progress) -> list[str]:
    """Read and check every block, unless the layout already failed; what the reads found."""
    if problems:
        return []
    try:
        reads.run(progress)
    except CheckpointError as e:
        return [f"{e} (corrupted)"]
    return []
