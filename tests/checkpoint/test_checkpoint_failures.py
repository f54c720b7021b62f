"""Crashes during save, damaged checkpoints and mismatched models.

Single-process cases run in the pytest process itself (no process group: the
checkpoint code then acts as a 1-rank job); rank crashes use the shared worlds.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

import fsdp2.checkpoint as ck
from tests.checkpoint.ckpt_helpers import (
    V2_FIXTURE,
    assert_same_state,
    full_state,
    load_outcome,
    make_model,
    mesh_1d,
    rewrite_rank_file,
    shard,
)


def _snapshot(model, opt):
    state = {f"opt/{i}/{k}": v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    return {**full_state(model), **state}


_EXPECTED: dict = {}  # path -> state the fixture saved


@pytest.fixture
def saved(tmp_path):
    """A checkpoint of a trained model + AdamW, and a different model/optimizer to load into."""
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    path = str(tmp_path / "c")
    ck.save(path, model, opt, extra={"step": 1})
    target = make_model(5)
    target_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    target(torch.randn(2, 16)).sum().backward()
    target_opt.step()
    _EXPECTED[path] = full_state(model)
    return path, target, target_opt


def _data_file(path):
    return os.path.join(path, "gen-000001", "rank-00000.safetensors")


def _expect_failure(path, model, opt, match, **kw):
    before = _snapshot(model, opt)
    with pytest.raises(ck.CheckpointError, match=match):
        ck.load(path, model, opt, **kw)
    assert_same_state(_snapshot(model, opt), before)  # nothing was modified


def test_roundtrip_in_process(saved):
    path, target, opt = saved
    assert ck.load(path, target, opt) == {"step": 1}
    assert_same_state(full_state(target), _EXPECTED[path])


def test_missing_manifest(saved):
    path, target, opt = saved
    os.remove(os.path.join(path, "manifest.json"))
    _expect_failure(path, target, opt, r"manifest\.json is missing.*not a complete checkpoint")


def test_corrupted_bytes(saved):
    path, target, opt = saved
    data = _data_file(path)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) - 7)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    _expect_failure(path, target, opt, r"rank-00000\.safetensors is corrupted \(crc32")


def test_truncated_file(saved):
    path, target, opt = saved
    data = _data_file(path)
    os.truncate(data, os.path.getsize(data) - 100)
    _expect_failure(path, target, opt, r"rank-00000\.safetensors is not a readable .* it is truncated", verify=False)


def test_key_missing_from_file(saved):
    path, target, opt = saved

    def rename(tensors, index):
        tensors["model/renamed"] = tensors.pop("model/2.weight")
        index["chunks"]["model/renamed"] = index["chunks"].pop("model/2.weight")

    rewrite_rank_file(_data_file(path), rename)
    _expect_failure(path, target, opt, r"rank-00000\.safetensors, key 'model/2\.weight': missing from the file")


def test_manifest_cannot_point_outside_the_checkpoint(tmp_path):
    # Format 2 names its files in the manifest (format 3 builds their names from integers).
    path = str(tmp_path / "v2")
    shutil.copytree(V2_FIXTURE, path)
    target = make_model(5)
    opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    target(torch.randn(2, 16)).sum().backward()
    opt.step()
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path) as f:
        text = f.read()
    with open(manifest_path, "w") as f:
        f.write(text.replace('"gen-000001/rank-00000.safetensors"', '"../../etc/passwd"'))
    _expect_failure(path, target, opt, r"file '../../etc/passwd' outside the checkpoint directory")


def test_model_has_key_the_checkpoint_lacks(saved):
    path, target, opt = saved
    target.register_buffer("new_buffer", torch.zeros(3))
    _expect_failure(path, target, opt, r"no tensor 'model/new_buffer'")


def test_shape_mismatch(saved, tmp_path):
    path, _, _ = saved
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3))
    _expect_failure(
        path,
        model,
        torch.optim.AdamW(model.parameters()),
        r"'model/0.weight' has shape \[7, 16\] in the checkpoint but \[8, 16\]",
    )


def test_dtype_mismatch(saved):
    path, target, opt = saved
    target.double()
    _expect_failure(path, target, opt, r"'model/0.weight' has dtype float32 in the checkpoint but torch.float64")


def test_optimizer_group_mismatch_says_where_each_parameter_was_and_leaves_model_untouched(saved):
    path, target, _ = saved
    params = list(target.parameters())
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    _expect_failure(
        path,
        target,
        opt,
        r"optimizer param groups differ from the saved ones: saved 1 param group, now 2: "
        r"'2\.bias' \(saved in group 0, now in 1\)",
    )


def _named(*names: str) -> nn.Module:
    """Linear layers 16 -> 16 under ``names`` (one weight and bias each)."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict((name, nn.Linear(16, 16)) for name in names))


def _saved_with_adamw(model: nn.Module, path: str) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    ck.save(path, model, opt)


@pytest.mark.parametrize(
    "saved_names, now_names, message",
    [
        (
            ("body", "out"),
            ("body", "head"),
            r"optimizer param groups differ from the saved ones: 2 saved parameters are in none of the "
            r"optimizer's groups \('out\.bias', 'out\.weight'\), 2 of the optimizer's parameters are not in "
            r"the checkpoint \('head\.bias', 'head\.weight'\)",
        ),
        (
            tuple(f"block{i}" for i in range(5)),
            tuple(f"layer{i}" for i in range(5)),
            r"10 saved parameters are in none of the optimizer's groups "
            r"\('block0\.bias', 'block0\.weight', 'block1\.bias', \.\.\.\), "
            r"10 of the optimizer's parameters are not in the checkpoint "
            r"\('layer0\.bias', 'layer0\.weight', 'layer1\.bias', \.\.\.\)",
        ),
    ],
    ids=["renamed-module", "a-few-of-many"],
)
def test_optimizer_groups_holding_other_parameters_name_them(tmp_path, saved_names, now_names, message):
    """A renamed module (out -> head) gives groups of equal size: the error names the parameters
    the optimizer lacks and the ones the checkpoint lacks (a few of each, with their counts), even
    with strict=False."""
    path = str(tmp_path / "c")
    _saved_with_adamw(_named(*saved_names), path)
    target = _named(*now_names)
    _expect_failure(path, target, torch.optim.AdamW(target.parameters()), message, strict=False)


