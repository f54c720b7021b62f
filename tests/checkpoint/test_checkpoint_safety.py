"""Checkpoints that never restore or publish the wrong state, and misuse that changes nothing.

Each test here failed before its fix. Single-process cases run in the pytest
process (no process group: a 1-rank job); multi-rank cases use the shared gloo worlds.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import fsdp2.checkpoint as ck
from fsdp2.checkpoint import cli, lock
from fsdp2.checkpoint.consolidate import consolidate
from tests.checkpoint.ckpt_helpers import (
    V2_FIXTURE,
    assert_same_state,
    exact_tree,
    full_optim_state,
    full_state,
    isolated,
    make_model,
    mesh_1d,
    rewrite_rank_file,
    shard,
)


def _tree(path) -> dict[str, int]:
    """Every file under ``path`` with its size: to check that nothing was touched."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in files + [d + "/" for d in dirs]:
            full = os.path.join(root, name.rstrip("/"))
            out[os.path.relpath(full, path) + ("/" if name.endswith("/") else "")] = (
                os.path.getsize(full) if not name.endswith("/") else 0
            )
    return out


def _snapshot(model, opt):
    state = {f"opt/{i}/{k}": v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    hyper = {
        f"group/{i}/{k}": torch.tensor(float(v))
        for i, g in enumerate(opt.param_groups)
        for k, v in g.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return {**full_state(model), **state, **hyper}


def _trained(seed, opt_cls=torch.optim.AdamW, params=None):
    model = make_model(seed)
    opt = opt_cls(model.parameters() if params is None else params(model), lr=1e-2)
    torch.manual_seed(seed)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    return model, opt


@contextlib.contextmanager
def _deadline(seconds: int):
    """Fail instead of hanging (a FIFO or /dev/zero read never ends)."""

    def fire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _edit_manifest(path, edit):
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


# ================================================================ wrong state restored or published


def _gpt(seed, ws):
    from fsdp2 import fully_shard
    from fsdp2.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, dim=16, n_layers=2, n_heads=2))
    mesh = mesh_1d(ws)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _gpt_step(model, opt, rank):
    torch.manual_seed(rank)
    tokens = torch.randint(0, 32, (2, 8))
    opt.zero_grad()
    model.loss(tokens, tokens).backward()
    opt.step()


def _load_into_unsharded_groups(rank, ws, path):
    """Load (and save) after a forward without backward and after an exception in a child's forward."""
    saved = _gpt(0, ws)
    saved_opt = torch.optim.AdamW(saved.parameters(), lr=1e-2)
    _gpt_step(saved, saved_opt, rank)
    saved(torch.randint(0, 32, (2, 8)))  # skipped (NaN) loss: forward, no backward; root stays gathered
    ck.save(path, saved, saved_opt, extra={"step": 1})
    expected, expected_opt = full_state(saved), full_optim_state(saved, saved_opt)

    results = {}
    for case in ("forward_without_backward", "exception_in_child_forward"):
        model = _gpt(1, ws)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _gpt_step(model, opt, rank)
        if case == "forward_without_backward":
            model(torch.randint(0, 32, (2, 8)))
        else:

            def fail(*args, **kwargs):
                raise FloatingPointError("bad batch")

            model.blocks[1].mlp.forward = fail
            try:
                model(torch.randint(0, 32, (2, 8)))
            except FloatingPointError:
                pass
            del model.blocks[1].mlp.forward
        assert ck.load(path, model, opt) == {"step": 1}
        got, got_opt = full_state(model), full_optim_state(model, opt)
        results[case] = (
            all(torch.equal(expected[k], got[k]) for k in expected)
            and got_opt.keys() == expected_opt.keys()
            and all(torch.equal(expected_opt[k], got_opt[k]) for k in expected_opt)
        )
    return results


def test_load_into_unsharded_groups_restores_exactly(worlds, tmp_path):
    for results in worlds.run(2, _load_into_unsharded_groups, str(tmp_path / "c")):
        assert all(results.values()), results


def _second_save_while_pending(rank, ws, path):
    ck.save(path, shard(make_model(0), mesh_1d(ws)))
    first = shard(make_model(1), mesh_1d(ws))
    first_opt = torch.optim.AdamW(first.parameters())
    first(torch.randn(2, 16)).sum().backward()
    first_opt.step()
    expected = full_state(first)
    handle = ck.save(path, first, first_opt, extra={"which": 1}, async_save=True)
    handle._thread.join()  # this rank's files are written;
    torch.distributed.barrier()  # and every rank's: the directory is what wait() will publish
    before = _tree(path)
    refusals = []
    second = shard(make_model(2), mesh_1d(ws))
    for async_save in (False, True):
        try:
            ck.save(path, second, extra={"which": 2}, async_save=async_save)
        except ck.CheckpointError as e:
            refusals.append(str(e))
    untouched = _tree(path) == before
    handle.wait()
    handle.wait()  # idempotent after success
    loaded = shard(make_model(3), mesh_1d(ws))
    loaded_opt = torch.optim.AdamW(loaded.parameters())
    extra = ck.load(path, loaded, loaded_opt)
    got = full_state(loaded)
    return {
        "refused": len(refusals) == 2 and all("still pending" in r and "wait()" in r for r in refusals),
        "untouched": untouched,
        "extra": extra == {"which": 1},
        "published_first": all(torch.equal(expected[k], got[k]) for k in expected),
    }


def test_second_save_while_async_save_pending_is_refused(worlds, tmp_path):
    for checks in worlds.run(2, _second_save_while_pending, str(tmp_path / "c")):
        assert all(checks.values()), checks


