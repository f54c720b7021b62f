"""Save/load round trips across world sizes and meshes (multi-process, gloo)."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
import torch.nn as nn

from tests.checkpoint.ckpt_helpers import (
    assert_same_state,
    checksum_blocks,
    file_header,
    file_index,
    full_state,
    make_model,
    mesh_1d,
    mesh_2d,
    shard,
    stored_chunks,
)


# ---------------------------------------------------------------- rank functions


def _save_sharded(rank, ws, path, seed=0, block_bytes=None):
    import fsdp2.checkpoint as ck

    model = shard(make_model(seed), mesh_1d(ws))
    with checksum_blocks(block_bytes) if block_bytes else contextlib.nullcontext():
        ck.save(path, model, extra={"seed": seed, "ws": ws})
    state = full_state(model)  # collective: every rank must call it
    return state if rank == 0 else None


def _load_sharded(rank, ws, path, verify=True):
    import fsdp2.checkpoint as ck

    model = shard(make_model(seed=99), mesh_1d(ws))
    stats = ck.LoadStats()
    extra = ck.load(path, model, verify=verify, stats=stats)
    state = full_state(model)
    return {
        "state": state if rank == 0 else None,
        "extra": extra,
        "read": stats.bytes_read,
        "owned": stats.bytes_owned,
        "verified": stats.bytes_verified,
    }


def _save_plain(rank, ws, path, seed=0):
    import fsdp2.checkpoint as ck

    model = make_model(seed)
    ck.save(path, model, extra={"seed": seed})
    return full_state(model)


def _load_plain(rank, ws, path):
    import fsdp2.checkpoint as ck

    model = make_model(seed=99)
    extra = ck.load(path, model)
    return {"state": full_state(model), "extra": extra}


def _save_hsdp(rank, ws, path):
    import fsdp2.checkpoint as ck

    model = shard(make_model(0), mesh_2d(2, 2))
    placements = {k: tuple(v.placements) for k, v in model.state_dict().items()}
    ck.save(path, model)
    return {"state": full_state(model), "placements": [str(p) for p in placements.values()]}


def _dtensor_module(mesh, placements, seed, shapes):
    """A module whose parameters are DTensors with the given placements (e.g. TP-style)."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(seed)
    module = nn.Module()
    for i, shape in enumerate(shapes):
        full = torch.randn(shape) + seed
        module.register_parameter(f"p{i}", nn.Parameter(distribute_tensor(full, mesh, placements)))
    return module


def _save_tp(rank, ws, path):
    from torch.distributed.tensor import Shard

    import fsdp2.checkpoint as ck

    module = _dtensor_module(mesh_2d(2, 2, ("dp", "tp")), [Shard(0), Shard(1)], 0, [(7, 5), (5, 3), (4, 1)])
    ck.save(path, module)
    return full_state(module)


def _load_tp_as_plain(rank, ws, path):
    import fsdp2.checkpoint as ck

    module = nn.Module()
    for i, shape in enumerate([(7, 5), (5, 3), (4, 1)]):
        module.register_parameter(f"p{i}", nn.Parameter(torch.zeros(shape)))
    ck.load(path, module)
    return full_state(module)


