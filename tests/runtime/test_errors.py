"""Misuse tests: each bad input raises a clear FSDPUsageError and changes nothing.

"Changes nothing" means: every module keeps its class (no FSDP class swap), gets no FSDP state,
and keeps the very same parameter objects with the same values.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from fsdp2 import FSDPUsageError, fully_shard, register_fsdp_forward_method
from fsdp2.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=67, seq_len=16, dim=36, n_layers=2, n_heads=3)


# -- helpers (run inside rank processes) --------------------------------------------------------------


def _snapshot(model: nn.Module):
    return {
        "classes": [(name, type(m)) for name, m in model.named_modules()],
        "states": [name for name, m in model.named_modules() if "_fsdp_state" in m.__dict__],
        "params": [(name, p, p.detach().clone()) for name, p in model.named_parameters(remove_duplicate=False)],
        "buffers": [(name, b, b.clone()) for name, b in model.named_buffers()],
    }


def _assert_unchanged(model: nn.Module, before) -> None:
    after = _snapshot(model)
    assert after["classes"] == before["classes"], "a module's class was swapped"
    assert after["states"] == before["states"], "FSDP state was attached"
    assert [n for n, _, _ in after["params"]] == [n for n, _, _ in before["params"]]
    for (name, p_after, _), (_, p_before, value) in zip(after["params"], before["params"]):
        assert p_after is p_before, f"parameter {name} was replaced"
        if p_after.device.type != "meta":
            assert torch.equal(p_after.detach(), value), f"parameter {name} changed value"
    for (name, b_after, _), (_, b_before, value) in zip(after["buffers"], before["buffers"]):
        assert b_after is b_before and torch.equal(b_after, value), f"buffer {name} changed"


def _expect_error(model: nn.Module, match: str, fn, *args, **kwargs) -> str:
    """``fn(*args, **kwargs)`` raises an FSDPUsageError matching ``match`` and leaves ``model`` as it was."""
    before = _snapshot(model)
    with pytest.raises(FSDPUsageError, match=match) as info:
        fn(*args, **kwargs)
    _assert_unchanged(model, before)
    return str(info.value)


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))


def _sharded_gpt():
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block, mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    return model


# -- fully_shard arguments ------------------------------------------------------------------------------


def _twice(rank, ws):
    model = _mlp()
    fully_shard(model, mesh=_mesh())
    _expect_error(model, r"already applied.*once", fully_shard, model, mesh=_mesh())


def _mixed_devices(rank, ws):
    model = _mlp()
    with torch.device("meta"):
        model[2] = nn.Linear(8, 4)
    msg = _expect_error(model, r"different devices", fully_shard, model, mesh=_mesh())
    assert "meta" in msg and "cpu" in msg and "2.weight" in msg


def _three_dim_mesh(rank, ws):
    model = _mlp()
    mesh = init_device_mesh("cpu", (1, 1, 1))
    _expect_error(model, r"3 dims.*1-D.*2-D", fully_shard, model, mesh=mesh)


def _not_a_mesh(rank, ws):
    model = _mlp()
    _expect_error(model, r"mesh must be a DeviceMesh, got ProcessGroup", fully_shard, model, mesh=dist.group.WORLD)
    _expect_error(model, r"mesh must be a DeviceMesh, got list", fully_shard, model, mesh=[0])


class _TiedAcross(nn.Module):
    """``proj.weight`` is also registered directly on the parent."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.shared = self.proj.weight

    def forward(self, x):
        return self.proj(x) @ self.shared


def _shared_with_parent(rank, ws):
    model = _TiedAcross()
    fully_shard(model.proj, mesh=_mesh())
    msg = _expect_error(model, r"shared.*already managed by fully_shard\(Linear\)", fully_shard, model, mesh=_mesh())
    assert "parameter shared" in msg and "ignored_params" in msg


def _shared_between_siblings(rank, ws):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    fully_shard(model[0], mesh=_mesh())
    _expect_error(model[1], r"1?weight is already managed", fully_shard, model[1], mesh=_mesh())


