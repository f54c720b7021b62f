"""What a verified load costs, counted (never timed): work per file, per block and per walk of the
model must not grow faster than the checkpoint, and reads are hashed while they are hot.

Speed itself is measured by ``benchmarks/bench_checkpoint.py --sizes`` (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn

import fsdp2.checkpoint as ck
from fsdp2.checkpoint import format as ckformat
from fsdp2.checkpoint import integrity, reader, tensor_reader
from tests.checkpoint.ckpt_helpers import (
    V2_FIXTURE,
    assert_same_state,
    byte_of,
    file_index,
    flip_byte,
    full_state,
    make_model,
    matrices,
    wide_module,
)


def _stack(layers: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(8, 8) for _ in range(layers)))


def _counting(monkeypatch, module, name: str) -> list:
    """Record the first argument's length of every call of ``module.name``."""
    calls = []
    real = getattr(module, name)

    def wrapper(data, *args, **kwargs):
        calls.append(len(data))
        return real(data, *args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def _callers(monkeypatch, module, name: str) -> list[str]:
    """Record the calling function's name for every call of ``module.name``."""
    calls = []
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(sys._getframe(1).f_code.co_name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


@pytest.mark.parametrize("layers", [4, 32])
def test_each_header_is_checked_once_per_load(tmp_path, monkeypatch, layers):
    """Every tensor of a file is listed in its header: checking the header (its checksum, its index)
    once per chunk read would cost (tensors in the file)^2 per rank."""
    path = str(tmp_path / "c")
    ck.save(path, _stack(layers))
    seals = _callers(monkeypatch, reader, "check_seal")
    indexes = []
    real_of_header = reader.FileIndex.of_header.__func__
    monkeypatch.setattr(
        reader.FileIndex, "of_header", classmethod(lambda cls, h: indexes.append(h.path) or real_of_header(cls, h))
    )
    target = _stack(layers, seed=1)
    ck.load(path, target)
    assert len(seals) == len(indexes) == 1  # one file
    assert_same_state(full_state(target), full_state(_stack(layers)))


def test_each_header_of_a_format_2_checkpoint_is_hashed_once_per_load(monkeypatch):
    header_hashes = _counting(monkeypatch, reader, "checksum")
    ck.load(V2_FIXTURE, make_model(1))
    assert len(header_hashes) == 2  # two files, with 6 model tensors in each


def test_per_load_walks_do_not_grow_with_the_model(tmp_path, monkeypatch):
    """named_parameters / named_buffers walks per load are a constant, not one per module."""
    counts = {}
    for layers in (2, 16):
        path = str(tmp_path / f"c{layers}")
        model = _stack(layers)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        ck.save(path, model, opt)
        walks = []
        for name in ("named_parameters", "named_buffers"):
            real = getattr(nn.Module, name)

            def counted(self, *args, _real=real, _name=name, **kwargs):
                walks.append(_name)
                return _real(self, *args, **kwargs)

            monkeypatch.setattr(nn.Module, name, counted)
        ck.load(path, model, opt)
        monkeypatch.undo()
        counts[layers] = (walks.count("named_parameters"), walks.count("named_buffers"))
    assert counts[2] == counts[16]


def test_each_chunks_checksums_are_decoded_once_per_load(tmp_path, monkeypatch):
    """Manifest validation decodes a chunk's checksum list and block grid; the reader reuses them
    (decoding them again cost about a microsecond and a half per chunk of every verified load)."""
    path = str(tmp_path / "c")
    ck.save(path, _stack(6))
    decoded = _counting(monkeypatch, ckformat, "from_hex")
    grids = []
    real_of = integrity.BlockGrid.of.__func__

    def counted_of(cls, *args, **kwargs):
        grids.append(args)
        return real_of(cls, *args, **kwargs)

    monkeypatch.setattr(integrity.BlockGrid, "of", classmethod(counted_of))
    target = _stack(6, seed=1)
    ck.load(path, target)
    assert len(decoded) == len(grids) == 12  # a weight and a bias per layer
    assert_same_state(full_state(target), full_state(_stack(6)))


def _blocks_of(path: str) -> int:
    """Block checksums listed by the checkpoint's (one) rank file."""
    chunks = file_index(os.path.join(path, "gen-000001", "rank-00000.safetensors"))["chunks"]
    return sum(len(c["crc32c"]) // 8 for c in chunks.values())


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_verified_reads_hash_each_window_with_one_call(tmp_path, monkeypatch, threads):
    """Three 4 MiB tensors (16 blocks of 256 KiB each), one read task each (so up to three threads), hashed by the hash
    implementation itself (no Python wrapper frame). Three or more reader threads hash each whole
    task with ONE call, checked against its blocks' checksums combined: a call per block (48 here)
    made them wait on each other's GIL hand-offs. One or two reader threads hand the GIL over
    rarely: they hash block by block in 1 MiB windows, still in the CPU cache. Without
    verification, one read per task."""
    monkeypatch.setattr(tensor_reader, "read_threads", lambda: threads)
    path = str(tmp_path / "c")
    names = ("a", "b", "c")
    module = matrices(*names)
    ck.save(path, module)
    hash_callers = _callers(monkeypatch, integrity, "_crc32c")
    reads = []
    real_preadv = os.preadv
    monkeypatch.setattr(
        tensor_reader.os,
        "preadv",
        lambda fd, views, offset: reads.append(sum(len(v) for v in views)) or real_preadv(fd, views, offset),
    )
    target = matrices(*names, seed=None)
    stats = ck.LoadStats()
    ck.load(path, target, stats=stats)
    assert all(torch.equal(getattr(target, n), getattr(module, n)) for n in names)
    hashing = tensor_reader.hashing_for(threads)
    window = hashing.window_bytes
    assert (window, hashing.combine) == ((1 << 20, False) if threads <= 2 else (tensor_reader.PIECE_BYTES, True))
    windows = 3 * -(-(4 << 20) // window)
    calls = windows if hashing.combine else 48
    # The windows or blocks + the file header, which alone goes through the ``checksum`` wrapper.
    assert _blocks_of(path) == 48 and len(hash_callers) == calls + 1 and hash_callers.count("checksum") == 1
    assert sum(reads) == stats.bytes_read == stats.bytes_verified == 12 << 20
    assert len(reads) == windows and max(reads) <= window
    reads.clear()
    ck.load(path, target, verify=False)
    assert reads == [4 << 20] * 3


def test_a_chunk_bigger_than_a_read_task_is_cut_at_block_edges(tmp_path, monkeypatch):
    """A 4 MiB chunk (256 KiB blocks of 64 rows) read in tasks of at most 100 KiB (25 rows): each task
    is widened to the next block edge, so every block is read and checked by one task, once."""
    monkeypatch.setattr(tensor_reader, "PIECE_BYTES", 100 << 10)
    monkeypatch.setattr(tensor_reader, "read_threads", lambda: 1)
    path = str(tmp_path / "c")
    module = matrices("w")
    ck.save(path, module)
    tasks = []
    real_run_task = tensor_reader._run_task

    def run_task(task, *args):
        tasks.append((task.lo, task.hi))
        return real_run_task(task, *args)

    monkeypatch.setattr(tensor_reader, "_run_task", run_task)
    target = matrices("w", seed=None)
    stats = ck.LoadStats()
    ck.load(path, target, stats=stats)
    assert torch.equal(target.w, module.w)
    assert tasks == [(r, r + 64) for r in range(0, 1024, 64)]
    assert stats.bytes_read == stats.bytes_verified == 4 << 20


def _tall_module(ws, seed):
    return wide_module(ws, seed, rows=16384)


def _load_tall(rank, ws, path):
    module = _tall_module(ws, 1)
    try:
        ck.load(path, module)
    except ck.CheckpointError as e:
        return str(e)
    return torch.equal(module.w.full_tensor(), _tall_module(ws, 0).w.full_tensor())


def test_windowed_check_across_unaligned_shard_edges(worlds, tmp_path):
    """4 MiB saved by one rank (256 KiB blocks of 1024 rows), loaded by 3 (edges inside blocks: each
    read has side buffers before and after the owned rows): bitwise equal; a flipped byte in the
    second window of rank 1 is reported with its block."""
    path = str(tmp_path / "c")
    worlds.run(1, _save_tall, path)
    assert worlds.run(3, _load_tall, path) == [True, True, True]
    assert file_index(os.path.join(path, "gen-000001", "rank-00000.safetensors"))["chunks"]["model/w"][
        "block_elems"
    ] == (1024 * 64)
    row = 9216 + 1000  # rank 1 owns rows 5462..10923, read from row 5120 (a block edge) in windows of 4096 rows
    flip_byte(*byte_of(path, "model/w", row))
    results = worlds.run(3, _load_tall, path)
    assert f"key 'model/w', block {row // 1024})" in results[1]
    assert all("failed on another rank" in r for r in (results[0], results[2]))


def _save_tall(rank, ws, path):
    ck.save(path, _tall_module(ws, 0))


def test_tiling_check_is_not_quadratic_in_the_saving_ranks(monkeypatch):
    """A tensor saved by 1024 ranks has 1024 chunks; every load checks their tiling. Comparing all
    pairs took 0.8 s per tensor there; dim-0 splits now compare each chunk with its neighbours."""
    from fsdp2.layout.regions import Region

    chunks = [Region((i * 4, 0), (4, 768)) for i in reversed(range(1024))]
    compared = []
    real = Region.intersect
    monkeypatch.setattr(Region, "intersect", lambda a, b: compared.append(1) or real(a, b))
    ckformat.check_tiling("model/w", (4096, 768), chunks)
    assert len(compared) <= 3 * len(chunks)


@pytest.mark.parametrize("second", [(0, 4), (1020, 0), (2, 0)])
def test_overlapping_chunks_are_refused_in_any_order(second):
    from fsdp2.layout.regions import Region

    chunks = [Region((i * 4, 0), (4, 8)) for i in range(256)]
    chunks.insert(100, Region(second, (4, 4)))  # overlaps a chunk it is not listed next to
    with pytest.raises(ck.CheckpointError, match=r"of 'model/w' overlap"):
        ckformat.check_tiling("model/w", (1024, 8), chunks)


@pytest.mark.parametrize(
    "cpus, local_world_size, threads",
    [
        (2, None, 2),
        (16, None, 8),
        (1, None, 2),
        (2, "1", 2),
        (2, "2", 1),
        (2, "4", 1),
        (16, "4", 4),
        (64, "2", 8),
        (2, "not a number", 2),
        (2, "0", 2),
    ],
)
def test_reader_threads_share_the_cores_among_local_ranks(monkeypatch, cpus, local_world_size, threads):
    """Ranks of one host share its cores: 2 ranks with 2 reader threads each oversubscribe 2 cores."""
    monkeypatch.setattr(tensor_reader.os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    assert tensor_reader.read_threads() == threads


def test_a_rank_with_one_core_of_its_own_reads_without_a_thread_pool(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    ck.save(path, _stack(4))
    monkeypatch.setattr(tensor_reader.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")

    def no_pool(*args, **kwargs):
        raise AssertionError("a thread pool was started")

    monkeypatch.setattr(tensor_reader, "ThreadPoolExecutor", no_pool)
    target = _stack(4, seed=1)
    ck.load(path, target)
    assert_same_state(full_state(target), full_state(_stack(4)))


def _collections_during(fn) -> list[int]:
    """Generations of the garbage collections that start while ``fn`` runs."""
    import gc

    started = []

    def record(event, info):
        if event == "start":
            started.append(info["generation"])

    gc.callbacks.append(record)
    try:
        fn()
    finally:
        gc.callbacks.remove(record)
    return started


@pytest.mark.parametrize("verify", [True, False])
def test_no_garbage_collection_runs_inside_a_load(tmp_path, verify):
    """A load's thousands of short-lived objects used to trigger young collections on every load
    and, every few loads, a full one that walks every object of the process (0.14-0.18 s with
    torch imported; the other ranks wait for it): ``load`` pauses automatic collection, so what it
    allocated is freed by reference counting before any collection sees it. At most one young
    collection may start as it resumes (objects CPython keeps in its free lists are not
    subtracted from the young count), never one while the load runs."""
    import gc

    path = str(tmp_path / "c")
    model = _stack(64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    ck.save(path, model, opt)
    ck.load(path, model, opt, verify=verify)  # first load: creates nothing that later ones would not
    gc.collect()
    assert gc.isenabled()
    assert _collections_during(lambda: ck.load(path, model, opt, verify=verify)) in ([], [0])
    assert gc.isenabled()


def test_no_garbage_collection_runs_inside_a_load_hf(tmp_path):
    """``load_hf`` pauses automatic collection as ``load`` does (its multi-rank reads stall alike)."""
    import gc

    from safetensors.torch import save_file

    source = _stack(64)
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "model.safetensors"))
    target = _stack(64, seed=1)
    ck.load_hf(tmp_path, target)  # first load: creates nothing that later ones would not
    gc.collect()
    assert _collections_during(lambda: ck.load_hf(tmp_path, target)) in ([], [0])
    assert gc.isenabled()
    assert_same_state(full_state(target), full_state(source))


def test_no_garbage_collection_runs_inside_a_save_or_verify(tmp_path):
    """``save`` (sync, an async save's call and its ``wait()``) and ``verify_checkpoint`` pause
    automatic collection as ``load`` does: a save's objects would otherwise start ~30 young
    collections and, every few saves, a full one on one rank while the others wait at the commit
    (fails before: 33 collections in one save of a 64-layer stack with AdamW state). The async
    save's background write is not paused: it runs beside training."""
    import gc

    from fsdp2.checkpoint.verify import verify_checkpoint

    path = str(tmp_path / "c")
    model = _stack(64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    ck.save(path, model, opt)  # first save: creates nothing that later ones would not
    gc.collect()
    assert _collections_during(lambda: ck.save(path, model, opt)) in ([], [0])
    assert _collections_during(lambda: verify_checkpoint(path)) in ([], [0])
    handle = []
    assert _collections_during(lambda: handle.append(ck.save(path, model, opt, async_save=True))) in ([], [0])
    handle[0].finish_writing()
    assert _collections_during(handle[0].wait) in ([], [0])
    assert gc.isenabled()
    assert verify_checkpoint(path) == []


def test_a_failed_load_restores_automatic_garbage_collection(tmp_path):
    import gc

    path = str(tmp_path / "c")
    ck.save(path, _stack(2))
    with pytest.raises(ck.CheckpointError):
        ck.load(path, _stack(3))  # a key the checkpoint lacks
    assert gc.isenabled()
    gc.disable()
    try:
        ck.load(path, _stack(2))  # the caller's choice stands
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_pauses_resume_collection_when_the_last_one_ends():
    """Loads in two threads overlap without nesting: the first to finish must not switch the
    collector back on under the other."""
    import gc

    from fsdp2.checkpoint import gc_pause

    first, second = gc_pause.paused(), gc_pause.paused()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    try:
        assert not gc.isenabled()
    finally:
        second.__exit__(None, None, None)
    assert gc.isenabled()