def _region_matches_dtensor(rank, ws):
    """Our metadata-only layout equals DTensor's local shard shape and PyTorch's helper."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from fsdp2.layout.regions import shard_region

    cases = []
    for mesh in (mesh_1d(ws), mesh_2d(2, 2)):
        for shape in [(7, 3), (5, 6), (1, 4), (0, 2), (3, 9), (2,)]:
            options = (
                [[Shard(0)], [Replicate()]]
                if mesh.ndim == 1
                else [[Replicate(), Shard(0)], [Shard(0), Shard(0)], [Shard(0), Replicate()]]
            )
            if len(shape) == 2:
                options += [[Shard(1)]] if mesh.ndim == 1 else [[Shard(0), Shard(1)], [Shard(1), Shard(0)]]
            for placements in options:
                dt = distribute_tensor(torch.zeros(shape), mesh, placements)
                region = shard_region(shape, tuple(mesh.shape), mesh.get_coordinate(), placements)
                theirs_shape, theirs_offset = compute_local_shape_and_global_offset(shape, mesh, placements)
                assert region.shape == tuple(dt.to_local().shape), (shape, placements)
                assert region.shape == tuple(theirs_shape), (shape, placements)
                if region.numel:  # empty shards have no meaningful offset
                    assert region.offsets == tuple(theirs_offset), (shape, placements)
                cases.append(1)
    return len(cases)


# ---------------------------------------------------------------- tests


def test_layout_from_metadata_matches_dtensor(worlds):
    assert min(worlds.run(4, _region_matches_dtensor)) > 20


@pytest.fixture(scope="module")
def saved_on_4(worlds, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "on4")
    # One-element checksum blocks: every row edge is a block edge, so verified loads read exactly
    # the owned rows at any world size (test_checkpoint_integrity.py covers real block sizes).
    reference = worlds.run(4, _save_sharded, path, 0, 1)[0]
    assert_same_state(reference, full_state(make_model(0)))
    return path, reference


@pytest.mark.parametrize("load_ws", [1, 2, 3, 4])
def test_save_on_4_load_on_n(worlds, saved_on_4, load_ws):
    path, reference = saved_on_4
    results = worlds.run(load_ws, _load_sharded, path)
    assert_same_state(results[0]["state"], reference)
    assert all(r["extra"] == {"seed": 0, "ws": 4} for r in results)
    # Every rank read exactly what it owns, and checksummed exactly what it read.
    assert all(r["read"] == r["owned"] == r["verified"] > 0 for r in results)
    total = sum(v.numel() * v.element_size() for v in reference.values())
    assert sum(r["owned"] for r in results) == total  # Shard(0): the ranks split the bytes


def test_files_hold_only_local_shards(saved_on_4):
    path, _ = saved_on_4
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["world_size"] == 4
    weight = manifest["tensors"]["model/2.weight"]  # 5 rows on 4 ranks: 2, 2, 1, 0
    assert weight == {"shape": [5, 7], "dtype": "float32", "mesh": weight["mesh"], "placements": ["S(0)"]}  # no list
    assert manifest["meshes"][weight["mesh"]] == {"shape": [4], "start": 0, "strides": [1]}
    chunks = stored_chunks(path, "model/2.weight")
    assert [(f, o[0], s[0]) for f, o, s in chunks] == [
        (f"gen-000001/rank-0000{r}.safetensors", start, rows) for r, start, rows in [(0, 0, 2), (1, 2, 2), (2, 4, 1)]
    ]
    # Each file holds and indexes its own chunk; rank 3's row range is empty, so it stores none.
    for rank, offsets in [(0, [0, 0]), (1, [2, 0]), (2, [4, 0])]:
        full = os.path.join(path, f"gen-000001/rank-0000{rank}.safetensors")
        assert file_index(full)["chunks"]["model/2.weight"]["offsets"] == offsets
    assert "model/2.weight" not in file_header(os.path.join(path, "gen-000001/rank-00003.safetensors"))[0]
    assert sorted(os.listdir(os.path.join(path, "gen-000001"))) == [".fsdp2-generation"] + [
        f"rank-0000{r}.safetensors" for r in range(4)
    ]
    assert not [n for n in os.listdir(path) if n.endswith(".partial")]


def test_sharded_to_plain_and_back(worlds, saved_on_4, tmp_path):
    path, reference = saved_on_4
    plain = worlds.run(1, _load_plain, path)[0]
    assert_same_state(plain["state"], reference)
    assert plain["extra"]["ws"] == 4

    plain_path = str(tmp_path / "plain")
    plain_ref = worlds.run(1, _save_plain, plain_path, 5)[0]
    loaded = worlds.run(3, _load_sharded, plain_path)
    assert_same_state(loaded[0]["state"], plain_ref)
    assert loaded[1]["extra"] == {"seed": 5}


def test_hsdp_2x2_save_loads_on_1d_meshes(worlds, tmp_path):
    path = str(tmp_path / "hsdp")
    saved = worlds.run(4, _save_hsdp, path)
    assert "Replicate()" in saved[0]["placements"][0]
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    # Replica group 1 (ranks 2, 3) holds the same shards as group 0: written once.
    assert manifest["meshes"] == [{"shape": [2, 2], "start": 0, "strides": [2, 1]}]
    for key, entry in manifest["tensors"].items():
        assert entry["placements"] == ["R", "S(0)"]
        assert {f.split("/")[1] for f, _, _ in stored_chunks(path, key)} <= {
            "rank-00000.safetensors",
            "rank-00001.safetensors",
        }
    for rank in (2, 3):
        assert file_header(os.path.join(path, f"gen-000001/rank-0000{rank}.safetensors"))[0] == {}
    for load_ws in (2, 3):
        assert_same_state(worlds.run(load_ws, _load_sharded, path)[0]["state"], saved[0]["state"])


def test_tp_2d_shard_shard_to_plain(worlds, tmp_path):
    path = str(tmp_path / "tp")
    saved = worlds.run(4, _save_tp, path)[0]
    assert_same_state(worlds.run(1, _load_tp_as_plain, path)[0], saved)