def test_failed_async_save_fails_every_wait_and_frees_the_path(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    from fsdp2.checkpoint import safetensors_io

    def full_disk(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(safetensors_io.SafetensorsStreamWriter, "_write", full_disk)
        handle = ck.save(path, make_model(0), async_save=True)
        for _ in range(2):  # a failed save never reports success
            with pytest.raises(ck.CheckpointError, match="No space left on device"):
                handle.wait()
    ck.save(path, make_model(1))  # no longer pending
    target = make_model(5)
    ck.load(path, target)
    assert_same_state(full_state(target), full_state(make_model(1)))


def _meta_model_is_refused(rank, ws, path):
    ck.save(path, shard(make_model(0), mesh_1d(ws)))
    with torch.device("meta"):
        model = make_model(0)
    model = shard(model, mesh_1d(ws))
    try:
        ck.load(path, model)
        return "loaded"
    except ck.CheckpointError as e:
        return str(e)


def test_load_into_meta_model_raises(worlds, tmp_path):
    path = str(tmp_path / "c")
    ck.save(path, make_model(0))
    with torch.device("meta"):
        model = make_model(1)
    with pytest.raises(ck.CheckpointError, match=r"cannot load into 0\.weight: it is on the meta device.*to_empty"):
        ck.load(path, model)
    with pytest.raises(ck.CheckpointError, match=r"cannot save: 0\.weight is on the meta device"):
        ck.save(str(tmp_path / "other"), model)
    assert not os.path.exists(tmp_path / "other")
    for message in worlds.run(2, _meta_model_is_refused, str(tmp_path / "sharded")):
        assert "is on the meta device" in message, message


def _groups_without_last_layer(model):
    return [p for n, p in model.named_parameters() if not n.startswith("4.")]


@pytest.fixture
def saved_two_layers_in_optimizer(tmp_path):
    """AdamW over layers 0 and 2 only (layer 4 is frozen), saved; another model to load into."""
    model, opt = _trained(0, params=_groups_without_last_layer)
    path = str(tmp_path / "c")
    ck.save(path, model, opt, extra={"step": 1})
    target, target_opt = _trained(5, params=_groups_without_last_layer)
    return path, target, target_opt


def _state_outside_groups(m):
    m["objects"]["optimizer"]["state"]["4.weight"] = m["objects"]["optimizer"]["state"]["0.bias"]


_CRAFTED = {
    "state_for_param_outside_groups": (_state_outside_groups, r"none of the optimizer's param groups, '4\.weight'"),
    "state_for_unknown_param": (
        lambda m: m["objects"]["optimizer"]["state"].update(nope=m["objects"]["optimizer"]["state"]["0.bias"]),
        r"unknown parameter, 'nope'",
    ),
    "optimizer_type": (lambda m: m["objects"]["optimizer"].update(type="SGD"), r"holds SGD state"),
    "state_not_a_dict": (lambda m: m["objects"]["optimizer"]["state"].update({"0.bias": 5}), r"malformed"),
    "params_not_a_list": (lambda m: m["objects"]["optimizer"]["param_groups"][0].update(params=3), r"malformed"),
    "hyper_missing_tensor": (
        lambda m: m["objects"]["optimizer"]["param_groups"][0].update(lr={"__tensor__": "x"}),
        r"no tensor 'x'",
    ),
    "extra_bad_tuple": (lambda m: m["objects"].update(extra={"__tuple__": 5}), r"malformed tuple"),
    "extra_bad_items": (lambda m: m["objects"].update(extra={"__dict_items__": [[1]]}), r"malformed dict items"),
    "extra_missing_tensor": (
        lambda m: m["objects"].update(extra={"a": {"__tensor__": "extra/none"}}),
        r"no tensor 'extra/none'",
    ),
    "extra_bad_numpy": (
        lambda m: m["objects"].update(extra={"__numpy__": {"dtype": "object", "value": 1}}),
        r"malformed numpy",
    ),
    "extra_numpy_overflow": (
        lambda m: m["objects"].update(extra={"__numpy__": {"dtype": "int8", "value": 1000}}),
        r"malformed numpy scalar",
    ),
    "extra_numpy_of_bf16": (
        lambda m: (
            m["tensors"]["model/0.bias"].update(dtype="bfloat16"),
            m["objects"].update(extra={"__numpy__": {"tensor": "model/0.bias"}}),
        ),
        r"dtype bfloat16 in the checkpoint",
    ),
    "objects_too_deep": (lambda m: m["objects"].update(extra=json.loads("[" * 300 + "]" * 300)), r"nested deeper"),
    "shape_not_integer": (lambda m: m["tensors"]["model/0.bias"].update(shape=[7.5]), r"malformed"),
    "generation_infinite": (lambda m: m.update(generation=float("inf")), r"malformed"),
    "placement_for_a_mesh_dim_it_lacks": (
        lambda m: m["tensors"]["model/0.bias"].update(placements=["S(0)"]),
        r"layout of 'model/0\.bias' is malformed \(1 placements for a mesh of 0 dims\)",
    ),
    "split_past_the_tensor_dims": (
        lambda m: (
            m["meshes"].append({"shape": [1], "start": 0, "strides": [1]}),
            m["tensors"]["model/0.bias"].update(mesh=1, placements=["S(1)"]),
        ),
        r"placement S\(1\) of a tensor of 1 dims",
    ),
    "mesh_ranks_outside_the_world": (
        lambda m: m["meshes"][0].update(start=5),
        r"mesh ranks 5\.\.5 lie outside a world of 1",
    ),
    "mesh_index_unknown": (lambda m: m["tensors"]["model/0.bias"].update(mesh=7), r"names mesh 7"),
}


@pytest.mark.parametrize("case", sorted(_CRAFTED))
def test_crafted_manifest_leaves_model_and_optimizer_untouched(saved_two_layers_in_optimizer, case):
    path, target, opt = saved_two_layers_in_optimizer
    edit, match = _CRAFTED[case]
    _edit_manifest(path, edit)
    before = _snapshot(target, opt)
    with pytest.raises(ck.CheckpointError, match=match):
        ck.load(path, target, opt, verify=False)
    assert_same_state(_snapshot(target, opt), before)


def test_crafted_rank_extra_leaves_model_untouched(tmp_path):
    path = str(tmp_path / "c")
    ck.save(path, make_model(0), rank_extra={"seed": 1})
    rewrite_rank_file(_rank_file(path), lambda tensors, index: index.update(rank_extra={"__tuple__": 1}))
    target = make_model(3)
    before = full_state(target)
    with pytest.raises(ck.CheckpointError, match="malformed tuple"):
        ck.load(path, target, return_rank_extra=True)
    assert_same_state(full_state(target), before)


def _ghost(tensors, index):
    index["chunks"]["model/ghost"] = index["chunks"]["model/0.bias"]


# Rank files crafted by someone who knows the format: each header re-sealed with a correct
# checksum, so the index's own checks must catch what is wrong.
_CRAFTED_FILES = {
    "index_not_json": (lambda t, i: "{", r"fsdp2 index in its header is malformed"),
    "index_key_twice": (lambda t, i: '{"save_id":"00","chunks":{},"chunks":{}}', r"'chunks' appears twice"),
    "index_a_list": (lambda t, i: "[]", r"no 'chunks' object"),
    "entry_for_no_tensor": (_ghost, r"entry 'model/ghost' names no tensor of the file"),
    "tensor_without_entry": (
        lambda t, i: i["chunks"].pop("model/0.bias"),
        r"tensor 'model/0\.bias' of the file has no entry",
    ),
    "offsets_a_fraction": (
        lambda t, i: i["chunks"]["model/0.bias"].update(offsets=[0.5]),
        r"offsets of 'model/0\.bias' are not 1 non-negative integers",
    ),
    "offsets_negative": (
        lambda t, i: i["chunks"]["model/0.weight"].update(offsets=[-1, 0]),
        r"offsets of 'model/0\.weight' are not 2 non-negative integers",
    ),
    "block_of_no_elements": (
        lambda t, i: i["chunks"]["model/0.bias"].update(block_elems=0),
        r"block_elems of 'model/0\.bias' is not a positive integer",
    ),
    "blocks_across_rows": (
        lambda t, i: i["chunks"]["model/0.weight"].update(block_elems=17),
        r"block of 17 elements does not fit rows of 16",
    ),
    "checksums_not_hex": (
        lambda t, i: i["chunks"]["model/0.bias"].update(crc32c="zzzzzzzz"),
        r"crc32c of 'model/0\.bias' is not a string of hex digits",
    ),
    "another_save": (lambda t, i: i.update(save_id="0" * 16), r"belongs to another save \(id 0000000000000000"),
    "chunk_elsewhere": (
        lambda t, i: i["chunks"]["model/0.weight"].update(offsets=[1, 0]),
        r"the file holds the chunk at \[1, 0\], the manifest's layout puts it at \[0, 0\]",
    ),
    "rank_extra_too_deep": (
        lambda t, i: i.update(rank_extra=json.loads("[" * 300 + "]" * 300)),
        r"nested deeper than",
    ),
}


@pytest.mark.parametrize("case", sorted(_CRAFTED_FILES))
def test_crafted_rank_file_is_refused_naming_it(tmp_path, capsys, case):
    path = str(tmp_path / "c")
    ck.save(path, make_model(0), rank_extra={"seed": 1})
    edit, match = _CRAFTED_FILES[case]
    rewrite_rank_file(_rank_file(path), edit)
    target = make_model(3)
    before = full_state(target)
    for verify in (True, False):
        with pytest.raises(ck.CheckpointError, match=r"rank-00000\.safetensors.*" + match):
            ck.load(path, target, verify=verify, return_rank_extra=True)
    assert_same_state(full_state(target), before)
    assert cli.main(["verify", path]) == 1
    assert re.search(match, capsys.readouterr().out)


def test_rank_file_header_checks(tmp_path, capsys):
    """The header's own checksum: a flipped byte anywhere in it, a header whose checksum is not
    first, a plain safetensors file in a rank file's place."""
    from safetensors.torch import save_file

    path = str(tmp_path / "c")
    ck.save(path, make_model(0))
    data = _rank_file(path)
    with open(data, "rb") as f:
        original = f.read()
    length = int.from_bytes(original[:8], "little")

    def flipped():
        offset = original.index(b"block_elems") + 2
        with open(data, "r+b") as f:
            f.seek(offset)
            f.write(bytes([original[offset] ^ 0x01]))

    def seal_not_first():
        header = json.loads(original[8 : 8 + length])
        metadata = header.pop("__metadata__")
        blob = json.dumps({"__metadata__": dict(reversed(metadata.items())), **header}, separators=(",", ":"))
        blob = blob.encode() + b" " * (-len(blob) % 8)
        with open(data, "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob + original[8 + length :])

    def plain():
        save_file({k: v.detach().clone() for k, v in make_model(0).state_dict().items()}, data)

    target = make_model(3)
    for make, match in [
        (flipped, r"is corrupted \(crc32c of its header [0-9a-f]{8}"),
        (seal_not_first, r"header does not start with the fsdp2 header checksum"),
        (plain, r"has no fsdp2 index in its header"),
    ]:
        make()
        with pytest.raises(ck.CheckpointError, match=r"rank-00000\.safetensors.*" + match):
            ck.load(path, target)
        assert_same_state(full_state(target), full_state(make_model(3)))
        assert cli.main(["verify", path]) == 1
        assert re.search(match, capsys.readouterr().out), make.__name__
        with open(data, "wb") as f:
            f.write(original)
    ck.load(path, target)  # the original file loads
    assert_same_state(full_state(target), full_state(make_model(0)))


def test_rank_file_header_over_the_limit_is_refused_unread(tmp_path, capsys, monkeypatch):
    """A rank file whose header length is over the 100,000,000-byte limit (in a sparse file large
    enough to hold it) is refused by its name before its header is read."""
    path = str(tmp_path / "c")
    ck.save(path, make_model(0))
    data = _rank_file(path)
    with open(data, "r+b") as f:
        f.write((100_000_001).to_bytes(8, "little"))
    os.truncate(data, 200_000_000)  # sparse: no disk used
    reads = []
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: reads.append(n) or real_pread(fd, n, at))
    target = make_model(3)
    match = r"rank-00000\.safetensors is not a readable safetensors file \(header length 100000001 exceeds"
    for verify in (True, False):
        with pytest.raises(ck.CheckpointError, match=match):
            ck.load(path, target, verify=verify)
    assert reads and max(reads) <= 8  # the length field, nothing of the claimed header
    assert_same_state(full_state(target), full_state(make_model(3)))
    assert cli.main(["verify", path]) == 1
    assert re.search(match, capsys.readouterr().out)


def test_save_load_verify_and_export_unpickle_nothing(tmp_path, monkeypatch):
    """Nothing a checkpoint holds -- the manifest, a rank file's index, rank_extra, the optimizer's
    state -- goes through pickle on the way back in."""
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    path = str(tmp_path / "c")
    ck.save(path, model, opt, extra={"step": 3, "t": torch.arange(4)}, rank_extra={"rng": torch.arange(3)})
    for module, name in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(module, name, refuse)
    target = make_model(1)
    target_opt = torch.optim.AdamW(target.parameters())
    extra, rank_extra = ck.load(path, target, target_opt, return_rank_extra=True)
    assert extra["step"] == 3 and torch.equal(extra["t"], torch.arange(4))
    assert torch.equal(rank_extra["rng"], torch.arange(3))
    assert_same_state(full_state(target), full_state(model))
    assert ck.verify_checkpoint(path) == []
    consolidate(path, str(tmp_path / "hf"))
    ck.load_hf(str(tmp_path / "hf"), make_model(2))


# ================================================================ data and disk hygiene


def test_save_deletes_only_what_it_made(tmp_path):
    path = tmp_path / "c"
    for name in ("gen-images", "gen-000007", "gen-000009.partial"):
        (path / name).mkdir(parents=True)
        (path / name / "data.txt").write_text("user data")
    ck.save(str(path), make_model(0))
    (path / "gen-000001" / "notes.txt").write_text("notes in a generation directory")
    with pytest.warns(UserWarning, match=r"kept .*gen-000001: it holds files fsdp2 did not write"):
        ck.save(str(path), make_model(1))
    for name in ("gen-images", "gen-000007", "gen-000009.partial"):
        assert (path / name / "data.txt").read_text() == "user data"
    assert os.listdir(path / "gen-000001") == ["notes.txt"]
    assert sorted(os.listdir(path)) == [
        "gen-000001",
        "gen-000002",
        "gen-000007",
        "gen-000009.partial",
        "gen-images",
        "manifest.json",
    ]
    # A directory of the user's under the next generation's name: refused, nothing changed.
    (path / "gen-000003").mkdir()
    (path / "gen-000003" / "mine.txt").write_text("x")
    before = _tree(path)
    with pytest.raises(ck.CheckpointError, match=r"gen-000003 exists and holds files fsdp2 did not write"):
        ck.save(str(path), make_model(2))
    assert _tree(path) == before
    target = make_model(4)
    ck.load(str(path), target)
    assert_same_state(full_state(target), full_state(make_model(1)))


_writes_of_rank: dict = {}


def _disk_full(rank, ws, path):
    """Rank 1 runs out of disk mid-file; then rank 0 runs out writing the manifest."""
    from fsdp2.checkpoint import directory, safetensors_io

    ck.save(path, shard(make_model(0), mesh_1d(ws)))
    model = shard(make_model(1), mesh_1d(ws))
    writer_cls = safetensors_io.SafetensorsStreamWriter
    original_write, original_durably = writer_cls._write, directory.write_durably

    def half_then_full(self, data):
        if self.size == 0:
            return original_write(self, data)  # the header fits
        self._file.write(bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    def manifest_full(target, text):
        if target.endswith("manifest.json.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original_durably(target, text)

    messages, listings = [], []
    for stage in ("rank file", "manifest"):
        if stage == "rank file" and rank == 1:
            writer_cls._write = half_then_full
        if stage == "manifest" and rank == 0:
            directory.write_durably = manifest_full
        try:
            ck.save(path, model)
            messages.append("saved")
        except ck.CheckpointError as e:
            messages.append(str(e))
        finally:
            writer_cls._write, directory.write_durably = original_write, original_durably
        listings.append(sorted(os.listdir(path)))  # rank 0 cleaned up before it raised
    open_files = [
        os.readlink(f"/proc/self/fd/{fd}")
        for fd in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{fd}")
    ]
    loaded = shard(make_model(7), mesh_1d(ws))
    ck.load(path, loaded)
    return {
        "messages": messages,
        "listings": listings if rank == 0 else None,
        "open_in_checkpoint": [f for f in open_files if path in f],
        "state": full_state(loaded),
    }


def test_disk_full_cleans_up_and_every_rank_names_the_reason(worlds, tmp_path):
    path = str(tmp_path / "c")
    results = worlds.run(2, _disk_full, path)
    for rank, r in enumerate(results):
        rank_file, manifest = r["messages"]
        assert "failed on rank 1" in rank_file and "No space left on device" in rank_file, (rank, rank_file)
        assert "failed on rank 0" in manifest and "No space left on device" in manifest, (rank, manifest)
        assert "None" not in manifest
        assert r["open_in_checkpoint"] == [], r["open_in_checkpoint"]  # the partial file was closed
        assert_same_state(r["state"], full_state(make_model(0)))  # the previous checkpoint is intact
    assert results[0]["listings"] == [["gen-000001", "manifest.json"]] * 2  # partial data deleted


def _write_lock(path, **record):
    with open(os.path.join(path, lock.LOCK_NAME), "w") as f:
        json.dump(record, f)


def test_lock_held_by_a_live_process_refuses_and_a_dead_ones_is_taken_over(tmp_path):
    path = str(tmp_path / "c")
    ck.save(path, make_model(0))
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(
            path, host=socket.gethostname(), pid=holder.pid, start=lock._process_start(holder.pid), token="theirs"
        )
        before = _tree(path)
        with pytest.raises(
            ck.CheckpointError,
            match=rf"another save into .* is in progress \(pid {holder.pid} on "
            r"host .*two jobs cannot save into one checkpoint directory",
        ):
            ck.save(path, make_model(1))
        assert _tree(path) == before
    finally:
        holder.kill()
        holder.wait()
    ck.save(path, make_model(1))  # its holder died: stale, taken over, and released after the save
    assert sorted(os.listdir(path)) == ["gen-000002", "manifest.json"]


def test_lock_from_another_host_expires_after_its_lease(tmp_path):
    path = str(tmp_path / "c")
    ck.save(path, make_model(0))
    _write_lock(path, host="another-host", pid=1, start=None, token="theirs")
    with pytest.raises(ck.CheckpointError, match=r"pid 1 on host another-host"):
        ck.save(path, make_model(1))
    old = time.time() - lock.LEASE_S - 5
    os.utime(os.path.join(path, lock.LOCK_NAME), (old, old))  # its holder stopped refreshing it
    ck.save(path, make_model(1))
    assert not os.path.exists(os.path.join(path, lock.LOCK_NAME))


_pending_in_rank: dict = {}


def _start_async_save(rank, ws, path):
    _pending_in_rank["handle"] = ck.save(path, shard(make_model(0), mesh_1d(ws)), async_save=True)


def _save_from_another_job(rank, ws, path):
    try:
        ck.save(path, make_model(9))
        return "saved"
    except ck.CheckpointError as e:
        return str(e)


def _finish_async_save(rank, ws, path):
    _pending_in_rank.pop("handle").wait()
    loaded = shard(make_model(5), mesh_1d(ws))
    ck.load(path, loaded)
    return full_state(loaded)


def test_two_jobs_saving_into_one_directory(worlds, tmp_path):
    path = str(tmp_path / "c")
    worlds.run(2, _start_async_save, path)  # job A: its save holds the lock until wait()
    message = worlds.run(1, _save_from_another_job, path)[0]  # job B: another process
    assert "another save into" in message and "is in progress" in message, message
    assert_same_state(worlds.run(2, _finish_async_save, path)[0], full_state(make_model(0)))
    assert not os.path.exists(os.path.join(path, lock.LOCK_NAME))


# ================================================================ untrusted input


def _rank_file(path, rank=0):
    return os.path.join(path, "gen-000001", f"rank-{rank:05d}.safetensors")


def _untrusted(tmp_path, kind, old_format=False):
    """A saved checkpoint whose rank file is replaced by ``kind`` (a format-2 one: listed with size 0
    and an empty checksum)."""
    path = str(tmp_path / "c")
    if old_format:
        shutil.copytree(V2_FIXTURE, path)
    else:
        ck.save(path, make_model(0))
    rel = "gen-000001/rank-00000.safetensors"
    data = os.path.join(path, rel)
    outside = tmp_path / "outside.safetensors"
    os.replace(data, outside)
    if kind == "fifo":
        os.mkfifo(data)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", data)
    else:  # a valid file, but outside the checkpoint
        os.symlink(outside, data)
    if kind != "outside" and old_format:

        def empty(m):
            m["files"][rel] = {"size": 0, "header_crc32c": "00000000"}

        _edit_manifest(path, empty)
    return path


@pytest.mark.parametrize(
    "kind,match",
    [
        ("fifo", "is a FIFO, not a regular file"),
        ("dev_zero", "outside the checkpoint directory"),
        ("outside", "outside the checkpoint directory"),
    ],
)
@pytest.mark.parametrize("old_format", [False, True])
def test_non_regular_or_outside_files_are_refused(tmp_path, capsys, kind, match, old_format):
    path = _untrusted(tmp_path, kind, old_format)
    target = make_model(3)
    before = full_state(target)
    with _deadline(20):
        for verify in (True, False):
            with pytest.raises(ck.CheckpointError, match=match):
                ck.load(path, target, verify=verify)
        assert_same_state(full_state(target), before)
        assert cli.main(["verify", path]) == 1
        assert match in capsys.readouterr().out
        for flags in ([], ["--no-verify"]):
            assert cli.main(["consolidate", path, str(tmp_path / "out"), *flags]) == 2
            assert match in capsys.readouterr().err


def test_manifest_that_is_a_fifo_is_refused(tmp_path, capsys):
    path = tmp_path / "c"
    path.mkdir()
    os.mkfifo(path / "manifest.json")
    with _deadline(20):
        assert cli.main(["inspect", str(path)]) == 2
    assert "manifest.json is a FIFO" in capsys.readouterr().err


_MALFORMED = {
    "generation_1e400": lambda t: t.replace('"generation": 1,', '"generation": 1e400,'),
    "world_size_negative": lambda t: t.replace('"world_size": 1,', '"world_size": -1,'),
    # A verify that walked every rank file of this world would never end: refused first.
    "world_size_huge": lambda t: t.replace('"world_size": 1,', '"world_size": 1000000000,'),
    "deep_nesting": lambda t: t.replace('"objects": {', '"objects": {"x": ' + "[" * 100000 + "]" * 100000 + ", ", 1),
    "nesting_under_json_limit": lambda t: t.replace(
        '"objects": {', '"objects": {"x": ' + "[" * 500 + "]" * 500 + ", ", 1
    ),
    "shape_1e400": lambda t: t.replace('"shape":[7,16]', '"shape":[1e400,16]', 1),
    "meshes_numbers": lambda t: json.dumps({**json.loads(t), "meshes": [5]}),
    "mesh_start_negative": lambda t: t.replace('"start":0', '"start":-1', 1),
    "mesh_strides_missing": lambda t: t.replace(',"strides":[]', "", 1),
    "mesh_ranks_miscounted": lambda t: t.replace('"start":0,"strides":[]', '"ranks":[0]', 1).replace(
        '"shape":[]', '"shape":[2]', 1
    ),
    "placement_unknown": lambda t: t.replace('"placements":[]', '"placements":["P(0)"]', 1),
    "save_id_a_number": lambda t: t.replace('"save_id": "', '"save_id": 7, "x": "', 1),
    "rank_extra_a_string": lambda t: t.replace('"rank_extra": false', '"rank_extra": "yes"', 1),
    "not_an_object": lambda t: "[]",
    "truncated": lambda t: t[: len(t) // 2],
    "optimizer_a_number": lambda t: json.dumps({**json.loads(t), "objects": {"optimizer": 5}}),
    "param_groups_numbers": lambda t: json.dumps(
        {**json.loads(t), "objects": {"optimizer": {"state": {}, "param_groups": [5]}}}
    ),
    "unknown_dtype": lambda t: t.replace('"dtype":"float32"', '"dtype":"float128"', 1),
    "tied_weights_malformed": lambda t: json.dumps({**json.loads(t), "objects": {"tied_weights": 5}}),
}
# Format 2 lists files and chunks in the manifest (a copy of tests/data/ckpt_v2 is edited).
_MALFORMED_V2 = {
    "files_a_list": lambda t: json.dumps({**json.loads(t), "files": []}),
    "negative_offset": lambda t: t.replace('"offsets":[0,0]', '"offsets":[-1,0]', 1),
    "crc_a_number": lambda t: t.replace('"header_crc32c":"', '"header_crc32c":7,"x":"', 1),
    "block_crc_a_number": lambda t: t.replace('"crc32c":"', '"crc32c":7,"x":"', 1),
}


_MALFORMED_OBJECTS = {"optimizer_a_number", "param_groups_numbers", "tied_weights_malformed"}


@pytest.mark.parametrize("case", sorted(_MALFORMED) + [f"v2:{c}" for c in sorted(_MALFORMED_V2)])
def test_cli_reports_malformed_manifests_without_traceback(tmp_path, capsys, case):
    path = str(tmp_path / "c")
    if case.startswith("v2:"):
        shutil.copytree(V2_FIXTURE, path)
        edit = _MALFORMED_V2[case[3:]]
    else:
        ck.save(path, make_model(0))
        edit = _MALFORMED[case]
    manifest = os.path.join(path, "manifest.json")
    with open(manifest) as f:
        text = f.read()
    broken = edit(text)
    assert broken != text
    with open(manifest, "w") as f:
        f.write(broken)
    codes = {}
    with _deadline(60):
        for i, command in enumerate((["inspect"], ["verify"], ["consolidate", "--no-verify"], ["consolidate"])):
            args = [
                command[0],
                path,
                *([str(tmp_path / f"out{i}")] if command[0] == "consolidate" else []),
                *command[1:],
            ]
            codes[" ".join(command)] = cli.main(args)  # an exception escaping here is the traceback
    if case not in _MALFORMED_OBJECTS:  # verify checks files and tensors, not the optimizer's JSON
        assert codes["verify"] == 1 and codes["consolidate"] == 2, codes
    err = capsys.readouterr().err
    assert all(line.startswith("error: ") for line in err.splitlines() if line), err


def test_cli_subprocess_prints_one_error_line_for_1e400(tmp_path):
    path = str(tmp_path / "c")
    ck.save(path, make_model(0))
    manifest = os.path.join(path, "manifest.json")
    with open(manifest) as f:
        text = f.read()
    with open(manifest, "w") as f:
        f.write(text.replace('"generation": 1,', '"generation": 1e400,'))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(ck.__file__))}
    result = subprocess.run(
        [sys.executable, "-m", "fsdp2.checkpoint", "inspect", path],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr, result.stderr


# ================================================================ semantics users expect


def _with_new_head(seed):
    """make_model plus a new layer: a base checkpoint + new head fine-tuning setup."""
    base = make_model(seed)
    return nn.Sequential(*base, nn.ReLU(), nn.Linear(3, 2))


def test_strict_false_loads_the_base_and_reports_missing_keys(tmp_path):
    path = str(tmp_path / "c")
    ck.save(path, make_model(0), extra={"step": 4})
    model = _with_new_head(1)
    new_head = {k: v.clone() for k, v in model[6].state_dict().items()}
    before = full_state(model)
    with pytest.raises(ck.CheckpointError, match=r"no tensor 'model/6\.weight' \(and 1 more.*strict=False"):
        ck.load(path, model)
    assert_same_state(full_state(model), before)
    stats = ck.LoadStats()
    with pytest.warns(UserWarning, match=r"no value for 2 model key\(s\).*'6\.weight', '6\.bias'"):
        assert ck.load(path, model, strict=False, stats=stats) == {"step": 4}
    assert stats.missing_keys == ["6.weight", "6.bias"] and stats.unexpected_keys == []
    got = full_state(model)
    for k, v in full_state(make_model(0)).items():
        assert torch.equal(got[k], v), k
    assert all(torch.equal(got[f"6.{k}"], v) for k, v in new_head.items())  # left as it was
    # The other way round: checkpoint keys the model lacks are ignored and reported.
    bigger = str(tmp_path / "bigger")
    ck.save(bigger, _with_new_head(2))
    small = make_model(3)
    ck.load(bigger, small, strict=False, stats=stats)
    assert stats.unexpected_keys == ["6.bias", "6.weight"] and stats.missing_keys == []


def test_optimizer_of_another_type_is_refused(tmp_path):
    path = str(tmp_path / "c")
    model, opt = _trained(0)
    ck.save(path, model, opt)
    target, target_opt = _trained(1, opt_cls=lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9))
    before = _snapshot(target, target_opt)
    with pytest.raises(ck.CheckpointError, match=r"holds AdamW state but the optimizer is a SGD.*optimizer=None"):
        ck.load(path, target, target_opt)
    assert_same_state(_snapshot(target, target_opt), before)


def test_numpy_extras_roundtrip_without_pickle(tmp_path):
    path = str(tmp_path / "c")
    np.random.seed(7)
    np.random.rand(3)
    extra = {
        "np_rng": np.random.get_state(),  # ('MT19937', uint32[624], int, int, float)
        "scalars": [
            np.float32(1.5),
            np.float16(-2.25),
            np.float64(0.1),
            np.int64(-3),
            np.uint32(2**32 - 1),
            np.uint64(2**64 - 1),
            np.int8(-128),
            np.bool_(True),
        ],
        "arrays": {
            "f16": np.arange(6, dtype=np.float16).reshape(2, 3),
            "bool": np.array([True, False]),
            "big_endian": np.arange(4, dtype=">i4"),
            "scalar_array": np.array(3.5),
            "strided": np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2],
            "empty": np.zeros((0, 2)),
        },
        "generator": np.random.default_rng(3).bit_generator.state,  # dict with 128-bit Python ints
    }
    ck.save(path, make_model(0), extra=extra)
    with open(os.path.join(path, "manifest.json")) as f:
        assert '"__numpy__"' in f.read()
    got = ck.load(path, make_model(1))
    assert got["np_rng"][0] == "MT19937" and got["np_rng"][1].dtype == np.uint32
    np.random.set_state(got["np_rng"])
    after_restore = np.random.rand(5)
    np.random.set_state(extra["np_rng"])
    assert np.array_equal(after_restore, np.random.rand(5))
    for want, have in zip(extra["scalars"], got["scalars"]):
        assert type(have) is type(want) and have == want, (want, have)
    for key, want in extra["arrays"].items():
        have = got["arrays"][key]
        assert isinstance(have, np.ndarray) and have.dtype.name == want.dtype.name, key
        assert have.shape == want.shape and np.array_equal(have, want), key
    assert got["generator"] == extra["generator"]


@pytest.mark.parametrize(
    "value,match",
    [
        (np.array([object()]), r"extra/x: cannot store a numpy array of dtype object without pickle"),
        (np.array(["a"]), r"dtype <U1"),
        (np.complex64(1j), r"numpy scalar of dtype complex64"),
        (
            np.array([1], dtype=np.float128) if hasattr(np, "float128") else np.array([1j]),
            r"cannot store a numpy array",
        ),
    ],
)
def test_unstorable_numpy_extras_are_refused(tmp_path, value, match):
    with pytest.raises(ck.CheckpointError, match=match):
        ck.save(str(tmp_path / "c"), make_model(0), extra={"x": value})
    assert not os.path.exists(tmp_path / "c")


def _save_rank_extra(rank, ws, path):
    torch.manual_seed(100 + rank)
    np.random.seed(rank)
    rank_extra = {"rank": rank, "torch_rng": torch.get_rng_state(), "np_rng": np.random.get_state()}
    draws = torch.rand(3), np.random.rand(3)  # what each rank draws after restoring its states
    ck.save(path, shard(make_model(0), mesh_1d(ws)), extra={"step": 5}, rank_extra=rank_extra)
    return draws


def _load_rank_extra(rank, ws, path):
    model = shard(make_model(1), mesh_1d(ws))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra, mine = ck.load(path, model, return_rank_extra=True)
    draws = None
    if mine is not None:
        torch.set_rng_state(mine["torch_rng"])
        np.random.set_state(mine["np_rng"])
        draws = (torch.rand(3), np.random.rand(3))
    return {
        "extra": extra,
        "rank": None if mine is None else mine["rank"],
        "draws": draws,
        "warnings": [str(w.message) for w in caught],
        "plain": ck.load(path, model),
    }


def test_rank_extra_comes_back_to_its_rank(worlds, tmp_path):
    path = str(tmp_path / "c")
    expected = worlds.run(2, _save_rank_extra, path)
    for rank, r in enumerate(worlds.run(2, _load_rank_extra, path)):
        assert r["extra"] == r["plain"] == {"step": 5} and r["rank"] == rank and not r["warnings"]
        assert torch.equal(r["draws"][0], expected[rank][0]) and np.array_equal(r["draws"][1], expected[rank][1])
    # Another world size: ranks cannot be matched, so None and a warning (the global extra still loads).
    for r in worlds.run(3, _load_rank_extra, path):
        assert r["extra"] == {"step": 5} and r["rank"] is None
        assert any("saved by 2 ranks and is loaded by 3" in w for w in r["warnings"]), r["warnings"]


# ================================================================ a consolidated export that loads


class _HFStyle(nn.Module):
    """Hugging Face (Llama) state-dict names: model.embed_tokens, model.layers.N..., lm_head tied."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(32, 8)
        self.model.layers = nn.ModuleList(
            nn.ModuleDict({"up_proj": nn.Linear(8, 16, bias=False), "down_proj": nn.Linear(16, 8, bias=False)})
            for _ in range(2)
        )
        self.model.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 32, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


def _save_hf_style(rank, ws, path):
    from fsdp2 import fully_shard

    model = _HFStyle(0)
    for layer in model.model.layers:  # a ModuleDict has no forward: its modules form the group
        fully_shard(list(layer.values()), mesh=mesh_1d(ws))
    fully_shard(model, mesh=mesh_1d(ws))
    ck.save(path, model)
    return full_state(model)


def _read_export(out):
    from safetensors import safe_open

    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    tensors = {}
    for name, fname in index["weight_map"].items():
        with safe_open(str(out / fname), framework="pt") as f:
            tensors[name] = f.get_tensor(name)
    return index, tensors


def test_consolidate_writes_a_hugging_face_folder(worlds, tmp_path):
    path = str(tmp_path / "c")
    reference = worlds.run(2, _save_hf_style, path)[0]
    source = tmp_path / "hf_model"
    source.mkdir()
    (source / "config.json").write_text(
        json.dumps({"model_type": "llama", "tie_word_embeddings": True, "torch_dtype": "float32"})
    )
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    (source / "tokenizer_config.json").write_text("{}")
    (source / "model.safetensors").write_text("old weights: never copied")
    out = tmp_path / "out"
    assert (
        cli.main(
            ["consolidate", path, str(out), "--config", str(source), "--dtype", "bf16", "--max-shard-size", "800B"]
        )
        == 0
    )
    index, tensors = _read_export(out)
    # the tied head is written once, under the embedding's name, as save_pretrained does
    assert sorted(tensors) == sorted(k for k in reference if k != "lm_head.weight")
    for name, value in tensors.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, reference[name].to(torch.bfloat16)), name
    assert len(set(index["weight_map"].values())) > 1
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in tensors.values())
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert sorted(os.listdir(out)) == sorted(
        [
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors.index.json",
            *set(index["weight_map"].values()),
        ]
    )
    # a config file instead of a folder, and fp32 stays as saved
    out2 = tmp_path / "out2"
    consolidate(path, str(out2), config=str(source / "config.json"))
    assert json.loads((out2 / "config.json").read_text())["torch_dtype"] == "float32"
    assert torch.equal(_read_export(out2)[1]["model.norm.weight"], reference["model.norm.weight"])


def test_consolidate_refuses_a_folder_with_other_weights_unless_overwrite(tmp_path, capsys):
    path = str(tmp_path / "c")
    ck.save(path, make_model(0))
    out = tmp_path / "out"
    assert cli.main(["consolidate", path, str(out), "--max-shard-size", "300B"]) == 0
    assert "pass --config" in capsys.readouterr().out
    (out / "README.md").write_text("mine")
    before = _tree(out)
    ck.save(path, make_model(1))
    assert cli.main(["consolidate", path, str(out)]) == 2
    assert "already holds weight files" in capsys.readouterr().err and _tree(out) == before
    assert cli.main(["consolidate", path, str(out), "--overwrite", "--dtype", "fp16"]) == 0
    index, tensors = _read_export(out)
    assert sorted(os.listdir(out)) == [
        "README.md",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]  # the old shards are gone
    for k, v in full_state(make_model(1)).items():
        assert torch.equal(tensors[k], v.half()), k
    with pytest.raises(ck.CheckpointError, match="inside the checkpoint"):
        consolidate(path, os.path.join(path, "export"))
    with pytest.raises(ck.CheckpointError, match="unknown dtype 'int4'"):
        consolidate(path, str(tmp_path / "o3"), dtype="int4")
    with pytest.raises(ck.CheckpointError, match="has no config.json"):
        consolidate(path, str(tmp_path / "o3"), config=str(tmp_path))
    assert not os.path.exists(tmp_path / "o3")


def test_inspect_says_when_a_folder_is_not_a_checkpoint(tmp_path, capsys):
    ck.save(str(tmp_path / "c"), make_model(0))
    consolidate(str(tmp_path / "c"), str(tmp_path / "hf"))
    assert cli.main(["inspect", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "is not an fsdp2 checkpoint" in err and "Hugging Face" in err and "interrupted" not in err
    os.remove(tmp_path / "c" / "manifest.json")  # this one really is an interrupted save
    assert cli.main(["inspect", str(tmp_path / "c")]) == 2
    assert "A save was probably interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("tied", [True, False])
def test_from_pretrained_loads_the_export(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = str(tmp_path / "c")
    ck.save(path, model)
    source = tmp_path / "source"
    config.save_pretrained(source)
    out = tmp_path / "out"
    assert cli.main(["consolidate", path, str(out), "--config", str(source)]) == 0
    _, tensors = _read_export(out)
    assert ("lm_head.weight" in tensors) == (not tied)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert_same_state(dict(loaded.state_dict()), dict(model.state_dict()))
    tokens = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


# ================================================================ fault and misuse probe


def _make_lock_hazard(path: str, kind: str) -> None:
    """Put ``kind`` where the save lock goes: what a probe (or a careless user) leaves there."""
    lock_path = os.path.join(path, lock.LOCK_NAME)
    if kind == "fifo":
        os.mkfifo(lock_path)
    elif kind == "link_to_fifo":
        os.mkfifo(os.path.join(os.path.dirname(path), "fifo"))
        os.symlink(os.path.join(os.path.dirname(path), "fifo"), lock_path)
    elif kind == "link_to_dev_zero":
        os.symlink("/dev/zero", lock_path)
    elif kind == "dangling_link":
        os.symlink(os.path.join(os.path.dirname(path), "nowhere"), lock_path)


_LOCK_HAZARDS = {
    "fifo": "is a FIFO, not a regular file",
    "link_to_fifo": "is a symbolic link",
    "link_to_dev_zero": "is a symbolic link",
    "dangling_link": r"is a symbolic link \(to .*nowhere\)",
}

_SAVE_WITH_LOCK_HAZARDS = """
import json
import fsdp2.checkpoint as ck
from tests.checkpoint.ckpt_helpers import make_model
messages = []
for path in {paths!r}:
    try:
        ck.save(path, make_model(1))
        messages.append("saved")
    except ck.CheckpointError as e:
        messages.append(str(e))
print(json.dumps(messages))
"""


def test_save_refuses_a_lock_that_is_not_a_regular_file(tmp_path):
    kinds = sorted(_LOCK_HAZARDS)
    paths = [str(tmp_path / kind / "c") for kind in kinds]
    for kind, path in zip(kinds, paths):
        ck.save(path, make_model(0))
        _make_lock_hazard(path, kind)
    before = [exact_tree(path) for path in paths]
    result = isolated(_SAVE_WITH_LOCK_HAZARDS.format(paths=paths), timeout=90)  # one interpreter: torch imports once
    assert result.returncode == 0, result.stderr[-2000:]
    messages = json.loads(result.stdout.splitlines()[-1])
    for kind, path, message, tree in zip(kinds, paths, messages, before):
        assert re.search(_LOCK_HAZARDS[kind], message), (kind, message)
        assert "delete it and save again" in message and "at the same moment" not in message, message
        assert exact_tree(path) == tree, kind
        loaded = make_model(5)
        ck.load(path, loaded)  # the published checkpoint is still the first one
        assert_same_state(full_state(loaded), full_state(make_model(0)))


def _save_with_fifo_lock(rank, ws, path):
    model = shard(make_model(1), mesh_1d(ws))
    try:
        ck.save(path, model)
        return "saved"
    except ck.CheckpointError as e:
        return str(e)


def test_fifo_lock_fails_every_rank_instead_of_hanging(worlds, tmp_path):
    path = str(tmp_path / "c")
    os.makedirs(path)
    _make_lock_hazard(path, "fifo")
    messages = worlds.run(2, _save_with_fifo_lock, path, timeout=60)
    assert all("is a FIFO, not a regular file" in m for m in messages), messages


def test_manifest_that_is_not_utf8_is_one_error_line(tmp_path, capsys):
    path = str(tmp_path / "c")
    ck.save(path, make_model(0))
    manifest = os.path.join(path, "manifest.json")
    with open(manifest, "rb") as f:
        raw = f.read()
    with open(manifest, "wb") as f:
        f.write(raw.replace(b'"generation"', b'"gen\xff\xfeeration"', 1))
    before = exact_tree(path)
    for command in (
        ["inspect", path],
        ["consolidate", path, str(tmp_path / "o1")],
        ["consolidate", path, str(tmp_path / "o2"), "--no-verify"],
    ):
        assert cli.main(command) == 2, command  # an exception escaping here is the traceback
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
        assert "manifest.json is not UTF-8 text" in err, err
    assert cli.main(["verify", path]) == 1  # a problem found, as for every malformed manifest
    assert "FAIL " in capsys.readouterr().out
    target = make_model(3)
    state = full_state(target)
    with pytest.raises(ck.CheckpointError, match="manifest.json is not UTF-8 text"):
        ck.load(path, target)
    assert_same_state(full_state(target), state)
    assert exact_tree(path) == before and not os.path.exists(tmp_path / "o1")


def test_consolidate_overwrite_replaces_links_instead_of_writing_through_them(tmp_path, capsys):
    """A Hugging Face snapshot folder is symlinks into blobs/: --overwrite must not change the blobs."""
    other = str(tmp_path / "other")
    ck.save(other, make_model(7))  # another checkpoint, whose files the links point at
    path = str(tmp_path / "c")
    ck.save(path, make_model(0))
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "mlp"}')
    out = tmp_path / "snapshot"
    out.mkdir()
    rank_file = next(p for p in (tmp_path / "other").rglob("rank-*.safetensors"))
    with open(os.path.join(other, "manifest.json")) as f:
        manifest_text = f.read()
    victims = {
        "model-00001-of-00001.safetensors": rank_file,
        "model.safetensors.index.json": tmp_path / "other" / "manifest.json",
        "config.json": tmp_path / "blob-config.json",
    }
    (tmp_path / "blob-config.json").write_text('{"model_type": "blob"}')
    for name, target in victims.items():
        os.symlink(target, out / name)
    before = {name: open(target, "rb").read() for name, target in victims.items()}
    assert cli.main(["consolidate", path, str(out), "--overwrite", "--config", str(config)]) == 0
    capsys.readouterr()
    for name, target in victims.items():
        assert open(target, "rb").read() == before[name], f"{target} was written through the link {name}"
        assert not os.path.islink(out / name) and os.path.isfile(out / name), name
    assert cli.main(["verify", other]) == 0 and open(os.path.join(other, "manifest.json")).read() == manifest_text
    _, tensors = _read_export(out)
    assert_same_state(tensors, full_state(make_model(0)))
    assert json.loads((out / "config.json").read_text()) == {"model_type": "mlp"}
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


def test_dropped_async_save_handle_can_be_found_and_waited_on(tmp_path):
    path = str(tmp_path / "c")
    ck.save(path, make_model(0))
    ck.save(path, make_model(1), async_save=True)  # the handle is dropped at once
    import gc

    gc.collect()
    with pytest.raises(ck.CheckpointError, match=r"still pending.*pending_save\(path\) returns the handle"):
        ck.save(path, make_model(2))
    handle = ck.pending_save(tmp_path / "c")
    assert handle is not None and ck.pending_save(str(tmp_path / "elsewhere")) is None
    handle.wait()
    assert ck.pending_save(path) is None
    loaded = make_model(5)
    ck.load(path, loaded)
    assert_same_state(full_state(loaded), full_state(make_model(1)))  # the dropped save was published
    ck.save(path, make_model(2))  # and the path is free again


_EXIT_WITH_A_PENDING_SAVE = """
import fsdp2.checkpoint as ck
from tests.checkpoint.ckpt_helpers import make_model
ck.save({path!r}, make_model(0))
handle = ck.save({path!r}, make_model(1), async_save=True)
print("exiting")
"""


def test_exit_with_a_pending_async_save_warns(tmp_path):
    path = str(tmp_path / "c")
    result = isolated(_EXIT_WITH_A_PENDING_SAVE.format(path=path))
    assert result.returncode == 0 and "exiting" in result.stdout, result.stderr[-2000:]
    assert f"the async save to {path} was never waited on, so it was not published" in result.stderr, result.stderr
    loaded = make_model(5)
    ck.load(path, loaded)  # the previous checkpoint is intact
    assert_same_state(full_state(loaded), full_state(make_model(0)))
