"""Drop-in: fsdp2 behaves like PyTorch's FSDP2 wherever a user or a library can tell.

Behaviours are checked side by side: the same model is built twice from one seed, one copy
sharded by ``torch.distributed.fsdp.fully_shard`` and one by ``fsdp2.fully_shard``, and both
train on the same batches in the same gloo world. Losses and parameters must be bitwise equal
and the collectives issued (counted at dispatch, as DTensor's ``CommDebugMode`` counts them: every
c10d call of both) must match. Defects are checked against an unsharded reference where PyTorch is not
the point.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
import torch.nn.functional as F

from fsdp2.models import GPT
from tests.support.models import CFG, DataclassModel, ReentrantCheckpointBlock
from tests.support.parity import (
    assert_same_params,
    shard_blocks_then_root,
    side_by_side_step,
    step_batch,
    train_parity,
    train_side_by_side,
    twins,
    world_mesh,
)


_PYTORCH_2_13 = hasattr(torch_fsdp, "DataParallelMeshDims")  # its FSDP2's newest public name


def _needs_pytorch_2_13(what: str):
    """Skip a side-by-side test on an older torch whose FSDP2 lacks ``what``."""
    return pytest.mark.skipif(not _PYTORCH_2_13, reason=f"PyTorch < 2.13 has no {what}")


# -- behaviour to match PyTorch 2.13 ------------------------------------------------------------------


def _default_and_root_resharding(rank, ws):
    from torch.distributed.tensor import DTensor

    for setting in (None, True, False, 2):
        kwargs = {} if setting is None else {"reshard_after_forward": setting}
        theirs, ours = twins(lambda: GPT(CFG), lambda m, fs: shard_blocks_then_root(m, fs, **kwargs))
        train_side_by_side(theirs, ours, rank, ws, steps=2)
        x, y = step_batch(9, rank, ws)
        ours.loss(x, y)  # a grad-enabled forward: what stays gathered for backward?
        theirs.loss(x, y)
        for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
            assert isinstance(a, DTensor) == isinstance(b, DTensor), (setting, name)
        root_kept = not isinstance(dict(ours.named_parameters())["lm_head.weight"], DTensor)
        assert root_kept == (setting in (None, False)), setting
        ours.reshard()
        theirs.reshard()


def test_reshard_after_forward_default_none_and_root_like_pytorch(worlds):
    """None (the 2.13 default) keeps only the root gathered; True/int reshard the root too."""
    worlds.run(2, _default_and_root_resharding)


def _list_of_modules(rank, ws):
    def shard(model, fully_shard):
        mesh = world_mesh()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard([model.ln_f, model.lm_head], mesh=mesh)  # torchtitan's [norm, output] group
        fully_shard(model, mesh=mesh)

    theirs, ours = twins(lambda: GPT(CFG), shard)
    assert ours.ln_f._fsdp_state is ours.lm_head._fsdp_state
    train_side_by_side(theirs, ours, rank, ws)


def test_list_of_modules_is_one_group(worlds):
    worlds.run(2, _list_of_modules)


def _policies(rank, ws):
    import torch.distributed.fsdp as torch_fsdp

    import fsdp2

    assert fsdp2.MixedPrecisionPolicy is torch_fsdp.MixedPrecisionPolicy
    assert fsdp2.CPUOffloadPolicy is torch_fsdp.CPUOffloadPolicy
    mp = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    theirs, ours = twins(lambda: GPT(CFG), lambda m, fs: shard_blocks_then_root(m, fs, mp_policy=mp))
    train_side_by_side(theirs, ours, rank, ws, steps=2)


def test_pytorch_policy_objects_are_accepted(worlds):
    worlds.run(2, _policies)


def _divide_factor(rank, ws):
    def before(model, step):
        if step == 0:
            model.set_force_sum_reduction_for_comms(True)  # PyTorch's PREMUL_SUM does not exist on gloo
            model.set_gradient_divide_factor(1.0)  # on the root only: not recursive in PyTorch

    theirs, ours = twins(lambda: GPT(CFG), shard_blocks_then_root)
    train_side_by_side(theirs, ours, rank, ws, steps=2, optimizer=torch.optim.SGD, before_step=before)


def test_gradient_divide_factor_is_not_recursive(worlds):
    worlds.run(2, _divide_factor)


def _reduce_in(rank, ws, reduce_dtype):
    import torch.distributed.fsdp as torch_fsdp

    mp = torch_fsdp.MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    theirs, ours = twins(lambda: GPT(CFG), lambda m, fs: shard_blocks_then_root(m, fs, mp_policy=mp))
    train_side_by_side(theirs, ours, rank, ws, steps=2, optimizer=torch.optim.SGD)


@pytest.mark.parametrize("reduce_dtype", [torch.float16, torch.float64], ids=["fp16", "fp64"])
def test_gradients_reduced_in_fp16_or_fp64_divide_like_pytorch(worlds, reduce_dtype):
    """Dtypes other than fp32/bf16 are divided partly before the sum (a power of two near
    sqrt(N)) and the rest after, as PyTorch does; at 4 ranks that is 2 and 2."""
    worlds.run(4, _reduce_in, reduce_dtype)


def _default_reduce_dtype(rank, ws, accumulate):
    from fsdp2 import compat
    from fsdp2.compat import TorchDispatchMode

    class ReduceScatterDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d" and "reduce_scatter" in str(func.overloadpacket):
                self.dtypes.add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    def loss_fn(model, x, y):
        if accumulate:  # a backward without sync first: its gradients wait in the reduce dtype
            model.set_requires_gradient_sync(False)
            model.loss(x[:1], y[:1]).backward()
            model.set_requires_gradient_sync(True)
        return model.loss(x, y)

    mp = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # reduce_dtype: the default
    theirs, ours = twins(lambda: GPT(CFG), lambda m, fs: shard_blocks_then_root(m, fs, mp_policy=mp))
    seen = []
    for model in (theirs, ours):
        with ReduceScatterDtypes() as recorder:
            model.loss(*step_batch(9, rank, ws)).backward()
        seen.append(recorder.dtypes)
        model.zero_grad()
    expected = torch.float32 if compat.REDUCE_DTYPE_DEFAULTS_TO_GRAD_DTYPE else torch.bfloat16
    assert seen == [{expected}, {expected}], seen
    train_side_by_side(theirs, ours, rank, ws, steps=2, loss_fn=loss_fn)


@pytest.mark.parametrize("accumulate", [False, True], ids=["sync", "accumulate"])
def test_default_reduce_dtype_follows_the_installed_pytorch(worlds, accumulate):
    """``MixedPrecisionPolicy(reduce_dtype=None)``: gradients are reduced in ``param_dtype`` up to
    torch 2.14, in the parameter's own dtype from 2.15 (its unset ``grad_dtype``), as PyTorch's FSDP2
    on the installed release."""
    worlds.run(2, _default_reduce_dtype, accumulate)


def _tied_weights_in_bf16(rank, ws, accumulate):
    import dataclasses

    mp = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cfg = dataclasses.replace(CFG, tie_weights=True)  # the embedding is also the output head
    theirs, ours = twins(lambda: GPT(cfg), lambda m, fs: shard_blocks_then_root(m, fs, mp_policy=mp))

    def loss_fn(model, x, y):  # two backwards without sync before the synced one
        model.set_requires_gradient_sync(False)
        for row in range(2):
            model.loss(x[row : row + 1], y[row : row + 1]).backward()
        model.set_requires_gradient_sync(True)
        return model.loss(x, y)

    train_side_by_side(theirs, ours, rank, ws, steps=2, loss_fn=loss_fn if accumulate else None)


@pytest.mark.parametrize("accumulate", [False, True], ids=["sync", "accumulate"])
def test_gradients_of_several_uses_add_up_in_the_dtype_pytorch_adds_them(worlds, accumulate):
    """bf16 parameters, fp32 reduction, a parameter used twice in each backward (the tied embedding
    and output head): its uses' gradients add up in the dtype the installed PyTorch's FSDP2 adds
    them in. From torch 2.15 that is fp32 in a backward without sync that starts the sum (it gives
    the unsharded parameter a ``grad_dtype``), bf16 in the others; before 2.15 bf16 in all."""
    worlds.run(2, _tied_weights_in_bf16, accumulate)


def _last_backward_before_forward(rank, ws):
    theirs, ours = twins(lambda: GPT(CFG), shard_blocks_then_root)
    for model in (theirs, ours):
        model.set_is_last_backward(False)  # 1F1B microbatching sets it before the first forward
    x, y = step_batch(0, rank, ws)
    for model in (theirs, ours):
        model.loss(x, y).backward()
        model.set_is_last_backward(True)
        model.loss(x, y).backward()
    assert_same_params(theirs, ours)
    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), name


def test_set_is_last_backward_before_first_forward(worlds):
    worlds.run(2, _last_backward_before_forward)


def _k_then_true(rank, ws):
    from fsdp2.runtime.param_group import GroupState

    theirs, ours = twins(lambda: GPT(CFG), lambda m, fs: shard_blocks_then_root(m, fs, reshard_after_forward=2))
    for model in (theirs, ours):
        model.set_reshard_after_forward(True)
    group = ours.blocks[0]._fsdp_state.group
    x, y = step_batch(0, rank, ws)
    loss = ours.loss(x, y)
    assert group.state == GroupState.SHARDED  # no 1/k copy kept any more
    loss.backward()
    theirs.loss(x, y).backward()  # the same extra gradients on both sides
    train_side_by_side(theirs, ours, rank, ws, steps=2)


def test_set_reshard_after_forward_true_drops_the_kth_copy(worlds):
    worlds.run(4, _k_then_true)


class _CheckpointedGPT(GPT):
    def forward(self, tokens):
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.lm_head(self.ln_f(x))


def _prefetch_with_checkpointing(rank, ws):
    def shard(model, fully_shard):
        shard_blocks_then_root(model, fully_shard)
        blocks = list(model.blocks)
        for a, b in zip(blocks, blocks[1:]):
            a.set_modules_to_forward_prefetch([b])

    theirs, ours = twins(lambda: _CheckpointedGPT(CFG), shard)
    train_side_by_side(theirs, ours, rank, ws, steps=2)


def test_forward_prefetch_with_activation_checkpointing_gathers_like_pytorch(worlds):
    """The recompute in backward must not issue forward prefetches again (18 vs 12 gathers)."""
    worlds.run(2, _prefetch_with_checkpointing)


def _api_surface():
    import inspect

    import torch.distributed.fsdp as torch_fsdp

    import fsdp2

    public = lambda cls: {n for n in vars(cls) if not n.startswith("_") and callable(getattr(cls, n))}  # noqa: E731
    missing = public(torch_fsdp.FSDPModule) - public(fsdp2.FSDPModule)
    signatures = {}
    for name in public(torch_fsdp.FSDPModule):
        if name in missing:
            continue
        theirs = inspect.signature(getattr(torch_fsdp.FSDPModule, name))
        ours = inspect.signature(getattr(fsdp2.FSDPModule, name))
        if [(p.name, p.kind, p.default) for p in theirs.parameters.values()] != [
            (p.name, p.kind, p.default) for p in ours.parameters.values()
        ]:
            signatures[name] = (str(theirs), str(ours))
    theirs = inspect.signature(torch_fsdp.fully_shard).parameters
    ours = inspect.signature(fsdp2.fully_shard).parameters
    theirs = [(n, p.kind, p.default) for n, p in theirs.items()]
    ours = [(n, p.kind, p.default) for n, p in ours.items()]
    # fsdp2 keeps the newest release's signature (torch 2.13 added dp_mesh_dims); an older torch's
    # must be its prefix, and what fsdp2 has beyond it must be keyword-only with a default.
    newer = {"dp_mesh_dims"}
    args = ours[: len(theirs)] == theirs and all(
        n in newer and kind is inspect.Parameter.KEYWORD_ONLY and default is None
        for n, kind, default in ours[len(theirs) :]
    )
    # FSDP2's exports, told from FSDP1's by the module that defines them.
    fsdp2_names = {
        n
        for n in torch_fsdp.__all__
        if getattr(getattr(torch_fsdp, n), "__module__", "").startswith(
            ("torch.distributed.fsdp._fully_shard", "torch.distributed.fsdp._composable")
        )
    }
    fsdp2_names |= {"fully_shard", "FSDPModule", "MixedPrecisionPolicy"}
    exports = {n for n in fsdp2_names if n in torch_fsdp.__all__ and not hasattr(fsdp2, n)}
    return missing, signatures, args, exports


def test_api_matches_the_installed_pytorch():
    """Every public FSDPModule method and fully_shard argument of the installed torch exists in
    fsdp2 with the same signature: a torch release that adds one fails here."""
    missing, signatures, args_match, exports = _api_surface()
    assert not missing, f"FSDPModule methods PyTorch has and fsdp2 lacks: {sorted(missing)}"
    assert not signatures, f"signatures differ from PyTorch's: {signatures}"
    assert args_match, "fully_shard's parameters differ from PyTorch's"
    assert not exports, f"torch.distributed.fsdp exports fsdp2 lacks: {sorted(exports)}"
    import fsdp2

    assert callable(fsdp2.fully_shard.state)


def _named_mesh_dims(rank, ws):
    """dp_mesh_dims names the data-parallel dims of a whole mesh; fsdp2 then shards exactly as
    with the mesh slice passed directly (bitwise). PyTorch 2.13 ties dp_mesh_dims to DTensor
    parameters on the full SPMD mesh, so this is checked against the slice, not side by side."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2 import DataParallelMeshDims, fully_shard

    for names, shape, dims, dp_names in [
        (("dp", "other"), (ws, 1), DataParallelMeshDims(shard="dp"), "dp"),
        (("rep", "shard"), (2, ws // 2), DataParallelMeshDims(shard="shard", replicate="rep"), ("rep", "shard")),
    ]:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        torch.manual_seed(0)
        base = GPT(CFG)
        sliced, named = copy.deepcopy(base), copy.deepcopy(base)
        for module in [*sliced.blocks, sliced]:
            fully_shard(module, mesh=mesh[dp_names])
        for module in [*named.blocks, named]:
            fully_shard(module, mesh=mesh, dp_mesh_dims=dims)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (sliced, named)]
        for step in range(2):
            losses = [side_by_side_step(m, o, step, rank, ws)[0] for m, o in zip((sliced, named), opts)]
            assert torch.equal(losses[0], losses[1]), (dims, step)
        assert_same_params(sliced, named)
    with pytest.raises(Exception, match="not in the mesh"):
        fully_shard(GPT(CFG), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="nope"))


