"""Property: any tensors saved on any mesh load back exactly on any other mesh."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def _placement(code: str):
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if code == "r" else Shard(int(code[1]))


def _expected(shape, index, seed):
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 1000 * index + seed


def _module(ws, specs, seed, mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape) if ws > 1 or mesh_shape != (1,) else None
    module = nn.Module()
    for i, (shape, codes) in enumerate(specs):
        full = _expected(shape, i, seed) if seed >= 0 else torch.zeros(shape)
        value = distribute_tensor(full, mesh, [_placement(c) for c in codes]) if mesh is not None else full
        module.register_parameter(f"p{i}", nn.Parameter(value, requires_grad=False))
    return module


def _save(rank, ws, path, specs, mesh_shape):
    import fsdp2.checkpoint as ck

    ck.save(path, _module(ws, specs, 7, mesh_shape))


def _load(rank, ws, path, specs, mesh_shape):
    from torch.distributed.tensor import DTensor

    import fsdp2.checkpoint as ck

    module = _module(ws, specs, -1, mesh_shape)
    stats = ck.LoadStats()
    ck.load(path, module, verify=False, stats=stats)
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}
    return full, stats.bytes_read == stats.bytes_owned


@st.composite
def _case(draw):
    shapes = draw(st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=2).map(tuple), min_size=1, max_size=3))
    save_ws, load_ws = draw(st.sampled_from([1, 2, 3, 4])), draw(st.sampled_from([1, 2, 3, 4]))
    two_d_save, two_d_load = save_ws == 4 and draw(st.booleans()), load_ws == 4 and draw(st.booleans())
    sides = []
    for ws, two_d in ((save_ws, two_d_save), (load_ws, two_d_load)):
        mesh_shape = (2, 2) if two_d else (ws,)
        specs = []
        for shape in shapes:
            codes = ["r"] + [f"s{d}" for d in range(len(shape))]
            specs.append((shape, tuple(draw(st.sampled_from(codes)) for _ in mesh_shape)))
        sides.append((ws, specs, mesh_shape))
    return sides


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_case())
def test_any_layout_roundtrips_to_any_layout(worlds, tmp_path_factory, case):
    (save_ws, save_specs, save_mesh), (load_ws, load_specs, load_mesh) = case
    path = str(tmp_path_factory.mktemp("prop") / "c")
    worlds.run(save_ws, _save, path, save_specs, save_mesh)
    results = worlds.run(load_ws, _load, path, load_specs, load_mesh)
    for full, read_what_owned in results:
        assert read_what_owned
        for i, (shape, _) in enumerate(load_specs):
            assert torch.equal(full[f"p{i}"], _expected(shape, i, 7)), (i, shape)


# ---------------------------------------------------------------- format 3: chunks by rule


@st.composite
def _rule_case(draw):
    """A tensor shape, a mesh (affine or listed ranks), placements (strided shards included) and a
    box of the tensor."""
    from torch.distributed.tensor import Replicate, Shard

    from fsdp2 import compat

    shape = tuple(draw(st.lists(st.integers(0, 12), min_size=0, max_size=3)))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=0 if not shape else 1, max_size=3)))
    placements = []
    for _ in mesh_shape:
        placements.append(Shard(draw(st.integers(0, len(shape) - 1))) if shape and draw(st.booleans()) else Replicate())
    for m, p in enumerate(placements):  # fully_shard over TP: a dim split again by later Shard dims
        if type(p) is not Shard:
            continue
        later = [
            j for j in range(m + 1, len(placements)) if type(placements[j]) is Shard and placements[j].dim == p.dim
        ]
        if later and draw(st.booleans()):
            placements[m] = compat.StridedShard(p.dim, split_factor=math.prod(mesh_shape[j] for j in later))
            break  # one per tensor, as fully_shard makes them
    size = math.prod(mesh_shape)
    world = size + draw(st.integers(0, 3))
    ranks = draw(st.permutations(range(world)))[:size] if draw(st.booleans()) else None
    box = None
    if shape and all(shape):
        offsets = [draw(st.integers(0, n - 1)) for n in shape]
        box = (tuple(offsets), tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, offsets)))
    return shape, mesh_shape, tuple(placements), world, ranks, box


@settings(max_examples=300, deadline=None)
@given(case=_rule_case())
def test_a_rule_gives_the_chunks_each_rank_holds(case):
    """``ChunkRule`` (what a format-3 manifest stores) gives exactly the chunks DTensor's rule puts on
    each writing rank (coordinate 0 of Replicate dims), found without walking the mesh when a box is
    given, and they tile the tensor."""
    import itertools

    from torch.distributed.tensor import Replicate

    from fsdp2.checkpoint import format as ckformat
    from fsdp2.checkpoint.chunk_rule import ChunkRule, MeshRanks
    from fsdp2.layout.regions import Region, shard_region

    shape, mesh_shape, placements, world, ranks, box = case
    mesh = (
        MeshRanks.of(torch.arange(math.prod(mesh_shape)).reshape(mesh_shape))
        if ranks is None
        else MeshRanks(mesh_shape, ranks=tuple(ranks))
    )
    rule = ChunkRule(mesh, placements)
    rule.check(shape, world)
    expected = {}
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        if any(c for c, p in zip(coordinate, placements) if isinstance(p, Replicate)):
            continue
        region = shard_region(shape, mesh_shape, coordinate, placements)
        if region.numel:
            expected[mesh.rank(coordinate)] = region
    assert dict(rule.chunks(shape)) == expected
    assert {r: rule.chunk_of(shape, r) for r in range(world) if rule.chunk_of(shape, r)} == expected
    if math.prod(shape):
        ckformat.check_tiling("t", shape, list(expected.values()))
    if box is not None:
        box = Region(*box)
        meeting = {r: c for r, c in expected.items() if c.intersect(box) is not None}
        assert dict(rule.overlapping(shape, box)) == meeting
