"""Per-block checksums (format 2): what a rank reads, what it checks, and format-1 checkpoints.

Also the async save's reusable snapshot buffer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import fsdp2.checkpoint as ck
from fsdp2.checkpoint import cli, integrity
from fsdp2.checkpoint.integrity import BlockGrid
from tests.checkpoint.ckpt_helpers import (
    V1_FIXTURE,
    V2_FIXTURE,
    assert_same_state,
    byte_of,
    checksum_blocks,
    file_index,
    flip_byte,
    full_state,
    load_outcome,
    make_model,
    matrices,
    mesh_1d,
    mesh_2d,
    rewrite_rank_file,
    shard,
    wide_module,
)


# ---------------------------------------------------------------- block geometry


@settings(max_examples=60, deadline=None)
@given(
    row0=st.integers(0, 40),
    rows=st.integers(1, 40),
    row_elems=st.integers(1, 9),
    rows_mode=st.booleans(),
    k=st.integers(1, 8),
    lo=st.integers(0, 39),
    n=st.integers(1, 40),
)
def test_blocks_tile_the_chunk_and_expansion_lands_on_edges(row0, rows, row_elems, rows_mode, k, lo, n):
    # k rows per block, or (pieces) blocks of k elements when that is less than a row
    block_elems = k * row_elems if rows_mode or k >= row_elems else k
    grid = BlockGrid.of((row0, 0), (rows, row_elems), 4, block_elems)
    blocks = grid.blocks(0, rows)
    assert [i for i, _, _ in blocks] == list(range(grid.count))
    assert blocks[0][1] == 0 and blocks[-1][2] == rows * row_elems * 4
    assert all(a[2] == b[1] for a, b in zip(blocks, blocks[1:]))  # contiguous, no overlap
    lo = min(lo, rows - 1)
    hi = min(rows, lo + n)
    a, b = grid.expand_rows(lo, hi)
    assert a <= lo < hi <= b and grid.is_edge(a) and grid.is_edge(b)
    if grid.row_mode:  # edges sit at global multiples of the block, not chunk-relative ones
        k = grid.rows_per_block
        assert all((row0 + r) % k == 0 or r in (0, rows) for r in range(rows + 1) if grid.is_edge(r))


def test_block_size_policy():
    # 2048-wide fp32 rows (8 KiB): 128 rows per 1 MiB block (a verified read's cache window).
    assert BlockGrid.choose_block_elems((4096, 2048), 4) == 128 * 2048
    # A row bigger than a block: pieces (1.6 MB / 16 -> 64 KiB).
    assert BlockGrid.choose_block_elems((4, 100_000), 4) == 16384
    # Small chunks: about 16 blocks, none smaller than 64 KiB.
    assert BlockGrid.choose_block_elems((1024, 256), 4) == 64 * 256  # 1 MiB: 64 KiB blocks, 16 of them
    assert BlockGrid.choose_block_elems((512, 256), 4) == 64 * 256  # 512 KiB: 64 KiB blocks, 8 of them
    assert BlockGrid.of((0, 0), (7, 16), 4, BlockGrid.choose_block_elems((7, 16), 4)).count == 1  # 448 B: one block
    # A huge chunk: blocks grow so that there are at most 4096 of them.
    big = BlockGrid.of((0, 0), (1 << 20, 1024), 4, BlockGrid.choose_block_elems((1 << 20, 1024), 4))
    assert big.count <= 4096
    assert BlockGrid.of((), (), 8, BlockGrid.choose_block_elems((), 8)).count == 1  # 0-d: one block


# ---------------------------------------------------------------- what a rank reads


def _rows_model(seed, rows=24, width=64):
    """Weights whose rows split evenly on 2, 3 and 4 ranks (and 2x2)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, rows), nn.Linear(rows, 12))


def _save_rows(rank, ws, path, block_bytes, mesh_shape):
    model = _rows_model(0)
    mesh = mesh_1d(ws) if len(mesh_shape) == 1 else mesh_2d(*mesh_shape)
    shard(model, mesh)
    with checksum_blocks(block_bytes):
        ck.save(path, model)
    return full_state(model)