def test_dp_mesh_dims_name_the_data_parallel_dims(worlds):
    worlds.run(4, _named_mesh_dims)


def _spmd_mlp_net():
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(MLP() for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x

    return Net()


def _full_spmd_mesh(rank, ws, case):
    """Parameters that are DTensors on the whole mesh (torchtitan's full_dtensor backend): forward
    sees them as DTensors there, gathered on the data-parallel dims only, bitwise as PyTorch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    if case == "context_parallel":  # two data-parallel shard dims, flattened (dp_shard x cp)
        names, dims = ("dp_shard", "cp"), DataParallelMeshDims(shard=("dp_shard", "cp"))
        input_placements = (Shard(0), Shard(0))

        def placements_of(module, name):
            return (Replicate(), Replicate())

    else:  # tensor parallel on the non-data-parallel dim: colwise up, rowwise down
        names, dims = ("dp", "tp"), DataParallelMeshDims(shard="dp")
        input_placements = (Shard(0), Replicate())

        def placements_of(module, name):
            if module.out_features == 16:
                return (Replicate(), Shard(0))
            return (Replicate(), Shard(1)) if name == "weight" else (Replicate(), Replicate())

    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=names)
    unsharded = {}

    def shard(model, fully_shard):
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                dtensor = distribute_tensor(p.detach(), mesh, placements_of(module, name))
                module._parameters[name] = nn.Parameter(dtensor)
        seen = unsharded.setdefault(fully_shard.__module__, [])
        model.blocks[0].up.register_forward_pre_hook(lambda m, _: seen.append((type(m.weight), m.weight.placements)))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
        fully_shard(model, mesh=mesh, dp_mesh_dims=dims)

    theirs, ours = twins(_spmd_mlp_net, shard)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    for step in range(2):
        x = distribute_tensor(torch.randn(8, 8, generator=torch.Generator().manual_seed(step)), mesh, input_placements)
        results = [
            side_by_side_step(m, opt, step, rank, ws, loss_fn=lambda m, *_: m(x).pow(2).mean().full_tensor())
            for m, opt in zip((theirs, ours), opts)
        ]
        assert torch.equal(results[0][0], results[1][0]), (case, step)
        assert results[0][1] == results[1][1], (case, step, results)
    assert_same_params(theirs, ours)
    for a, b in zip(theirs.parameters(), ours.parameters()):
        assert (a.device_mesh.mesh_dim_names, a.placements) == (b.device_mesh.mesh_dim_names, b.placements)
    their_seen, our_seen = unsharded.values()
    assert our_seen == their_seen and our_seen[0] == (DTensor, placements_of(theirs.blocks[0].up, "weight")), unsharded


@_needs_pytorch_2_13("dp_mesh_dims")
@pytest.mark.parametrize("case", ["context_parallel", "tensor_parallel"])
def test_dp_mesh_dims_on_parameters_of_the_full_mesh_like_pytorch(worlds, case):
    worlds.run(4, _full_spmd_mesh, case)


class _Experts(nn.Module):
    def __init__(self, n=4, dim=8, hidden=16):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, dim, hidden) * 0.1)
        self.w2 = nn.Parameter(torch.randn(n, hidden, dim) * 0.1)

    def forward(self, h, gate):
        out = torch.einsum("bd,edf->bef", h, self.w1).relu()
        return (torch.einsum("bef,efd->bed", out, self.w2) * gate.unsqueeze(-1)).sum(1)


class _MoE(nn.Module):
    """Dense layers around soft-routed experts (an MoE layer without the token dispatch)."""

    def __init__(self):
        super().__init__()
        self.dense, self.router, self.experts, self.out = nn.Linear(8, 8), nn.Linear(8, 4), _Experts(), nn.Linear(8, 3)

    def forward(self, x):
        h = self.dense(x)
        return self.out(h + self.experts(h, self.router(h).softmax(-1)))


def _moe_loss(model, step, rank, ws):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4 * ws, 8, generator=g), torch.randint(0, 3, (4 * ws,), generator=g)
    return lambda m, *_: F.cross_entropy(m(x[4 * rank : 4 * rank + 4]), y[4 * rank : 4 * rank + 4])


def _per_parameter_meshes(rank, ws):
    """PyTorch 2.13's ShardPlacementResult: experts on their own (ep x efsdp) mesh, replicated
    across ep (HSDP), dense parameters on the default one, in one fully_shard call: two groups,
    each with its own collectives; a result on the call's own mesh is its placement."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (ws,))
    expert_mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("ep", "efsdp"))
    expert_info = HSDPMeshInfo(expert_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)

    def experts_apart(model):
        experts = {id(p) for p in model.experts.parameters()}
        return lambda p: ShardPlacementResult(None, expert_info) if id(p) in experts else None

    def shard(model, fully_shard):
        fully_shard(model, mesh=mesh, shard_placement_fn=experts_apart(model))

    theirs, ours = twins(_MoE, shard)
    assert len(ours._fsdp_state.groups) == 2
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    for step in range(3):
        results = [
            side_by_side_step(m, opt, step, rank, ws, loss_fn=_moe_loss(m, step, rank, ws))
            for m, opt in zip((theirs, ours), opts)
        ]
        assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1], (step, results)
    assert_same_params(theirs, ours)
    for a, b in zip(theirs.parameters(), ours.parameters()):
        assert (a.device_mesh, a.placements) == (b.device_mesh, b.placements)

    this_mesh = FSDPMeshInfo(mesh, shard_mesh_dim=0)  # PyTorch wants one object per mesh

    def dim_one_on_this_mesh(p):
        return ShardPlacementResult(Shard(1) if p.dim() == 2 else None, this_mesh)

    theirs, ours = twins(
        _MoE, lambda m, fully_shard: fully_shard(m, mesh=mesh, shard_placement_fn=dim_one_on_this_mesh)
    )
    assert ours.dense.weight.placements == (Shard(1),)
    train_side_by_side(theirs, ours, rank, ws, loss_fn=lambda m, x, y: m(x.float()[:, :8]).sum())