def _top_down_order(rank, ws):
    model = _mlp()
    fully_shard(model, mesh=_mesh())
    _expect_error(
        model[0], r"already managed by fully_shard\(Sequential\).*bottom-up", fully_shard, model[0], mesh=_mesh()
    )


def _bad_placement(rank, ws):
    model = _mlp()
    _expect_error(
        model,
        r"Shard\(2\) for 0.weight .*\[-2, 2\)",
        fully_shard,
        model,
        mesh=_mesh(),
        shard_placement_fn=lambda p: Shard(2),
    )
    _expect_error(
        model,
        r"returned Replicate\(\) for 0.weight.*Shard\(dim\)",
        fully_shard,
        model,
        mesh=_mesh(),
        shard_placement_fn=lambda p: Replicate(),
    )


def _scalar_param(rank, ws):
    model = _mlp()
    model[0].temperature = nn.Parameter(torch.tensor(1.0))
    _expect_error(model, r"0.temperature is a scalar.*shape \(1,\)", fully_shard, model, mesh=_mesh())


def _grad_dtype_of_its_own(rank, ws):
    model = _mlp()
    model[0].weight.grad_dtype = torch.bfloat16
    refused = r"parameter 0.weight has grad_dtype=torch.bfloat16.*MixedPrecisionPolicy\(reduce_dtype="
    _expect_error(model, refused, fully_shard, model, mesh=_mesh())
    model[0].weight.grad_dtype = torch.float32  # its own dtype: what fsdp2 keeps gradients in anyway
    fully_shard(model, mesh=_mesh())


@pytest.mark.skipif(not hasattr(torch.Tensor, "_has_grad_dtype_override"), reason="torch < 2.15 ignores grad_dtype")
def test_fully_shard_refuses_a_grad_dtype_other_than_the_parameters(worlds):
    """PyTorch 2.15 keeps (and reduces) such a parameter's gradients in its grad_dtype; fsdp2 refuses it."""
    worlds.run(1, _grad_dtype_of_its_own)


def _reshard_three(rank, ws):
    model = _mlp()
    _expect_error(
        model,
        r"reshard_after_forward=3.*int that divides.*world size 4",
        fully_shard,
        model,
        mesh=_mesh(),
        reshard_after_forward=3,
    )
    _expect_error(model, r"reshard_after_forward='yes'", fully_shard, model, mesh=_mesh(), reshard_after_forward="yes")


def _already_dtensor(rank, ws):
    from torch.distributed.tensor import distribute_tensor

    model = _mlp()
    model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), _mesh(), [Shard(0)]))
    _expect_error(model, r"0.weight is already a DTensor", fully_shard, model, mesh=_mesh())


def _bad_policies(rank, ws):
    model = _mlp()
    _expect_error(
        model,
        r"mp_policy must be a MixedPrecisionPolicy, got dict",
        fully_shard,
        model,
        mesh=_mesh(),
        mp_policy={"param_dtype": torch.bfloat16},
    )
    _expect_error(
        model,
        r"offload_policy must be an OffloadPolicy.*CPUOffloadPolicy",
        fully_shard,
        model,
        mesh=_mesh(),
        offload_policy="cpu",
    )


def _spmd_mesh_dims_misuse(rank, ws):
    from torch.distributed.tensor import distribute_tensor

    from fsdp2 import DataParallelMeshDims

    def on_mesh(mesh, placements):
        model = _mlp()
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                module._parameters[name] = nn.Parameter(distribute_tensor(p.detach(), mesh, placements))
        return model

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_shard", "tp", "cp"))
    model = on_mesh(mesh, (Replicate(),) * 3)
    apart = DataParallelMeshDims(shard=("dp_shard", "cp"))
    _expect_error(model, r"not adjacent in the mesh", fully_shard, model, mesh=mesh, dp_mesh_dims=apart)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    model = on_mesh(mesh, (Replicate(), Replicate()))
    both = DataParallelMeshDims(shard=("dp_shard", "cp"))
    _expect_error(
        model,
        r"reshard_after_forward=2 with several dp_mesh_dims shard dims",
        fully_shard,
        model,
        mesh=mesh,
        dp_mesh_dims=both,
        reshard_after_forward=2,
    )
    model = on_mesh(mesh, (Shard(0), Replicate()))
    _expect_error(
        model,
        r"0.weight is Shard\(dim=0\) on data-parallel mesh dim 'dp_shard'.*Replicate\(\)",
        fully_shard,
        model,
        mesh=mesh,
        dp_mesh_dims=both,
    )