def test_unstorable_extra_is_refused(tmp_path):
    with pytest.raises(ck.CheckpointError, match=r"extra/when: cannot store a object"):
        ck.save(str(tmp_path / "c"), make_model(0), extra={"when": object()})


def test_overwrite_replaces_generation(tmp_path):
    path = str(tmp_path / "c")
    ck.save(path, make_model(0))
    ck.save(path, make_model(1))
    assert sorted(os.listdir(path)) == ["gen-000002", "manifest.json"]
    target = make_model(7)
    ck.load(path, target)
    assert_same_state(full_state(target), full_state(make_model(1)))


# ---------------------------------------------------------------- multi-rank failures


def _save_then_crash(rank, ws, path, crash):
    model = shard(make_model(0), mesh_1d(ws))
    ck.save(path, model)
    model2 = shard(make_model(1), mesh_1d(ws))
    os.environ["FSDP2_CKPT_TEST_CRASH"] = crash  # this rank dies at that point of the save
    ck.save(path, model2)


def _load_values(rank, ws, path):
    model = shard(make_model(9), mesh_1d(ws))
    ck.load(path, model)
    return full_state(model)


@pytest.mark.slow  # kills a rank: its world is started again
@pytest.mark.parametrize("crash", ["after_write:1", "before_publish:0"])
def test_rank_killed_during_save_keeps_previous_checkpoint(worlds, tmp_path, crash):
    path = str(tmp_path / "c")
    with pytest.raises(Exception):
        worlds.run(2, _save_then_crash, path, crash, timeout=120)
    with open(os.path.join(path, "manifest.json")) as f:
        assert json.load(f)["generation"] == 1  # the new save was not published
    leftovers = set(os.listdir(path)) - {"manifest.json", "gen-000001"}
    assert leftovers and all(n.startswith("gen-000002") or n.endswith((".tmp", ".lock")) for n in leftovers)
    assert_same_state(worlds.run(2, _load_values, path)[0], full_state(make_model(0)))
    # the next save takes over the dead saver's lock and cleans up after the interrupted save
    worlds.run(2, _save_then_crash, path, "none")
    assert sorted(os.listdir(path)) == ["gen-000003", "manifest.json"]


def _load_corrupted(rank, ws, path):
    return load_outcome(path, shard(make_model(9), mesh_1d(ws)))


def test_corruption_seen_by_one_rank_stops_all_ranks(worlds, tmp_path):
    path = str(tmp_path / "c")
    worlds.run(4, _save_then_crash, path, "none")
    # Only rank 1 of a 4-rank load reads rank-00001's rows of 0.weight... and others.
    with open(os.path.join(path, "gen-000002", "rank-00003.safetensors"), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\1")
    results = worlds.run(4, _load_corrupted, path)
    assert all(untouched for _, untouched in results)
    messages = [m for m, _ in results]
    assert "rank-00003.safetensors is corrupted" in messages[3]
    assert all("failed on another rank" in m for m in messages[:3]), messages


def _fault_on_rank_1(rank, ws, path, where):
    """Rank 1 raises a non-I/O error at ``where`` of a save, after rank 0 took the lock and made
    gen-000002.partial; returns the rank's message, rank 0's listing after it, and what a later save
    into the same path loads back."""
    from fsdp2.checkpoint import writer

    ck.save(path, shard(make_model(0), mesh_1d(ws)))
    model = shard(make_model(1), mesh_1d(ws))

    def fault(*args, **kwargs):
        raise LookupError("injected fault")

    name = {"progress": "ByteProgress", "async snapshot": "process_staging", "write": "_write_rank_file"}[where]
    original = getattr(writer, name)
    if rank == 1:
        setattr(writer, name, fault)
    try:
        handle = ck.save(path, model, async_save=where == "async snapshot")
        if handle is not None:
            handle.wait()
        message = "saved"
    except ck.CheckpointError as e:
        message = str(e)
    finally:
        setattr(writer, name, original)
    listing = sorted(os.listdir(path)) if rank == 0 else None
    ck.save(path, model)  # the path is free again
    loaded = shard(make_model(7), mesh_1d(ws))
    ck.load(path, loaded)
    return message, listing, full_state(loaded)


@pytest.mark.parametrize("where", ["progress", "async snapshot", "write"])
def test_any_error_on_one_rank_fails_the_save_on_every_rank(worlds, tmp_path, where):
    """Not only I/O errors: whatever one rank raises inside save reaches every rank through the
    commit's agreement (no rank left waiting in a collective), and rank 0 removes the lock and
    the partial data."""
    path = str(tmp_path / "c")
    results = worlds.run(2, _fault_on_rank_1, path, where, timeout=60)
    for rank, (message, _, state) in enumerate(results):
        assert "failed on rank 1: injected fault" in message and "nothing was published" in message, (rank, message)
        assert_same_state(state, full_state(make_model(1)))
    assert results[0][1] == ["gen-000001", "manifest.json"]