@_needs_pytorch_2_13("ShardPlacementResult")
def test_shard_placement_result_per_parameter_mesh(worlds):
    worlds.run(4, _per_parameter_meshes)


def _deepcopy_refused(rank, ws):
    from fsdp2.errors import FSDPUsageError

    theirs, ours = twins(lambda: GPT(CFG), shard_blocks_then_root)
    for model in (theirs, ours):
        # (what is copied, the sharded module the error names): a plain ModuleList of sharded blocks too
        for module, named in ((model, "FSDPGPT"), (model.blocks[0], "FSDPBlock"), (model.blocks, "FSDPBlock")):
            # PyTorch's own test: assertRaisesRegex(AssertionError, "FSDP does not support deepcopy")
            with pytest.raises(AssertionError, match="FSDP does not support deepcopy") as raised:
                copy.deepcopy(module)
            if model is ours:
                assert isinstance(raised.value, FSDPUsageError)
                assert named in str(raised.value) and "state_dict()" in str(raised.value)


def test_deepcopy_of_a_sharded_module_raises_like_pytorch(worlds):
    worlds.run(2, _deepcopy_refused)


def _containers_refused(rank, ws):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor

    from fsdp2 import fully_shard

    for container in (nn.ModuleList([nn.Linear(4, 4)]), nn.ModuleDict({"a": nn.Linear(4, 4)})):
        for shard in (torch_fully_shard, fully_shard):
            with pytest.raises(
                ValueError, match="fully_shard does not support containers that do not implement forward"
            ):
                shard(container, mesh=world_mesh())
        assert not any(isinstance(p, DTensor) for p in container.parameters())  # left as it was

    class Stack(nn.ModuleList):  # a container with a forward of its own is a module like any other
        def forward(self, x):
            for layer in self:
                x = layer(x)
            return x

    x = torch.randn(2, 4)
    if not _PYTORCH_2_13:  # PyTorch's FSDP2 refused every ModuleList/ModuleDict before, forward or not
        torch.manual_seed(0)
        reference = Stack([nn.Linear(4, 4), nn.Linear(4, 4)])
        ours = fully_shard(copy.deepcopy(reference), mesh=world_mesh())
        assert torch.equal(reference(x), ours(x))
        return
    theirs, ours = twins(
        lambda: Stack([nn.Linear(4, 4), nn.Linear(4, 4)]), lambda m, shard: shard(m, mesh=world_mesh())
    )
    assert torch.equal(theirs(x), ours(x))


