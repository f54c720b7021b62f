"""Checkpoint metadata that does not grow with the world size (format 3), counted, never timed.

- The manifest: one entry per tensor and per mesh at 8, 64 and 1024 simulated ranks (rank 0 of a
  fake process group saves), for FSDP, HSDP and TP + FSDP (``_StridedShard`` included), and for the
  same model saved from 2 and 4 gloo ranks.
- A loading rank reads the manifest and the headers of the files it reads: on the saving layout,
  its own file alone.
- Rank 0's commit reads no other rank's sidecar unless another rank describes a tensor (a mesh
  without rank 0).

Speed at 1,024-16,384 simulated ranks, against DCP: ``benchmarks/bench_checkpoint_scale.py``.
"""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
import torch.nn as nn

import fsdp2.checkpoint as ck
from fsdp2.checkpoint import writer
from tests.checkpoint.ckpt_helpers import file_index, full_state, make_model, mesh_1d, shard


def _nodes(value) -> int:
    """JSON values in ``value``, containers and leaves: the manifest's size in entries."""
    if isinstance(value, dict):
        return 1 + sum(_nodes(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_nodes(v) for v in value)
    return 1


@contextlib.contextmanager
def _fake_world(world_size: int):
    """This process as rank 0 of a fake process group of ``world_size`` ranks (as conftest's fake_world)."""
    import torch.distributed as dist
    from torch.distributed.tensor import debug
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        getattr(debug, "_clear_sharding_prop_cache", debug._clear_python_sharding_prop_cache)()


def _sharded(layout: str, world_size: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fsdp2 import fully_shard

    model = make_model(0)
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (world_size // 4, 4), mesh_dim_names=("replicate", "shard"))
    else:  # tensor parallel inside, FSDP across: colwise weights become _StridedShard on dim 0
        world = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, world["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh = world["dp"]
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _saved_at(tmp_path, layout: str, world_size: int) -> tuple[dict, dict]:
    """Rank 0 of a fake world of ``world_size`` saves model + AdamW: (manifest, its own file's index)."""
    path = str(tmp_path / f"{layout}{world_size}")
    with _fake_world(world_size):
        model = _sharded(layout, world_size)
        opt = torch.optim.AdamW(model.parameters())
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        ck.save(path, model, opt)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    return manifest, file_index(os.path.join(path, "gen-000001", "rank-00000.safetensors"))


@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "tp"])
def test_manifest_is_flat_in_the_world_size(tmp_path, layout):
    saved = {n: _saved_at(tmp_path, layout, n) for n in (8, 64, 1024)}
    manifests = {n: m for n, (m, _) in saved.items()}
    assert {n: m["world_size"] for n, m in manifests.items()} == {8: 8, 64: 64, 1024: 1024}
    # 6 parameters + 2 AdamW moments each + their 6 steps: one entry each, none lists chunks.
    assert {n: len(m["tensors"]) for n, m in manifests.items()} == {8: 24, 64: 24, 1024: 24}
    assert all(
        set(t) == {"shape", "dtype", "mesh", "placements"} for m in manifests.values() for t in m["tensors"].values()
    )
    meshes = {"fsdp": 2, "hsdp": 2, "tp": 3}[layout]  # the (sub)meshes, and rank 0 alone for the steps
    assert {n: len(m["meshes"]) for n, m in manifests.items()} == dict.fromkeys((8, 64, 1024), meshes)
    assert len({_nodes(m) for m in manifests.values()}) == 1, {n: _nodes(m) for n, m in manifests.items()}
    # Rank 0's own file indexes its own chunks: as many at 1024 ranks as at 8.
    assert {n: len(index["chunks"]) for n, (_, index) in saved.items()} == {8: 24, 64: 24, 1024: 24}
    if layout == "tp":
        assert manifests[8]["tensors"]["model/0.weight"]["placements"] == ["SS(0,2)", "S(0)"]
        assert manifests[1024]["meshes"][manifests[1024]["tensors"]["model/4.weight"]["mesh"]] == {
            "shape": [512],
            "start": 0,
            "strides": [2],
        }


# ---------------------------------------------------------------- real ranks


def _save_trained(rank, ws, path):
    model = shard(make_model(0), mesh_1d(ws))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    ck.save(path, model, opt, extra={"step": 1})
    state = full_state(model)  # collective: every rank calls it
    return state if rank == 0 else None


def _load_stats(rank, ws, path):
    model = shard(make_model(5), mesh_1d(ws))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = ck.LoadStats()
    ck.load(path, model, opt, stats=stats)
    return stats.files_read, stats.metadata_bytes, full_state(model)


def test_same_model_saved_from_2_and_4_ranks_has_the_same_manifest_entries(worlds, tmp_path):
    texts = {}
    for ws in (2, 4):
        path = str(tmp_path / f"on{ws}")
        reference = worlds.run(ws, _save_trained, path)[0]
        with open(os.path.join(path, "manifest.json")) as f:
            texts[ws] = f.read()
        # Each rank reads the manifest and the headers of its own file and of rank 0's (which holds the
        # optimizer's steps, plain tensors saved once), nothing else.
        for rank, (files, metadata_bytes, state) in enumerate(worlds.run(ws, _load_stats, path)):
            assert files == sorted({f"gen-000001/rank-{r:05d}.safetensors" for r in (0, rank)})
            headers = 0
            for name in files:
                with open(os.path.join(path, name), "rb") as f:
                    headers += 8 + int.from_bytes(f.read(8), "little")
            assert metadata_bytes == len(texts[ws].encode()) + headers
            assert all(torch.equal(state[k], reference[k]) for k in reference)
    manifests = {ws: json.loads(t) for ws, t in texts.items()}
    assert manifests[2]["tensors"] == manifests[4]["tensors"]
    assert _nodes(manifests[2]) == _nodes(manifests[4])
    assert len(texts[2]) == len(texts[4])  # only digits differ: the world size, the mesh's shape, the save id


def _module_on_two_meshes(rank, ws, seed):
    """``low`` sharded over all ranks, ``high`` over ranks 2 and 3 only (ranks 0 and 1 are not on its mesh)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(seed)
    module = nn.Module()
    module.low = nn.Parameter(distribute_tensor(torch.randn(6, 3), mesh_1d(ws), [Shard(0)]))
    module.high = nn.Parameter(distribute_tensor(torch.randn(5, 2), DeviceMesh("cpu", [2, 3]), [Shard(0)]))
    return module


def _save_two_meshes(rank, ws, path):
    """Two saves, recording the sidecars rank 0 reads at each commit, and the JSON files left in the
    first generation once it is published."""
    sidecars = []
    real = writer._read_sidecars
    writer._read_sidecars = lambda staging, expected: sidecars.append(expected) or real(staging, expected)
    try:
        ck.save(path, _module_on_two_meshes(rank, ws, 0))
        left = [n for n in os.listdir(os.path.join(path, "gen-000001")) if n.endswith(".json")]
        ck.save(path, shard(make_model(0), mesh_1d(ws)))  # every mesh holds rank 0: no sidecar
    finally:
        writer._read_sidecars = real
    return sidecars, left


def _load_two_meshes(rank, ws, path):
    module = _module_on_two_meshes(rank, ws, 1)
    ck.load(path, module)
    state = {"low": module.low.full_tensor().detach()}
    if module.high.device_mesh.get_coordinate() is not None:  # ranks 0 and 1 hold none of "high"
        state["high"] = module.high.full_tensor().detach()
    return state


def _load_plain(rank, ws, path):
    module = nn.Module()
    module.low, module.high = nn.Parameter(torch.zeros(6, 3)), nn.Parameter(torch.zeros(5, 2))
    ck.load(path, module)
    return {k: v.detach() for k, v in module.state_dict().items()}


def test_rank0_reads_a_sidecar_only_for_a_mesh_without_it(worlds, tmp_path):
    path = str(tmp_path / "c")
    results = worlds.run(4, _save_two_meshes, path)
    # Rank 2 described "high" (rank 0 is not on its mesh): one sidecar, read by rank 0 at the first
    # commit and deleted before publishing; the second save needed none.
    assert [calls for calls, _ in results] == [[1], [], [], []]
    assert all(left == [] for _, left in results)
    with open(os.path.join(path, "manifest.json")) as f:
        assert json.load(f)["generation"] == 2


def _save_high(rank, ws, path):
    ck.save(path, _module_on_two_meshes(rank, ws, 0))


def test_a_tensor_on_a_mesh_without_rank0_loads_back(worlds, tmp_path):
    path = str(tmp_path / "c")
    worlds.run(4, _save_high, path)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    high = manifest["tensors"]["model/high"]
    assert manifest["meshes"][high["mesh"]] == {"shape": [2], "start": 2, "strides": [1]}
    torch.manual_seed(0)
    expected = {"low": torch.randn(6, 3), "high": torch.randn(5, 2)}
    loaded = worlds.run(4, _load_two_meshes, path) + worlds.run(1, _load_plain, path)
    assert [sorted(state) for state in loaded] == [["low"]] * 2 + [["high", "low"]] * 3
    assert all(torch.equal(state[k], expected[k]) for state in loaded for k in state)


# ---------------------------------------------------------------- the scale benchmark, tiny


def test_the_scale_benchmark_runs_at_a_tiny_world(tmp_path, capsys):
    """benchmarks/bench_checkpoint_scale.py at 4 and 8 simulated ranks of a small GPT, in this
    process: both libraries measured, fsdp2's manifest as long at 8 as at 4, DCP's metadata longer."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_checkpoint_scale as bench

    rows = bench.run("gpt-small", [4, 8], 1, True, str(tmp_path), in_process=True)
    bench.report(rows)
    out = capsys.readouterr().out
    assert [r["n"] for r in rows] == [4, 8] and all(r["dcp_commit"] and r["dcp_plan"] for r in rows)
    assert rows[0]["fsdp2_commit"]["tensors"] == rows[1]["fsdp2_commit"]["tensors"] == 4 * 49  # params, moments, steps
    assert rows[0]["fsdp2_commit"]["manifest_bytes"] == rows[1]["fsdp2_commit"]["manifest_bytes"]
    assert rows[1]["dcp_commit"]["chunks"] > rows[0]["dcp_commit"]["chunks"]  # DCP lists every rank's
    # Bytes of metadata a rank reads: fsdp2's flat (the headers' digits vary), DCP's growing with the ranks.
    fsdp2_bytes, dcp_bytes = ([r[side]["metadata_bytes"] for r in rows] for side in ("fsdp2_plan", "dcp_plan"))
    assert abs(fsdp2_bytes[1] - fsdp2_bytes[0]) < 0.02 * fsdp2_bytes[0] and dcp_bytes[1] > 1.5 * dcp_bytes[0]
    assert "| 4 |" in out and "| 8 |" in out


def _permuted(rank, ws, seed):
    """One (9, 2) parameter sharded over a mesh whose ranks are not in order, 3, 0, 2, 1 (local shards
    cut by hand: rows 0-2 at coordinate 0, rank 3), and the full tensor."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from fsdp2.layout.regions import local_region, shard_region

    torch.manual_seed(seed)
    full = torch.randn(9, 2)
    mesh = DeviceMesh("cpu", [3, 0, 2, 1])
    box = shard_region((9, 2), (4,), mesh.get_coordinate(), [Shard(0)])
    module = nn.Module()
    local = full[box.slices()].clone()
    module.w = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(9, 2), stride=(2, 1)))
    assert local_region(module.w) == box
    return module, full, box


def _save_permuted(rank, ws, path):
    ck.save(path, _permuted(rank, ws, 0)[0])


def _load_permuted(rank, ws, path):
    module, _, box = _permuted(rank, ws, 1)
    ck.load(path, module)
    return module.w.to_local().detach(), box


def test_a_mesh_without_an_affine_rank_map_lists_its_ranks(worlds, tmp_path):
    """The irregular case: the manifest lists the mesh's ranks (and says so: "ranks", not "start" and
    "strides"); rank 3, at coordinate 0, describes the tensor in a sidecar."""
    path = str(tmp_path / "c")
    worlds.run(4, _save_permuted, path)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["meshes"][manifest["tensors"]["model/w"]["mesh"]] == {"shape": [4], "ranks": [3, 0, 2, 1]}
    # Rows 0-2 are coordinate 0's: rank 3's file.
    assert file_index(os.path.join(path, "gen-000001", "rank-00003.safetensors"))["chunks"]["model/w"]["offsets"] == [
        0,
        0,
    ]
    torch.manual_seed(0)
    expected = torch.randn(9, 2)
    loaded = worlds.run(4, _load_permuted, path)
    assert [box.offsets[0] for _, box in loaded] == [3, 9, 6, 0]  # coordinates 1, 3 (empty), 2, 0
    assert all(torch.equal(local, expected[box.slices()]) for local, box in loaded)
