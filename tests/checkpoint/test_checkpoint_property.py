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