def test_fully_shard_refuses_module_list_and_dict_like_pytorch(worlds):
    """Their forward is never called, so their hooks would never gather (PyTorch refuses them)."""
    worlds.run(2, _containers_refused)


# -- tensor-subclass all-gather hooks (fsdp_pre_all_gather / fsdp_post_all_gather) -------------------


def _subclass_gpt(int8_mlp=True):
    """The test GPT with hook-carrying weights: bf16-gathered attention and head (67 rows: uneven
    over 2 and 4 ranks), int8 + row-scale gathered MLP (even; bf16-gathered if not ``int8_mlp``)."""
    from tests.runtime.gather_subclasses import Bf16Gathered, Int8Gathered

    def swap(linear, cls):
        linear.weight = nn.Parameter(cls(linear.weight.detach().clone()))

    model = GPT(CFG)
    for block in model.blocks:
        swap(block.attn.qkv, Bf16Gathered)
        swap(block.attn.proj, Bf16Gathered)
        swap(block.mlp[0], Int8Gathered if int8_mlp else Bf16Gathered)
        swap(block.mlp[2], Int8Gathered if int8_mlp else Bf16Gathered)
    swap(model.lm_head, Bf16Gathered)
    return model


def _assert_same_local_params(theirs, ours):
    from tests.runtime.gather_subclasses import unwrap

    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert type(a.to_local()) is type(b.to_local()), name
        assert torch.equal(unwrap(a.to_local()), unwrap(b.to_local())), f"parameter {name} differs from PyTorch FSDP2"