def _load_rows(rank, ws, path, mesh_shape, verify=True):
    model = _rows_model(7)
    mesh = mesh_1d(ws) if len(mesh_shape) == 1 else mesh_2d(*mesh_shape)
    shard(model, mesh)
    stats = ck.LoadStats()
    ck.load(path, model, verify=verify, stats=stats)
    return full_state(model), stats.bytes_read, stats.bytes_owned, stats.bytes_verified


@pytest.mark.parametrize(
    "save_mesh,load_mesh",
    [((2,), (3,)), ((4,), (1,)), ((4,), (2, 2)), ((2, 2), (3,))],
    ids=["2to3", "4to1", "1d-to-hsdp", "hsdp-to-1d"],
)
def test_verified_load_reads_only_owned_bytes(worlds, tmp_path, save_mesh, load_mesh):
    """One-row blocks: every dim-0 reshard reads exactly what each rank owns, and checks all of it."""
    import math

    path = str(tmp_path / "c")
    saved = worlds.run(math.prod(save_mesh), _save_rows, path, 1, save_mesh)[0]
    results = worlds.run(math.prod(load_mesh), _load_rows, path, load_mesh)
    for state, read, owned, verified in results:
        assert_same_state(state, saved)
        assert read == owned == verified > 0


def test_real_block_size_reads_at_most_one_block_per_edge(worlds, tmp_path):
    """Default blocks (512 KiB chunks of 256-byte rows: 64 KiB = 256 rows, the smallest): exact when
    the splits fall on block edges, else less than one block more per edge."""
    path = str(tmp_path / "c")
    worlds.run(2, _save_wide, path)
    block_rows = file_index(os.path.join(path, "gen-000001", "rank-00000.safetensors"))["chunks"]["model/w"]
    block_rows = block_rows["block_elems"] // 64
    assert block_rows == 256
    aligned = worlds.run(4, _load_wide, path, block_rows)  # rank edges at multiples of 1024 rows
    assert all(read == owned for read, owned, _ in aligned)
    unaligned = worlds.run(3, _load_wide, path, block_rows)  # edges at rows 1366, 2732: inside blocks
    block = block_rows * 256
    for read, owned, n_edges in unaligned:
        assert owned < read < owned + n_edges * block
    assert sum(read for read, _, _ in unaligned) < 4096 * 256 + 4 * block


def _save_wide(rank, ws, path):
    ck.save(path, wide_module(ws, 0))


