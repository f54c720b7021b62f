"""Check a whole checkpoint offline: manifest, tiling, file headers and every checksum.

``verify_checkpoint(path)`` returns every problem found (an empty list: all good). It reads
every byte once: format 2 checks the header and each block of each chunk (with the read
pass's threads), format 1 the CRC-32 of each whole file. ``python -m fsdp2.checkpoint
verify PATH`` prints the result.
"""

from __future__ import annotations

from fsdp2.tools.progress import SILENT, ByteProgress

from . import gc_pause
from .errors import CheckpointError
from .format import Chunk, Manifest, TensorEntry, safetensors_dtype
from .integrity import checksum
from .reader import read_manifest
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
    problems = []
    for key in m.tensors:
        try:
            m.validate([key])
        except CheckpointError as e:
            problems.append(str(e))
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
    if not problems:
        try:
            reads.run(progress)
        except CheckpointError as e:
            problems.append(f"{e} (corrupted)")
    return problems