def _subclass_hooks(rank, ws, reshard_after_forward, int8_mlp=True):
    from fsdp2.runtime.extensions import SubclassCodec

    kwargs = dict(reshard_after_forward=reshard_after_forward)
    theirs, ours = twins(lambda: _subclass_gpt(int8_mlp), lambda m, fs: shard_blocks_then_root(m, fs, **kwargs))
    codecs = {type(p.codec) for s in (ours.blocks[0]._fsdp_state, ours._fsdp_state) for p in s.group.params}
    assert SubclassCodec in codecs and len(codecs) == 2  # hook-carrying weights next to plain biases and norms
    their_opt, our_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2), torch.optim.AdamW(ours.parameters(), lr=1e-2)
    for step in range(3):  # the first unshard builds the parameter, later ones refill it through out=
        their_loss, their_comm = side_by_side_step(theirs, their_opt, step, rank, ws)
        our_loss, our_comm = side_by_side_step(ours, our_opt, step, rank, ws)
        assert torch.equal(their_loss, our_loss), (step, their_loss.item(), our_loss.item())
        # One all-gather per group, mixed dtypes; at world size 1 fsdp2 communicates nothing.
        assert their_comm == our_comm or ws == 1, (step, their_comm, our_comm)
        _assert_same_local_params(theirs, ours)
        for p in ours.blocks[0]._fsdp_state.group.params:  # resharded: outputs and inner tensors freed
            if isinstance(p.codec, SubclassCodec):
                assert all(t.untyped_storage().size() == 0 for t in (*p.codec._outputs, *p.codec._inner)), p.fqn


def test_tensor_subclass_all_gather_hooks_like_pytorch(worlds):
    """Both hook signatures (bf16 cast, 5 arguments, uneven head; int8 + scales, 1 argument),
    trained next to PyTorch's FSDP2: bitwise equal losses and parameters, equal collectives."""
    worlds.run(2, _subclass_hooks, True)
    # One rank: the hooks still run, around no collective. PyTorch 2.13 itself fails there for a
    # pre hook returning two inputs (its post hook receives one), so this side by side uses the
    # one-input hooks.
    worlds.run(1, _subclass_hooks, True, False)


def _subclass_hooks_kept_rows(rank, ws):
    """reshard_after_forward=2, which PyTorch refuses for hook parameters: the gathered inputs
    are kept and re-gathered over 2 ranks; the numbers match PyTorch resharding fully."""
    from tests.runtime.gather_subclasses import unwrap

    theirs = _subclass_gpt_pair_for(rank, ws, True)[0]
    ours = _subclass_gpt_pair_for(rank, ws, 2)[1]
    their_opt, our_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2), torch.optim.AdamW(ours.parameters(), lr=1e-2)
    for step in range(2):
        their_loss, _ = side_by_side_step(theirs, their_opt, step, rank, ws)
        our_loss, _ = side_by_side_step(ours, our_opt, step, rank, ws)
        assert torch.equal(their_loss, our_loss), step
        _assert_same_local_params(theirs, ours)
    x, y = step_batch(5, rank, ws)
    ours.loss(x, y)
    assert ours.blocks[0]._fsdp_state.group.state.name == "PARTIALLY_SHARDED"
    assert unwrap(ours.blocks[0].attn.qkv.weight.to_local()).dtype == torch.float32


def _subclass_gpt_pair_for(rank, ws, reshard_after_forward):
    return twins(
        _subclass_gpt, lambda m, fs: shard_blocks_then_root(m, fs, reshard_after_forward=reshard_after_forward)
    )


def test_tensor_subclass_hooks_with_reshard_after_forward_int(worlds):
    worlds.run(4, _subclass_hooks_kept_rows)


def _subclass_hook_errors(rank, ws):
    from torch.distributed.tensor import Shard

    from fsdp2 import FSDPModule, FSDPUsageError, fully_shard
    from tests.runtime.gather_subclasses import Bf16Gathered, PreOnly, WrongArity

    def model_with(cls):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
        weight = model[1].weight
        model[1].weight = nn.Parameter(cls(weight.detach().clone()))
        return model

    cases = [
        (PreOnly, {}, "defines fsdp_pre_all_gather but not fsdp_post_all_gather"),
        (WrongArity, {}, "takes 2 arguments"),
        (
            Bf16Gathered,
            {"shard_placement_fn": lambda p: Shard(1) if isinstance(p, Bf16Gathered) else None},
            "dim-0 shards",
        ),
    ]
    for cls, kwargs, message in cases:
        model = model_with(cls)
        before = dict(model.named_parameters())
        with pytest.raises(FSDPUsageError, match=message) as error:
            fully_shard(model, mesh=world_mesh(), **kwargs)
        assert "parameter 1.weight" in str(error.value)
        assert not isinstance(model, FSDPModule) and dict(model.named_parameters()) == before  # nothing changed