def _load_wide(rank, ws, path, block_rows):
    module = wide_module(ws, 1)
    stats = ck.LoadStats()
    ck.load(path, module, stats=stats)
    assert torch.equal(module.w.full_tensor(), wide_module(ws, 0).w.full_tensor())
    rows = -(-4096 // ws)
    lo, hi = rank * rows, min(4096, (rank + 1) * rows)
    n_edges = (lo % block_rows != 0) + (hi % block_rows != 0)
    return stats.bytes_read, stats.bytes_owned, n_edges


def _load_columns(rank, ws, path, verify):
    """Load a dim-0-sharded checkpoint into a Shard(1) (tensor-parallel style) parameter."""
    from torch.distributed.tensor import Shard, distribute_tensor

    module = nn.Module()
    module.register_parameter("w", nn.Parameter(distribute_tensor(torch.zeros(8, 4096), mesh_1d(ws), [Shard(1)])))
    stats = ck.LoadStats()
    ck.load(path, module, verify=verify, stats=stats)
    torch.manual_seed(0)
    return torch.equal(module.w.full_tensor(), torch.randn(8, 4096)), stats.bytes_read, stats.bytes_owned


def test_column_split_reads_runs_unverified_whole_rows_verified(tmp_path, worlds):
    path = str(tmp_path / "c")
    module = nn.Module()
    torch.manual_seed(0)
    module.register_parameter("w", nn.Parameter(torch.randn(8, 4096)))
    ck.save(path, module)
    for ok, read, owned in worlds.run(2, _load_columns, path, False):
        assert ok and read == owned == 8 * 2048 * 4  # 8 KiB runs, one pread each
    for ok, read, owned in worlds.run(2, _load_columns, path, True):
        assert ok and read == 2 * owned  # blocks are whole rows: a column half reads them all


# ---------------------------------------------------------------- corruption


def _load_rows_outcome(rank, ws, path):
    return load_outcome(path, shard(_rows_model(7), mesh_1d(ws)))


def test_flipped_byte_is_caught_by_the_rank_that_reads_it(worlds, tmp_path):
    path = str(tmp_path / "c")
    worlds.run(1, _save_rows, path, 1024, (1,))  # one file; 0.weight is 24 rows of 256 B: 4 rows a block
    data, offset = byte_of(path, "model/0.weight", 20)  # rank 1 of 2 owns rows 12..23
    flip_byte(data, offset + 5)
    results = worlds.run(2, _load_rows_outcome, path)
    assert all(untouched for _, untouched in results)
    assert "rank-00000.safetensors is corrupted (crc32c" in results[1][0]
    assert "key 'model/0.weight', block 5)" in results[1][0]  # rows 20..23
    assert "failed on another rank" in results[0][0]  # rank 0 never read that block


@pytest.mark.parametrize(
    "window_bytes, combine",
    [(1 << 20, False), (1 << 20, True), (256 << 10, False)],
    ids=["4-blocks-a-window", "combined", "a-block-a-window"],
)
def test_flipped_byte_names_its_block_and_bytes(tmp_path, monkeypatch, window_bytes, combine):
    """A 4 MiB tensor is 16 blocks of 256 KiB, read and hashed in windows of 4 blocks (block by block,
    or with one hash call per window checked against its blocks' checksums combined) or of one
    block: a byte flipped in block 9 (in the third window of 4) is reported with that block and its
    byte range, and nothing is loaded."""
    from fsdp2.checkpoint import tensor_reader

    monkeypatch.setattr(tensor_reader, "hashing_for", lambda _: tensor_reader.Hashing(window_bytes, combine=combine))
    path = str(tmp_path / "c")
    ck.save(path, matrices("w"))  # 4 KiB rows: 64 rows a block
    data, start = byte_of(path, "model/w", 9 * 64)
    flip_byte(data, start + 1000)
    target = matrices("w", seed=None)
    with pytest.raises(ck.CheckpointError) as error:
        ck.load(path, target)
    message = str(error.value)
    assert f"bytes [{start}, {start + (256 << 10)}) of key 'model/w', block 9)" in message, message
    assert not target.w.any()


def test_short_reads_are_read_again_before_checking(tmp_path, monkeypatch):
    """``preadv`` may return fewer bytes than asked (a signal, a network file system): every read of
    a verified load that comes back short is completed before its blocks are hashed (one reader
    thread: each 1 MiB window is one ``preadv`` straight into the destination)."""
    from fsdp2.checkpoint import tensor_reader

    monkeypatch.setattr(tensor_reader, "read_threads", lambda: 1)
    path = str(tmp_path / "c")
    source = matrices("w")
    ck.save(path, source)
    real_preadv = os.preadv
    short = []

    def preadv_halves(fd, views, offset):  # every first attempt at a range reads half of it
        if (fd, offset) in short:
            return real_preadv(fd, views, offset)
        short.append((fd, offset))
        return real_preadv(fd, [views[0][: max(1, len(views[0]) // 2)]], offset)

    monkeypatch.setattr(tensor_reader.os, "preadv", preadv_halves)
    target = matrices("w", seed=None)
    ck.load(path, target)
    assert torch.equal(target.w, source.w)
    assert len(short) >= 4  # each of the 4 MiB tensor's 1 MiB windows came back short once


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=12), st.integers(0, 2**32 - 1))
def test_combined_block_checksums_equal_the_checksum_of_their_concatenation(lengths, seed):
    import random

    rng = random.Random(seed)
    blocks = [rng.randbytes(n) for n in lengths]
    crcs = [integrity.checksum(b) for b in blocks]
    assert integrity.combined(crcs, lengths) == integrity.checksum(b"".join(blocks))


def test_corruption_outside_what_is_read_is_not_read(tmp_path):
    """A flipped byte in optimizer state: a model-only load neither reads nor trips on it."""
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    path = str(tmp_path / "c")
    ck.save(path, model, opt)
    data, offset = byte_of(path, "optim/state/0.weight/exp_avg", 3)
    flip_byte(data, offset)
    target = make_model(1)
    stats = ck.LoadStats()
    ck.load(path, target, stats=stats)  # model only
    assert_same_state(full_state(target), full_state(model))
    model_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    assert stats.bytes_read == stats.bytes_owned == stats.bytes_verified == model_bytes
    with pytest.raises(ck.CheckpointError, match=r"corrupted \(crc32c .* key 'optim/state/0.weight/exp_avg'"):
        other = make_model(1)
        ck.load(path, other, torch.optim.AdamW(other.parameters()))
    problems = ck.verify_checkpoint(path)
    assert len(problems) == 1 and "optim/state/0.weight/exp_avg" in problems[0] and "(corrupted)" in problems[0]
    assert ck.load(path, make_model(1), verify=False) is None  # unverified: reads, trusts


def test_corrupted_header_is_caught(tmp_path):
    path = str(tmp_path / "c")
    ck.save(path, make_model(0))
    data = os.path.join(path, "gen-000001", "rank-00000.safetensors")
    with open(data, "rb") as f:
        head = f.read(4096)
    flip_byte(data, head.index(b'"model/0.bias"') + 7)  # '0' -> ' ': still JSON, a renamed tensor
    with pytest.raises(ck.CheckpointError, match=r"rank-00000\.safetensors is corrupted \(crc32c of its header"):
        ck.load(path, make_model(1))
    assert any("rank-00000.safetensors is corrupted (crc32c of its header" in p for p in ck.verify_checkpoint(path))


def test_checksum_list_of_wrong_length_is_refused(tmp_path):
    path = str(tmp_path / "c")
    ck.save(path, make_model(0))
    data = os.path.join(path, "gen-000001", "rank-00000.safetensors")
    rewrite_rank_file(data, lambda tensors, index: index["chunks"]["model/0.weight"].update(crc32c="00000000" * 2))
    with pytest.raises(
        ck.CheckpointError,
        match=r"rank-00000\.safetensors: .*'model/0\.weight' lists 2 block checksums, its shape needs 1",
    ):
        ck.load(path, make_model(1))
    # Format 2 lists them in the manifest.
    old = str(tmp_path / "v2")
    shutil.copytree(V2_FIXTURE, old)
    with open(os.path.join(old, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["tensors"]["model/0.weight"]["chunks"][0]["crc32c"] += "00000000"
    with open(os.path.join(old, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ck.CheckpointError, match=r"lists 2 block checksums, its shape needs 1"):
        ck.load(old, make_model(1))


# ---------------------------------------------------------------- format 1


def _expected_v1():
    return load_file(V1_FIXTURE + ".expected.safetensors")


def _load_v1(rank, ws, path):
    model = shard(make_model(9), mesh_1d(ws))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = ck.LoadStats()
    extra = ck.load(path, model, opt, stats=stats)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"model/{k}": v for k, v in full_state(model).items()}
    for p, s in opt.state.items():
        state[f"optim/{names[id(p)]}/exp_avg"] = s["exp_avg"].full_tensor()
    return state, extra, stats.bytes_verified


@pytest.mark.parametrize("load_ws", [1, 3])
def test_format_1_checkpoint_still_loads_verified(worlds, load_ws):
    expected = _expected_v1()
    for state, extra, verified in worlds.run(load_ws, _load_v1, V1_FIXTURE):
        assert extra == {"step": 1, "note": "format 1 fixture"}
        assert_same_state(state, expected)
        assert verified > 0  # whole-file CRC-32, as format 1 defines


def test_format_1_verify_and_corruption(tmp_path, capsys):
    assert ck.verify_checkpoint(V1_FIXTURE) == []
    assert cli.main(["verify", V1_FIXTURE]) == 0
    copy = str(tmp_path / "v1")
    shutil.copytree(V1_FIXTURE, copy)
    flip_byte(os.path.join(copy, "gen-000001", "rank-00001.safetensors"), 900)
    assert cli.main(["verify", copy]) == 1
    assert "crc32" in capsys.readouterr().out
    with pytest.raises(ck.CheckpointError, match=r"rank-00001\.safetensors is corrupted \(crc32 "):
        ck.load(copy, make_model(1))


# ---------------------------------------------------------------- format 2


def _load_v2(rank, ws, path):
    model = shard(make_model(9), mesh_1d(ws))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = ck.LoadStats()
    extra, mine = ck.load(path, model, opt, stats=stats, return_rank_extra=True)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"model/{k}": v for k, v in full_state(model).items()}
    for p, s in opt.state.items():
        for name in ("exp_avg", "exp_avg_sq"):
            state[f"optim/{names[id(p)]}/{name}"] = s[name].full_tensor()
    return state, extra, mine, stats.bytes_read, stats.bytes_verified


@pytest.mark.parametrize("load_ws", [1, 2, 3])
def test_format_2_checkpoint_still_loads_verified(worlds, load_ws):
    expected = load_file(V2_FIXTURE + ".expected.safetensors")
    for rank, (state, extra, mine, read, verified) in enumerate(worlds.run(load_ws, _load_v2, V2_FIXTURE)):
        assert extra["step"] == 1 and extra["note"] == "format 2 fixture"
        assert torch.equal(extra["t"], torch.arange(3))
        assert_same_state(state, expected)
        assert read == verified > 0  # block checksums from the manifest, checked as read
        if load_ws == 2:  # saved on 2 ranks: each gets its own rank_extra back
            assert mine["rank"] == rank and torch.equal(mine["r"], torch.full((2,), float(rank)))
        else:
            assert mine is None


def test_format_2_verify_and_corruption(tmp_path, capsys):
    assert ck.verify_checkpoint(V2_FIXTURE) == []
    assert cli.main(["verify", V2_FIXTURE]) == 0
    copy = str(tmp_path / "v2")
    shutil.copytree(V2_FIXTURE, copy)
    full, offset = byte_of(copy, "model/0.weight", 5)  # rank 1's chunk
    flip_byte(full, offset)
    assert cli.main(["verify", copy]) == 1
    assert "rank-00001.safetensors" in capsys.readouterr().out
    with pytest.raises(ck.CheckpointError, match=r"rank-00001\.safetensors is corrupted \(crc32c "):
        ck.load(copy, make_model(1))


# ---------------------------------------------------------------- checksum implementations


def _crc32c_bitwise(data: bytes, value: int = 0) -> int:
    """CRC32C from its definition (reflected polynomial 0x82F63B78), one bit at a time: the reference."""
    crc = value ^ 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _installed_implementations() -> list[str]:
    found = []
    for name in integrity.IMPLEMENTATIONS:
        try:
            integrity.choose_implementation([name])
            found.append(name)
        except ImportError:
            pass
    return found


def test_checksums_use_the_fastest_installed_implementation():
    installed = _installed_implementations()
    assert integrity.IMPLEMENTATION == installed[0]
    assert list(integrity.IMPLEMENTATIONS)[:2] == ["crc32c_rs", "fastcrc"]  # fastest first (RESULTS.md)
    assert "crc32c" in installed  # the fallback (a core dependency) works too


def test_every_crc32c_implementation_computes_the_same_checksums():
    """Files written with one implementation verify with the other: same values for any length,
    alignment and split point, equal to CRC32C computed from its definition."""
    import numpy as np

    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    view = memoryview(data)
    fns = {name: integrity.choose_implementation([name])[1] for name in _installed_implementations()}
    for length in [*range(0, 70), 255, 256, 257, 1023, 4096 + 13]:
        for start in (0, 1, 7, 64):
            piece = view[start : start + length]
            want = _crc32c_bitwise(bytes(piece), 0x1234)
            assert {name: fn(piece, 0x1234) for name, fn in fns.items()} == dict.fromkeys(fns, want), (length, start)
    whole = {name: fn(view, 0) for name, fn in fns.items()}
    assert len(set(whole.values())) == 1
    for cut in (1, 4096, 1 << 20, (3 << 20) - 5):  # continue one implementation's CRC with another's
        for first in fns.values():
            for second in fns.values():
                assert second(view[cut:], first(view[:cut], 0)) == whole["crc32c"]


def test_a_missing_or_wrong_implementation_is_skipped(monkeypatch):
    def wrong():
        return lambda data, value: 0

    def missing():
        raise ImportError("no such module")

    monkeypatch.setattr(integrity, "IMPLEMENTATIONS", {"missing": missing, "wrong": wrong, **integrity.IMPLEMENTATIONS})
    name, fn = integrity.choose_implementation()
    assert name not in ("missing", "wrong") and fn(b"123456789", 0) == 0xE3069283
    with pytest.raises(ImportError, match="no working CRC32C implementation: pip install crc32c"):
        integrity.choose_implementation(["missing", "wrong"])


@pytest.mark.parametrize(
    "wrong_on",
    [
        lambda array: len(array) == 4096 + 37,
        lambda array: len(array) > 64 and array.ctypes.data % 2 == 1,
        lambda array: len(array) > 64 << 10,
        lambda array: len(array) > 64 << 10 and array.ctypes.data % 8 == 5,
    ],
    ids=[
        "a-4-KiB-+-37-byte-buffer",
        "a-buffer-at-an-odd-address",
        "buffers-past-64-KiB",
        "buffers-past-64-KiB-at-address-5-mod-8",
    ],
)
def test_an_implementation_wrong_only_on_long_buffers_is_skipped(monkeypatch, wrong_on):
    """The check value is 9 bytes: a vector path (its folds, its tails) that is wrong passes it."""
    right = integrity.IMPLEMENTATIONS["crc32c"]()

    def off_by_one_bit(data, value):
        return right(data, value) ^ (1 if wrong_on(np.frombuffer(data, dtype=np.uint8)) else 0)

    monkeypatch.setitem(integrity.IMPLEMENTATIONS, "broken", lambda: off_by_one_bit)
    with pytest.raises(ImportError, match="no working CRC32C implementation"):
        integrity.choose_implementation(["broken"])
    assert integrity.choose_implementation(["broken", "crc32c"])[0] == "crc32c"


class _FailingImport:
    """A meta path finder whose module ``name`` raises ``error`` when imported, as a broken build does."""

    def __init__(self, name: str, error: Exception):
        self.name, self.error = name, error

    def find_spec(self, fullname, path=None, target=None):
        import importlib.util

        return importlib.util.spec_from_loader(fullname, self) if fullname == self.name else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.error


def _raising_crc32c(error: Exception, long_only: bool = False):
    right = integrity.IMPLEMENTATIONS["crc32c"]()

    def crc32c(data, value):
        if not long_only or len(memoryview(data)) > 64 << 10:
            raise error
        return right(data, value)

    return crc32c


@pytest.mark.parametrize(
    "failure",
    [
        "RuntimeError at import",
        "OSError at import",
        "ValueError when called",
        "SystemError when called",
        "OSError when called",
        "RuntimeError on buffers past 64 KiB",
    ],
)
def test_a_failing_optional_implementation_is_skipped(monkeypatch, failure):
    """Any exception from an optional implementation -- at import or in its checks -- skips it, and
    the next working one is chosen; it never makes ``import fsdp2.checkpoint`` fail."""
    import types

    error = {
        "RuntimeError": RuntimeError("built for another CPU"),
        "OSError": OSError(8, "Exec format error"),
        "ValueError": ValueError("buffer is not contiguous"),
        "SystemError": SystemError("NULL result"),
    }[failure.split()[0]]
    monkeypatch.delitem(sys.modules, "crc32c_rs", raising=False)
    if failure.endswith("at import"):
        monkeypatch.setattr(sys, "meta_path", [_FailingImport("crc32c_rs", error), *sys.meta_path])
    else:
        module = types.ModuleType("crc32c_rs")
        module.crc32c = _raising_crc32c(error, long_only="past 64 KiB" in failure)
        monkeypatch.setitem(sys.modules, "crc32c_rs", module)
    expected = next(name for name in ("fastcrc", "crc32c") if name in _installed_implementations())
    assert integrity.choose_implementation()[0] == expected


def test_import_survives_an_optional_implementation_that_raises(tmp_path):
    """A crc32c_rs raising RuntimeError at import used to make ``import fsdp2.checkpoint`` itself fail."""
    (tmp_path / "crc32c_rs.py").write_text('raise RuntimeError("this build needs AVX-512")\n')
    root = os.path.dirname(os.path.dirname(os.path.abspath(ck.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), root])}
    result = subprocess.run(
        [sys.executable, "-c", "import fsdp2.checkpoint, fsdp2.checkpoint.integrity as i; print(i.IMPLEMENTATION)"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("fastcrc", "crc32c")


def test_implementation_checks_are_cheap():
    """They run at every ``import fsdp2.checkpoint``: about 1.5 ms on the 2-core CI machine."""
    import time

    took = []
    for _ in range(5):
        start = time.perf_counter()
        integrity.choose_implementation()
        took.append(time.perf_counter() - start)
    assert min(took) < 0.05, f"choosing the CRC32C implementation took {min(took) * 1e3:.1f} ms"


@pytest.mark.parametrize(
    "save_with,load_with", [("crc32c", "crc32c_rs"), ("crc32c_rs", "fastcrc"), ("fastcrc", "crc32c")]
)
def test_checkpoint_saved_with_one_implementation_loads_verified_with_the_other(
    tmp_path, monkeypatch, save_with, load_with
):
    for name in (save_with, load_with):
        if name not in _installed_implementations():
            pytest.skip(f"{name} is not installed")
    model = make_model(0)
    path = str(tmp_path / "c")
    monkeypatch.setattr(integrity, "_crc32c", integrity.choose_implementation([save_with])[1])
    ck.save(path, model)
    monkeypatch.setattr(integrity, "_crc32c", integrity.choose_implementation([load_with])[1])
    target = make_model(1)
    stats = ck.LoadStats()
    ck.load(path, target, stats=stats)
    assert_same_state(full_state(target), full_state(model))
    assert stats.bytes_verified == stats.bytes_read > 0
    assert ck.verify_checkpoint(path) == []
    data, offset = byte_of(path, "model/0.weight", 1)
    flip_byte(data, offset)
    with pytest.raises(ck.CheckpointError, match=r"corrupted \(crc32c .* key 'model/0.weight'"):
        ck.load(path, make_model(1))


# ---------------------------------------------------------------- async snapshot buffer


def test_async_save_reuses_staging_and_snapshots_while_training_goes_on(tmp_path, monkeypatch):
    from fsdp2.checkpoint import safetensors_io
    from fsdp2.checkpoint.staging import StagingState, process_staging

    staging = process_staging()
    model = make_model(0)
    writing = threading.Event()
    resume = threading.Event()
    original = safetensors_io.SafetensorsStreamWriter.write

    def slow_write(self, tensor, grid=None):
        writing.set()
        assert resume.wait(30)
        return original(self, tensor, grid)

    monkeypatch.setattr(safetensors_io.SafetensorsStreamWriter, "write", slow_write)
    pointers, allocations = [], staging.allocations
    for i in range(2):
        expected = full_state(model)
        writing.clear()
        resume.clear()
        handle = ck.save(str(tmp_path / f"c{i}"), model, async_save=True)
        pointers.append(staging.buffer.data_ptr())
        assert writing.wait(30)  # the background write has started ...
        with torch.no_grad():  # ... and training changes every parameter under it
            for p in model.parameters():
                p.add_(1000.0)
        with pytest.raises(ck.CheckpointError, match="still writing from the snapshot buffer"):
            staging.stage([torch.zeros(3)])
        resume.set()
        handle.wait()
        assert staging.state is StagingState.IDLE
        loaded = make_model(5)
        ck.load(str(tmp_path / f"c{i}"), loaded)
        assert_same_state(full_state(loaded), expected)  # the snapshot, not the changed values
    assert pointers[0] == pointers[1] and staging.allocations - allocations <= 1