def test_dp_mesh_dims_misuse(worlds):
    worlds.run(4, _spmd_mesh_dims_misuse)


@pytest.mark.parametrize(
    "fn",
    [
        _twice,
        _mixed_devices,
        _three_dim_mesh,
        _not_a_mesh,
        _shared_with_parent,
        _shared_between_siblings,
        _top_down_order,
        _bad_placement,
        _scalar_param,
        _already_dtensor,
        _bad_policies,
    ],
)
def test_fully_shard_rejects(worlds, fn):
    worlds.run(1, fn)


def test_reshard_after_forward_not_a_divisor(worlds):
    worlds.run(4, _reshard_three)


@pytest.mark.parametrize("value, got", [("not a module", "str"), ([], "list"), ([nn.Linear(2, 2), "x"], "list")])
def test_not_a_module(value, got):
    with pytest.raises(FSDPUsageError, match=f"expects an nn.Module or a non-empty list of nn.Modules, got {got}"):
        fully_shard(value)


# -- FSDPModule methods ------------------------------------------------------------------------------------


def _load_bad_state_dict(rank, ws):
    model = _sharded_gpt()
    good = GPT(CFG).state_dict()
    wrong_shape = dict(good, **{"lm_head.weight": torch.zeros(3, 36)})
    msg = _expect_error(
        model, r"(?s)nothing was loaded.*lm_head.weight: shape \(3, 36\)", model.load_state_dict, wrong_shape
    )
    assert "(67, 36)" in msg
    missing = {k: v for k, v in good.items() if not k.startswith("blocks.1.")}
    _expect_error(
        model, r"(?s)nothing was loaded.*missing keys: \['blocks.1.attn.proj.bias'", model.load_state_dict, missing
    )
    # Missing keys in a submodule's state dict, through the submodule itself.
    block = model.blocks[0]
    _expect_error(block, r"missing keys", block.load_state_dict, {})


def _prefetch_plain_module(rank, ws):
    model = _sharded_gpt()
    plain = nn.Linear(2, 2)
    _expect_error(
        model,
        r"set_modules_to_forward_prefetch: Linear is not fully_shard'ed",
        model.set_modules_to_forward_prefetch,
        [model.blocks[0], plain],
    )
    assert model._fsdp_state.forward_prefetch == []
    _expect_error(
        model,
        r"set_modules_to_backward_prefetch: Linear is not fully_shard'ed",
        model.set_modules_to_backward_prefetch,
        [plain],
    )
    assert model._fsdp_state.backward_prefetch is None
    _expect_error(model, r"expects a list of modules", model.set_modules_to_forward_prefetch, model.blocks[0])


def _forward_method_errors(rank, ws):
    model = _sharded_gpt()
    _expect_error(model, r"GPT has no method 'generate'", register_fsdp_forward_method, model, "generate")


def _divide_factor(rank, ws):
    model = _sharded_gpt()
    for bad in (0, -2.0):
        _expect_error(model, r"set_gradient_divide_factor.*positive", model.set_gradient_divide_factor, bad)


def _forward_on_meta(rank, ws):
    with torch.device("meta"):
        model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block, mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    tokens = torch.zeros(1, 4, dtype=torch.long)
    _expect_error(model, r"tok_emb.weight is on the meta device.*to_empty", model, tokens)
    # The failed forward left nothing half-done: initializing and running it now works.
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    model(tokens).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "fn",
    [_load_bad_state_dict, _prefetch_plain_module, _forward_method_errors, _divide_factor, _forward_on_meta],
)
def test_fsdp_module_rejects(worlds, fn):
    worlds.run(2, fn)