def test_tensor_subclass_hook_errors(worlds):
    worlds.run(2, _subclass_hook_errors)


# -- defects --------------------------------------------------------------------------------------------


def _to_dtype(rank, ws):
    theirs, ours = twins(lambda: GPT(CFG), shard_blocks_then_root)
    for model in (theirs, ours):
        model.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in ours.parameters())
    train_side_by_side(theirs, ours, rank, ws, steps=2)
    # and a bf16 model moved back to fp32
    theirs, ours = twins(lambda: GPT(CFG).to(torch.bfloat16), shard_blocks_then_root)
    for model in (theirs, ours):
        model.to(torch.float32)
    train_side_by_side(theirs, ours, rank, ws, steps=2)


def test_module_to_dtype_after_fully_shard(worlds):
    worlds.run(2, _to_dtype)


def _replaced_params(rank, ws):
    """Meta init -> fully_shard -> load_state_dict(assign=True), the rank-0-broadcast flow."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from fsdp2 import fully_shard

    torch.manual_seed(0)
    full = GPT(CFG).state_dict()

    def build():
        with torch.device("meta"):
            return GPT(CFG)

    theirs, ours = twins(build, shard_blocks_then_root)
    for model in (theirs, ours):
        current = model.state_dict()
        sharded = {k: distribute_tensor(full[k], v.device_mesh, v.placements) for k, v in current.items()}
        model.load_state_dict(sharded, assign=True)
    assert all(isinstance(p, DTensor) and not p.is_meta for p in ours.parameters())
    train_side_by_side(theirs, ours, rank, ws, steps=2)
    # fsdp2 also takes full tensors with assign=True (each rank keeps its own box).
    with torch.device("meta"):
        meta = GPT(CFG)
    model = shard_blocks_then_root(meta, fully_shard)
    model.load_state_dict(full, assign=True)
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), full[name]), name
    # A parameter assigned by hand before the first forward is used too.
    model.lm_head.weight = nn.Parameter(distribute_tensor(torch.zeros(67, 36), world_mesh(), [Shard(0)]))
    x, _ = step_batch(0, rank, ws)
    assert torch.count_nonzero(model(x)) == 0


def test_parameters_replaced_after_fully_shard_are_used(worlds):
    worlds.run(2, _replaced_params)


def _state_dict_while_unsharded(rank, ws):
    from torch.distributed.tensor import DTensor

    theirs, ours = twins(lambda: GPT(CFG), lambda m, fs: shard_blocks_then_root(m, fs, reshard_after_forward=False))
    x, y = step_batch(0, rank, ws)
    for model in (theirs, ours):
        model.loss(x, y)  # grad-enabled forward, no backward: everything stays gathered
    sd_theirs, sd_ours = theirs.state_dict(), ours.state_dict()
    assert all(isinstance(v, DTensor) for v in sd_ours.values()), [
        k for k, v in sd_ours.items() if not isinstance(v, DTensor)
    ]
    for key, value in sd_theirs.items():
        assert torch.equal(value.full_tensor(), sd_ours[key].full_tensor()), key


def test_state_dict_while_unsharded_returns_dtensors(worlds):
    worlds.run(2, _state_dict_while_unsharded)


def _dataclass_activations(rank, ws):
    # The tokens are floats here: 16 of them feed a 12-wide model through a slice.
    def loss_fn(model, x, y):
        return model.loss(x[:, :12], y)

    theirs, ours = twins(DataclassModel, lambda m, fs: shard_blocks_then_root(m, fs, reshard_after_forward=True))
    if torch.__version__ >= "2.13":
        train_side_by_side(theirs, ours, rank, ws, loss_fn=loss_fn)
        return
    # PyTorch before 2.13 reads freed parameters here itself: check against an unsharded replica
    # trained on every rank's batch instead.
    torch.manual_seed(0)
    train_parity(rank, ws, ours, DataclassModel(), loss_fn=loss_fn)


def test_dataclass_activations_between_blocks(worlds):
    worlds.run(2, _dataclass_activations)


def _jvp(rank, ws):
    from fsdp2 import fully_shard

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    model = copy.deepcopy(reference)
    fully_shard(model[0], mesh=world_mesh())
    fully_shard(model, mesh=world_mesh())
    x, v = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        out, tangent = torch.func.jvp(model, (x,), (v,))
    ref_out, ref_tangent = torch.func.jvp(reference, (x,), (v,))
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(tangent, ref_tangent)


def test_torch_func_jvp_through_fsdp_modules(worlds):
    worlds.run(2, _jvp)


class _Float8Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.codebook = nn.Parameter(torch.randn(6, 8).to(torch.float8_e4m3fn), requires_grad=False)
        self.l = nn.Linear(8, 6)

    def forward(self, x):
        return self.l(x) + x @ self.codebook.to(torch.float32).t()


def _frozen_float8(rank, ws):
    from fsdp2 import fully_shard

    torch.manual_seed(0)
    reference = _Float8Frozen()
    model = fully_shard(copy.deepcopy(reference), mesh=world_mesh())
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    model(x).sum().backward()
    assert model.codebook.grad is None and model.l.weight.grad is not None


def test_frozen_float8_parameter_gathers_over_gloo(worlds):
    worlds.run(2, _frozen_float8)


class _Adapted(nn.Module):
    """A frozen base layer with a trainable low-rank adapter beside it (LoRA's shape): backward
    reads the frozen weight for the input's gradient after the adapter's gradients are done."""

    def __init__(self, dim=16, rank=4):
        super().__init__()
        self.base = nn.Linear(dim, dim).requires_grad_(False)
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def _frozen_base_with_adapter(rank, ws):
    def build():
        # The first block's input needs no gradient (a frozen stem), the second's does.
        return nn.Sequential(nn.Linear(16, 16).requires_grad_(False), _Adapted(), _Adapted(), nn.Linear(16, 4))

    def shard(model, fully_shard):
        for block in (model[1], model[2]):
            fully_shard(block, mesh=world_mesh())
        fully_shard(model, mesh=world_mesh())

    theirs, ours = twins(build, shard)
    loss_fn = lambda model, x, y: model(torch.nn.functional.one_hot(x % 16, 16).float()).sum()  # noqa: E731
    train_side_by_side(theirs, ours, rank, ws, steps=2, loss_fn=loss_fn)


def test_frozen_base_layer_read_after_its_adapters_gradients(worlds):
    worlds.run(2, _frozen_base_with_adapter)


def _replicate_over_fsdp(rank, ws):
    from torch.distributed._composable.replicate import replicate

    def shard(model, fully_shard):
        mesh = world_mesh()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        replicate(model)  # DDP for the root's own parameters

    theirs, ours = twins(lambda: GPT(CFG), shard)
    train_side_by_side(theirs, ours, rank, ws, steps=2)


def test_replicate_wrapping_fsdp_modules(worlds):
    worlds.run(2, _replicate_over_fsdp)


class _HiddenGPT(GPT):
    """Returns the normed hidden states; the loss calls ``lm_head`` itself, chunk by chunk."""

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def _chunked_loss(model, x, y, chunks=2):
    """torchtitan's chunked cross-entropy: the head runs per chunk, each chunk's loss is
    backpropagated to a detached copy of the hidden states right away, then their gradient
    through the trunk. So the head's group runs forward again after a backward in the step."""
    h = model(x)
    detached = h.detach().requires_grad_()
    total = torch.zeros(())
    for h_chunk, y_chunk in zip(detached.chunk(chunks, dim=1), y.chunk(chunks, dim=1)):
        loss = F.cross_entropy(model.lm_head(h_chunk).flatten(0, 1), y_chunk.flatten()) / chunks
        loss.backward()
        total += loss.detach()
    h.backward(detached.grad)
    return total


def _chunked_loss_synced_once(model, x, y, chunks=2):
    """The chunked loss with the head gathered once up front and its gradients reduced with the
    last chunk only (``unshard`` and ``set_requires_gradient_sync`` on the group)."""
    model.lm_head.unshard()
    model.lm_head.set_requires_gradient_sync(False, recurse=False)
    h = model(x)
    detached = h.detach().requires_grad_()
    total = torch.zeros(())
    pieces = list(zip(detached.chunk(chunks, dim=1), y.chunk(chunks, dim=1)))
    for i, (h_chunk, y_chunk) in enumerate(pieces):
        model.lm_head.set_requires_gradient_sync(i == len(pieces) - 1, recurse=False)
        loss = F.cross_entropy(model.lm_head(h_chunk).flatten(0, 1), y_chunk.flatten()) / chunks
        loss.backward()
        total += loss.detach()
    h.backward(detached.grad)
    return total


def _chunked_loss_side_by_side(rank, ws, loss_fn, reshard_after_forward):
    def shard(model, fully_shard):
        mesh = world_mesh()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard([model.ln_f, model.lm_head], mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh)

    theirs, ours = twins(lambda: _HiddenGPT(CFG), shard)
    train_side_by_side(theirs, ours, rank, ws, loss_fn=loss_fn)


@_needs_pytorch_2_13("handling of a grouped module run alone after forward (chunked loss) to compare with")
@pytest.mark.parametrize(
    "loss_fn, reshard_after_forward",
    [(_chunked_loss, False), (_chunked_loss, None), (_chunked_loss_synced_once, False)],
)
def test_group_module_run_after_a_backward_is_gathered_again(worlds, loss_fn, reshard_after_forward):
    """Regression: the second chunk's head got the DTensor shards (the group's modules still
    to run were never reset after the first chunk's backward)."""
    worlds.run(2, _chunked_loss_side_by_side, loss_fn, reshard_after_forward)


def _gpt_with_reentrant_checkpoints():
    model = GPT(CFG)
    model.blocks = nn.ModuleList(ReentrantCheckpointBlock(block) for block in model.blocks)
    return model


def _shard_nested(model, fully_shard):
    # reshard_after_forward=True: fsdp2 also frees a kept root after a no-grad forward (nothing
    # needs it gathered), PyTorch keeps it; with True both gather the same.
    mesh = world_mesh()
    for block in model.blocks:
        fully_shard(block.inner, mesh=mesh, reshard_after_forward=True)
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)


def _policy_and_reference_loss(model, x, y):
    """DPO-style: a forward with gradients, then one without, then one backward."""
    policy = model.loss(x, y)
    with torch.no_grad():
        reference = model.loss(x.flip(0), y.flip(0))
    return policy - 0.5 * reference


def _two_forwards_side_by_side(rank, ws):
    theirs, ours = twins(_gpt_with_reentrant_checkpoints, _shard_nested)
    train_side_by_side(theirs, ours, rank, ws, loss_fn=_policy_and_reference_loss)


@_needs_pytorch_2_13("re-gathering for a recompute after its group's backward (two forwards) to compare with")
def test_two_forwards_then_backward_with_reentrant_checkpointing(worlds):
    """Regression: the recompute in backward found its group's all-gather in flight (prefetched)
    and ran on the DTensor shards instead of waiting for it."""
    worlds.run(2, _two_forwards_side_by_side)


# -- launching ----------------------------------------------------------------------------------------


@pytest.mark.slow  # ranks started by torchrun
def test_mesh_none_without_process_group_initializes_from_the_environment(tmp_path):
    """As PyTorch: no mesh and no process group -> init_process_group() from env:// (torchrun's
    variables); without them a clear error that names torchrun."""
    script = textwrap.dedent(
        """
        import sys, torch.nn as nn, torch.distributed as dist
        from fsdp2 import fully_shard, FSDPUsageError
        if sys.argv[1] == "env":
            m = fully_shard(nn.Linear(4, 4))
            print("initialized", dist.is_initialized(), dist.get_world_size(), type(m).__name__)
        else:
            try:
                fully_shard(nn.Linear(4, 4))
            except FSDPUsageError as e:
                print("error", "torchrun" in str(e))
        """
    )
    path = tmp_path / "launch.py"
    path.write_text(script)
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    base["PYTHONPATH"] = os.getcwd()
    env = dict(base, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", LOCAL_RANK="0")
    ok = subprocess.run([sys.executable, str(path), "env"], env=env, capture_output=True, text=True, timeout=120)
    assert "initialized True 1 FSDPLinear" in ok.stdout, ok.stderr[-2000:]
    bad = subprocess.run([sys.executable, str(path), "none"], env=base, capture_output=True, text=True, timeout=120)
    assert "error True" in bad.stdout, bad.stderr[-2000:]


def test_mesh_none_on_a_build_whose_accelerator_is_unusable_uses_cpu(fake_world, monkeypatch):
    """A CUDA build on a machine without a GPU (or driver) reports "cuda" as its accelerator
    unless asked whether one is available: the default mesh must then be a CPU mesh."""
    from fsdp2 import fully_shard

    def cuda_build_without_driver(check_available=False):
        return None if check_available else torch.device("cuda")

    monkeypatch.setattr(torch.accelerator, "current_accelerator", cuda_build_without_driver)
    fake_world(2)
    model = fully_shard(nn.Linear(4, 4))
    assert model.weight.device_mesh.device_type == "cpu" and model.weight.device.type == "cpu"


@pytest.mark.slow  # ranks started by torchrun
def test_torch_logs_fsdp_shows_hook_events_named_like_pytorch(tmp_path):
    """``TORCH_LOGS=+fsdp`` turns on fsdp2's hook events, named as PyTorch names its own: by the
    event and the group's module paths from the root (``layers.0``, ``norm, output``), not classes."""
    script = textwrap.dedent(
        """
        import sys, torch, torch.nn as nn, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        if sys.argv[1] == "fsdp2":
            from fsdp2 import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Linear(4, 4)
                self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
                self.norm, self.output = nn.LayerNorm(4), nn.Linear(4, 1)

            def forward(self, x):
                x = self.embed(x)
                for layer in self.layers:
                    x = layer(x)
                return self.output(self.norm(x))

        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29523", rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        model = Model()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard([model.norm, model.output], mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(torch.randn(2, 4)).sum().backward()
        dist.destroy_process_group()
        """
    )
    path = tmp_path / "logs.py"
    path.write_text(script)
    env = dict(os.environ, TORCH_LOGS="+fsdp", PYTHONPATH=os.getcwd())
    events = {}
    for implementation in ("torch", "fsdp2"):
        out = subprocess.run(
            [sys.executable, str(path), implementation], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-3000:]
        lines = [line[line.index("FSDP::") :] for line in out.stderr.splitlines() if "FSDP::" in line]
        events[implementation] = {line for line in lines if not line.startswith("FSDP::lazy_init")}
    assert "FSDP::pre_forward (layers.0)" in events["torch"]  # the scenario names groups at all
    assert events["fsdp2"] == events["torch"]


# -- set_reduce_scatter_unused_params -----------------------------------------------------------------

# Per step, per rank: (blocks run with their parameters unused, blocks run at all beyond the
# always-run ones). Rank-dependent steps are the setting's reason to exist (one rank's control
# flow leaves a block's parameters out, the other's does not).
UNUSED_SCHEDULE = [
    ({0: (), 1: ()}, ()),
    ({0: (), 1: ("first",)}, ()),  # one rank leaves a block unused
    ({0: ("second",), 1: ("second",)}, ()),  # every rank leaves it unused
    ({0: ("first",), 1: ()}, ("late",)),  # a block gathered for the first time
    ({0: ("late",), 1: ("late", "first")}, ("late",)),
    ({0: (), 1: ()}, ()),  # a block gathered before and not run at all this step
]


def _reduce_scatter_unused(rank, ws, enabled):
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from tests.support.models import SkippableBlocks

    # A group with a short timeout: a rank left waiting in a collective fails the test in seconds.
    mesh = DeviceMesh.from_group(dist.new_group(timeout=datetime.timedelta(seconds=15)), "cpu")

    def shard(model, fully_shard):
        for block in (model.first, model.second, model.late):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    theirs, ours = twins(SkippableBlocks, shard)
    theirs.set_reduce_scatter_unused_params(enabled)
    ours.set_reduce_scatter_unused_params(enabled)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    # Without the setting a rank-dependent step would leave PyTorch's FSDP2 waiting as well.
    schedule = [s for s in UNUSED_SCHEDULE if enabled or s[0][0] == s[0][1]]
    for step, (skips, run) in enumerate(schedule):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        for model in (theirs, ours):
            model(x, skips[rank], run).square().mean().backward()
        for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
            assert (a.grad is None) == (b.grad is None), (step, name, a.grad is None)
            if a.grad is not None:
                assert torch.equal(a.grad.to_local(), b.grad.to_local()), (step, name)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        assert_same_params(theirs, ours)


@pytest.mark.parametrize("enabled", [True, False], ids=["reduced-as-zeros", "not-reduced"])
def test_reduce_scatter_unused_params_like_pytorch(worlds, enabled):
    """Blocks whose forward runs with their parameters unused, on one rank or on every rank, a
    block first gathered in a later step and one not run in a step: PyTorch's FSDP2 reduces zeros
    for every parameter of a group gathered before (so AdamW moves them by momentum) when the
    setting is on, and nothing when it is off (then on steps every rank takes alike); equal
    gradients (None included) and parameters."""
    worlds.run(2, _reduce_scatter_unused, enabled)
