"""Feature tests: every fully_shard feature trained/compared against an unsharded reference.

Each rank function builds the same reference model (``torch.manual_seed(0)`` runs before every
call), trains it on the *global* batch in this process, and trains the sharded copy on its
own slice of that batch. With equal slices, the average of the per-rank mean losses equals the
global mean loss and the averaged gradients equal the global-batch gradient, so losses and
final parameters must match within fp32 tolerance (tests/support/parity.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2 import CPUOffloadPolicy, FSDPModule, fully_shard, register_fsdp_forward_method
from fsdp2.models.gpt import GPT, Block, GPTConfig
from tests.support.models import CFG, ReentrantCheckpointBlock
from tests.support.parity import (
    STEPS,
    assert_all_sharded,
    assert_grads_match,
    assert_near,
    assert_params_match,
    full_tensor,
    global_batch,
    gpt_pair,
    mean_over_ranks,
    rank_slice,
    shard_gpt,
    step_and_zero,
    train_parity,
)


# -- plain training ------------------------------------------------------------------------------


def _plain_training(rank, ws):
    model, ref = gpt_pair()
    for name, param in model.named_parameters():
        assert isinstance(param, nn.Parameter) and isinstance(param, DTensor), name
        assert param.placements == (Shard(0),), name
    return train_parity(rank, ws, model, ref)


@pytest.mark.parametrize("ws", [2, 4])
def test_training_matches_unsharded(worlds, ws):
    losses = worlds.run(ws, _plain_training)
    assert all(loss == losses[0] for loss in losses)


def _shard_dim_one(rank, ws):
    ref = GPT(CFG)
    model = shard_gpt(copy.deepcopy(ref), shard_placement_fn=lambda p: Shard(p.dim() - 1) if p.dim() == 2 else None)
    assert model.lm_head.weight.placements == (Shard(1),)
    assert model.ln_f.weight.placements == (Shard(0),)
    train_parity(rank, ws, model, ref)


def test_shard_placement_fn_dim_one(worlds):
    worlds.run(4, _shard_dim_one)


# -- meta-device init -----------------------------------------------------------------------------


def _meta_init(rank, ws):
    ref = GPT(CFG)
    with torch.device("meta"):
        model = GPT(CFG)
    shard_gpt(model)
    for param in model.parameters():
        assert param.device.type == "meta"
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for name, param in model.named_parameters():
        full = dict(ref.named_parameters())[name]
        expected = list(full.shape)
        expected[0] = len(full.chunk(ws, 0)[rank]) if rank < len(full.chunk(ws, 0)) else 0
        local = param.to_local()
        assert local.device.type == "cpu", name
        # Exactly this rank's rows: no full-size tensor was ever materialized for it.
        assert list(local.shape) == expected, (name, local.shape, expected)
        assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), name
        assert torch.isfinite(local).all(), name
    # A step on the freshly initialized model works and leaves finite shards.
    tokens, targets = global_batch(0, ws)
    model.loss(rank_slice(tokens, rank, ws), rank_slice(targets, rank, ws)).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    opt.zero_grad()
    for name, param in model.named_parameters():
        assert torch.isfinite(param.to_local()).all(), name
    # Parity after loading the reference's full tensors.
    model.load_state_dict(ref.state_dict())
    assert_params_match(model, ref, "loaded")
    train_parity(rank, ws, model, ref)


def test_meta_device_init(worlds):
    worlds.run(4, _meta_init)


# -- parameters that are tied, frozen or ignored ----------------------------------------------------


def _tied(rank, ws):
    cfg = GPTConfig(**{**CFG.__dict__, "tie_weights": True})
    model, ref = gpt_pair(cfg)
    assert model.lm_head.weight is model.tok_emb.weight
    assert isinstance(model.tok_emb.weight, DTensor)
    assert len(list(model.parameters())) == len(list(ref.parameters()))
    train_parity(rank, ws, model, ref)
    assert model.lm_head.weight is model.tok_emb.weight


def test_tied_weights(worlds):
    worlds.run(2, _tied)


def _frozen(rank, ws):
    ref = GPT(CFG)
    for m in (ref.tok_emb, ref.pos_emb, ref.blocks[0].ln1):
        m.requires_grad_(False)
    model = shard_gpt(copy.deepcopy(ref))
    train_parity(rank, ws, model, ref)
    for name, param in model.named_parameters():
        frozen = name.startswith(("tok_emb", "pos_emb", "blocks.0.ln1"))
        assert param.requires_grad != frozen, name
        assert param.grad is None, name


def test_frozen_params(worlds):
    worlds.run(2, _frozen)


def _frozen_after_fully_shard(rank, ws):
    from fsdp2.runtime import collectives

    model, ref = gpt_pair()
    train_parity(rank, ws, model, ref, steps=1)  # gradients flowed everywhere once
    for m in (model, ref):
        for sub in (m.tok_emb, m.blocks[0]):
            sub.requires_grad_(False)
    frozen_before = {n: p.full_tensor() for n, p in model.named_parameters() if not p.requires_grad}
    reduced = []
    real_reduce = collectives.reduce_scatter
    collectives.reduce_scatter = lambda out, inp, group, async_op, op: (
        reduced.append(inp.numel()) or real_reduce(out, inp, group, async_op, op)
    )
    try:
        train_parity(rank, ws, model, ref)
    finally:
        collectives.reduce_scatter = real_reduce
    for name, param in model.named_parameters():
        if name in frozen_before:
            assert param.grad is None, name
            assert torch.equal(param.full_tensor(), frozen_before[name]), name
    # Block 0 is entirely frozen: only block 1 and the root reduce-scatter, once per step each.
    assert len(reduced) == 2 * STEPS, reduced


def test_freezing_after_fully_shard(worlds):
    worlds.run(2, _frozen_after_fully_shard)


def _ignored(rank, ws):
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ignored = {model.pos_emb.weight, model.blocks[1].ln2.bias}
    for block in model.blocks:
        fully_shard(block, ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)
    for name, param in model.named_parameters():
        if any(param is p for p in ignored):
            assert not isinstance(param, DTensor), name
        else:
            assert isinstance(param, DTensor), name
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(STEPS):
        tokens, targets = global_batch(step, ws)
        model.loss(rank_slice(tokens, rank, ws), rank_slice(targets, rank, ws)).backward()
        ref.loss(tokens, targets).backward()
        for p in ignored:  # fsdp2 leaves ignored params to the user: average them ourselves
            p.grad = mean_over_ranks(p.grad)
        step_and_zero(opt, ref_opt)
    assert_params_match(model, ref)
    for p in ignored:
        assert not isinstance(p, DTensor)


def test_ignored_params(worlds):
    worlds.run(2, _ignored)


# -- unusual forwards ---------------------------------------------------------------------------------


class _TwiceGPT(GPT):
    """Applies its first block twice per forward."""

    def forward(self, tokens):
        x = self.blocks[0](self.embed(tokens))
        return self.head(self.blocks[1](self.blocks[0](x)))


def _called_twice(rank, ws):
    ref = _TwiceGPT(CFG)
    model = shard_gpt(copy.deepcopy(ref))
    train_parity(rank, ws, model, ref)


def test_module_called_twice_per_step(worlds):
    worlds.run(2, _called_twice)


class _DictBlock(nn.Module):
    """Takes a dict (and a kwarg), returns a (tensor, dict) tuple."""

    def __init__(self, dim):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, inputs, *, scale=1.0):
        x, y = inputs["x"], inputs["aux"][0]
        h = torch.tanh(self.a(x)) * scale
        return h + y, {"h": h, "side": [self.b(y), inputs["tag"]]}


class _DictModel(nn.Module):
    def __init__(self, dim=36):
        super().__init__()
        self.inner = _DictBlock(dim)
        self.head = nn.Linear(dim, 5)

    def forward(self, batch):
        out, extra = self.inner({"x": batch["x"], "aux": (batch["y"],), "tag": "t"}, scale=0.5)
        assert extra["side"][1] == "t"
        logits = self.head(out + extra["side"][0])
        return {"logits": logits, "pair": (extra["h"], batch["x"])}


def _nested_loss(model, x, y):
    out = model({"x": x, "y": y * 2})
    return out["logits"].square().mean() + out["pair"][0].sum() * 1e-3


def _nested_io(rank, ws):
    ref = _DictModel()
    model = copy.deepcopy(ref)
    fully_shard(model.inner)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * ws, 36, generator=g), torch.randn(4 * ws, 36, generator=g)
        loss = _nested_loss(model, rank_slice(x, rank, ws), rank_slice(y, rank, ws))
        loss.backward()
        # The sum term scales with the batch: compare against the reference's per-rank mean.
        ref_loss = sum(_nested_loss(ref, rank_slice(x, r, ws), rank_slice(y, r, ws)) for r in range(ws)) / ws
        ref_loss.backward()
        assert_near(mean_over_ranks(loss), ref_loss.detach(), "loss")
        assert_grads_match(model, ref)
        step_and_zero(opt, ref_opt)
    assert_params_match(model, ref)
    assert_all_sharded(model)


def test_nested_inputs_and_outputs(worlds):
    worlds.run(2, _nested_io)


# -- state dict ------------------------------------------------------------------------------------


def _state_dict(rank, ws):
    model, ref = gpt_pair()
    # Train a step so the values are not just the initial ones.
    train_parity(rank, ws, model, ref, steps=1)
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    for key, value in sd.items():
        assert isinstance(value, DTensor), key
        assert_near(value.full_tensor(), ref_sd[key], key)
    saved = {k: v.clone() for k, v in sd.items()}  # state_dict() values alias the parameters
    assert all(isinstance(v, DTensor) for v in saved.values())
    # Load a full-tensor state dict from another model...
    other = GPT(CFG)
    model.load_state_dict(other.state_dict())
    assert_params_match(model, other, "after full load")
    # ...and a DTensor state dict (ours, saved earlier) back.
    model.load_state_dict(saved)
    assert_params_match(model, ref, "after DTensor load")
    # Loading keeps the same parameter objects (an optimizer holding them stays valid).
    before = [id(p) for p in model.parameters()]
    model.load_state_dict(other.state_dict())
    assert [id(p) for p in model.parameters()] == before
    # Training still matches after a load.
    ref.load_state_dict(other.state_dict())
    train_parity(rank, ws, model, ref, steps=1)


def test_state_dict_round_trip(worlds):
    worlds.run(4, _state_dict)


# -- manual unshard / reshard and prefetching ---------------------------------------------------------


def _unshard_reshard(rank, ws):
    model, ref = gpt_pair()
    block = model.blocks[0]
    block.unshard()
    for name, param in block.named_parameters():
        assert not isinstance(param, DTensor), name
        assert_near(param.detach(), dict(ref.blocks[0].named_parameters())[name].detach(), name)
    block.reshard()
    assert all(isinstance(p, DTensor) for p in block.parameters())
    handle = model.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    assert not isinstance(model.lm_head.weight, DTensor)
    assert_near(model.lm_head.weight.detach(), ref.lm_head.weight.detach(), "lm_head")
    assert isinstance(model.blocks[1].mlp[0].weight, DTensor)  # not the children's params
    model.reshard()

    # Manually unsharding a block ahead of each forward still trains like the reference. (Not
    # before building the optimizer: parameters() would then list the unsharded tensors.)
    def loss_fn(m, x, y):
        if m is model:
            m.blocks[1].unshard(async_op=True)
        return m.loss(x, y)

    train_parity(rank, ws, model, ref, loss_fn=loss_fn)


def test_unshard_reshard(worlds):
    worlds.run(2, _unshard_reshard)


def _prefetch(rank, ws):
    model, ref = gpt_pair()
    blocks = list(model.blocks)
    model.set_modules_to_forward_prefetch([blocks[0]])
    blocks[0].set_modules_to_forward_prefetch([blocks[1]])
    blocks[1].set_modules_to_backward_prefetch([blocks[0]])
    blocks[0].set_modules_to_backward_prefetch([])
    train_parity(rank, ws, model, ref, steps=3)


def test_explicit_prefetch(worlds):
    worlds.run(2, _prefetch)


def _implicit_backward_prefetch(rank, ws):
    from fsdp2.runtime.param_group import GroupState, ParamGroup

    model, _ = gpt_pair()
    names = {id(block._fsdp_state.group): f"blocks.{i}" for i, block in enumerate(model.blocks)}
    calls = []
    original = ParamGroup.unshard

    def logged(group, *args, **kwargs):
        calls.append((names.get(id(group), "root"), group.state))
        return original(group, *args, **kwargs)

    ParamGroup.unshard = logged
    try:
        loss = model.loss(*global_batch(0, 1))
        calls.clear()
        loss.backward()
    finally:
        ParamGroup.unshard = original
    # Every block's all-gather was already in flight when its own pre-backward asked for it:
    # the root (first in backward) prefetches the last block, each block the one before it.
    in_flight = {name for name, state in calls if state == GroupState.UNSHARDING}
    assert in_flight == set(names.values()), calls


def test_implicit_backward_prefetch_covers_every_block(worlds):
    worlds.run(2, _implicit_backward_prefetch)


class _GenGPT(GPT):
    def greedy_next(self, tokens):
        """A non-forward entry point that uses the root's own params directly."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)[:, -1].argmax(-1)


def _forward_method(rank, ws):
    ref = _GenGPT(CFG)
    model = shard_gpt(copy.deepcopy(ref))
    register_fsdp_forward_method(model, "greedy_next")
    tokens, _ = global_batch(0, ws)
    with torch.no_grad():
        got = model.greedy_next(tokens)
        expected = ref.greedy_next(tokens)
    assert torch.equal(got, expected)
    assert_all_sharded(model)
    # With grad: the root stays unsharded (waiting for a backward) until resharded by hand.
    model.greedy_next(tokens)
    assert not isinstance(model.lm_head.weight, DTensor)
    assert isinstance(model.blocks[0].mlp[0].weight, DTensor)
    model.reshard()
    train_parity(rank, ws, model, ref)


def test_register_fsdp_forward_method(worlds):
    worlds.run(2, _forward_method)


# -- gradients -----------------------------------------------------------------------------------


def _clip_grad_norm(rank, ws):
    model, ref = gpt_pair()
    tokens, targets = global_batch(0, ws)
    model.loss(rank_slice(tokens, rank, ws), rank_slice(targets, rank, ws)).backward()
    ref.loss(tokens, targets).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.1)
    assert ref_norm > 0.1  # so that clipping actually scales
    assert_near(full_tensor(norm), ref_norm, "total norm")
    assert_grads_match(model, ref)


def test_clip_grad_norm(worlds):
    worlds.run(4, _clip_grad_norm)


def _divide_factor(rank, ws):
    model, ref = gpt_pair()
    # Not recursive (as in PyTorch): the root's own parameters are summed, the blocks' averaged.
    model.set_gradient_divide_factor(1.0)
    tokens, targets = global_batch(0, ws)
    model.loss(rank_slice(tokens, rank, ws), rank_slice(targets, rank, ws)).backward()
    ref.loss(tokens, targets).backward()
    block_params = {id(p) for p in model.blocks.parameters()}
    for name, param in model.named_parameters():
        scale = 1 if id(param) in block_params else ws
        assert_near(full_tensor(param.grad), scale * dict(ref.named_parameters())[name].grad, f"grad {name}")


def test_gradient_divide_factor(worlds):
    worlds.run(2, _divide_factor)


class _CheckpointedBlock(Block):
    def forward(self, x):
        def attn(x):
            return x + self.attn(self.ln1(x))

        x = torch.utils.checkpoint.checkpoint(attn, x, use_reentrant=False)
        return torch.utils.checkpoint.checkpoint(lambda y: y + self.mlp(self.ln2(y)), x, use_reentrant=False)


def _activation_checkpointing(rank, ws):
    ref = GPT(CFG)
    for block in ref.blocks:
        block.__class__ = _CheckpointedBlock
    model = shard_gpt(copy.deepcopy(ref))
    train_parity(rank, ws, model, ref)


def test_activation_checkpointing(worlds):
    worlds.run(2, _activation_checkpointing)


def _checkpoint_whole_block(rank, ws):
    class Outer(GPT):
        def forward(self, tokens):
            x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1]))
            for block in self.blocks:  # recompute runs the FSDP block's hooks again
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            return self.lm_head(self.ln_f(x))

    ref = Outer(CFG)
    model = shard_gpt(copy.deepcopy(ref))
    train_parity(rank, ws, model, ref)


def test_activation_checkpointing_around_fsdp_block(worlds):
    worlds.run(2, _checkpoint_whole_block)


def _two_forwards_loss(model, tokens, targets):
    # Two forwards with gradients before one backward (DPO's chosen and rejected): each block's
    # reentrant recompute runs its own backward, so a group's gradients arrive twice per backward.
    return model.loss(tokens, targets) - 0.5 * model.loss(tokens.flip(1), targets.flip(1))


def _two_forwards_reentrant(rank, ws):
    ref = GPT(CFG)
    ref.blocks = nn.ModuleList(ReentrantCheckpointBlock(block) for block in ref.blocks)
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fully_shard(block.inner)
        fully_shard(block)
    fully_shard(model)
    train_parity(rank, ws, model, ref, loss_fn=_two_forwards_loss)


def test_two_forwards_with_reentrant_checkpointing_reduce_every_gradient(worlds):
    """Regression: the second forward's gradients were dropped (the group had already reduced)
    or computed on the shards. Checked against the unsharded model: PyTorch 2.13's FSDP2 itself
    gives these blocks wrong gradients (differences ~1e-2 on this model)."""
    worlds.run(2, _two_forwards_reentrant)


# -- resharding policies -------------------------------------------------------------------------


def _reshard_after_backward_false(rank, ws):
    model, ref = gpt_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(STEPS):
        tokens, targets = global_batch(step, ws)
        # One-row microbatches; keep the parameters gathered between them, reshard after the last.
        xs, ys = rank_slice(tokens, rank, ws).split(1), rank_slice(targets, rank, ws).split(1)
        for micro, (x, y) in enumerate(zip(xs, ys)):
            last = micro == len(xs) - 1
            model.set_reshard_after_backward(last)
            (model.loss(x, y) / len(xs)).backward()
            if not last:
                assert not isinstance(model.blocks[0].mlp[0].weight, DTensor), "resharded after backward"
        ref.loss(tokens, targets).backward()
        assert_all_sharded(model)
        assert_grads_match(model, ref)
        step_and_zero(opt, ref_opt)
    assert_params_match(model, ref)


def test_set_reshard_after_backward_false(worlds):
    worlds.run(2, _reshard_after_backward_false)


def _reshard_after_forward_int(rank, ws, value, expect_sharded):
    model, ref = gpt_pair(reshard_after_forward=value)
    tokens, targets = global_batch(0, ws)
    out = model(rank_slice(tokens, rank, ws))
    assert isinstance(model.blocks[0].mlp[0].weight, DTensor) == expect_sharded
    out.sum().backward()
    assert_all_sharded(model)
    model.zero_grad()
    train_parity(rank, ws, model, ref)


@pytest.mark.parametrize("value", ["one", "half", "world"])
def test_reshard_after_forward_int(worlds, value):
    ws = 4
    size = {"one": 1, "half": ws // 2, "world": ws}[value]
    worlds.run(ws, _reshard_after_forward_int, size, value != "one")


def _no_grad_forward(rank, ws):
    model, ref = gpt_pair(reshard_after_forward=False)
    tokens, _ = global_batch(0, ws)
    with torch.no_grad():
        out = model(tokens)
    assert_near(out, ref(tokens).detach(), "no_grad logits")
    assert_all_sharded(model)  # even the root and reshard_after_forward=False blocks
    train_parity(rank, ws, model, ref)


def test_no_grad_forward_leaves_everything_resharded(worlds):
    worlds.run(2, _no_grad_forward)


# -- HSDP, offload, gradient accumulation ---------------------------------------------------------------


def _hsdp(rank, ws):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref = GPT(CFG)
    model = shard_gpt(copy.deepcopy(ref), mesh=mesh)
    for name, param in model.named_parameters():
        assert param.placements == (Replicate(), Shard(0)), name
        shard_rank = mesh.get_local_rank("shard")
        rows = ref.get_parameter(name).chunk(2, 0)
        assert param.to_local().shape == (rows[shard_rank].shape if shard_rank < len(rows) else (0,)), name
    # Every rank is its own data-parallel rank (2 replicas x 2 shards).
    train_parity(rank, ws, model, ref)


def test_hsdp_2x2(worlds):
    worlds.run(4, _hsdp)


def _cpu_offload(rank, ws):
    model, ref = gpt_pair(offload_policy=CPUOffloadPolicy(pin_memory=False))
    train_parity(rank, ws, model, ref)
    for name, param in model.named_parameters():
        assert param.to_local().device.type == "cpu", name


def test_cpu_offload(worlds):
    worlds.run(2, _cpu_offload)


def _no_sync_microbatches(rank, ws, n_micro):
    model, ref = gpt_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(STEPS):
        tokens, targets = global_batch(step, ws)
        xs, ys = rank_slice(tokens, rank, ws).chunk(n_micro), rank_slice(targets, rank, ws).chunk(n_micro)
        for micro in range(n_micro):
            last = micro == n_micro - 1
            model.set_requires_gradient_sync(last)
            loss = model.loss(xs[micro], ys[micro]) / n_micro
            model.set_is_last_backward(last)
            loss.backward()
            if not last:
                # Nothing was communicated: no sharded gradient yet, everything resharded.
                assert all(p.grad is None for p in model.parameters())
                assert_all_sharded(model)
        ref.loss(tokens, targets).backward()
        assert_grads_match(model, ref)
        step_and_zero(opt, ref_opt)
    assert_params_match(model, ref)
    assert_all_sharded(model)


def test_gradient_accumulation_without_sync(worlds):
    worlds.run(2, _no_sync_microbatches, 3)


def _microbatches_reaching_other_parameters(rank, ws, keeps, precision):
    """An accumulation of two microbatches, the first keeping its sums (``keeps``: without gradient
    sync, or HSDP 2x2 without the all-reduce), that reach different parameters: ``extra`` only the
    first, ``spare`` only the second; both get the unsharded model's gradients (``unused`` none).
    With bf16 parameters and fp32 reductions a bucket then packs kept fp32 sums beside fresh bf16
    gradients."""
    from fsdp2 import MixedPrecisionPolicy
    from tests.support.models import OptionalLayers, shard_optional_layers
    from tests.support.parity import accumulated_reference_grads, assert_reference_grads

    reference = OptionalLayers()
    kwargs, dtype = {}, torch.float32
    if precision == "bf16":
        dtype = torch.bfloat16
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard")) if keeps == "partial" else None
    model = shard_optional_layers(copy.deepcopy(reference), mesh or init_device_mesh("cpu", (ws,)), **kwargs)
    microbatches = [(0, ("extra",)), (1, ("spare",))]
    for micro, use in microbatches:
        if keeps == "partial":
            model.set_requires_all_reduce(micro == 1)
        else:
            model.set_requires_gradient_sync(micro == 1)
        OptionalLayers.loss(model, micro, rank, use).backward()
    assert_reference_grads(model, accumulated_reference_grads(reference, microbatches, ws, dtype))


@pytest.mark.parametrize(
    "keeps, precision, ws",
    [("unsynced", "fp32", 2), ("unsynced", "bf16", 2), ("partial", "fp32", 4)],
    ids=["no-sync", "no-sync-bf16", "hsdp-no-all-reduce"],
)
def test_microbatches_of_one_accumulation_reaching_other_parameters(worlds, keeps, precision, ws):
    worlds.run(ws, _microbatches_reaching_other_parameters, keeps, precision)


def _synced_microbatches_in_flight(rank, ws, n_micro):
    """Every microbatch reduces, with up to 8 reductions in flight inside a backward, and each
    backward, the last or not, ends with its gradients in ``.grad`` (as PyTorch's FSDP2 writes
    them): a padded bucket (67 vocabulary rows on 2 ranks) finds its kept input buffer free again
    at every reduction."""
    from fsdp2.runtime.reduce import PaddedScatterInput

    model, ref = gpt_pair()
    model.set_reduce_scatter_max_input_buffers(8)
    fills = []
    original_fill = PaddedScatterInput.fill

    def fill(self, grads, **kwargs):
        fills.append(self)
        return original_fill(self, grads, **kwargs)

    PaddedScatterInput.fill = fill
    try:
        for step in range(2):
            tokens, targets = global_batch(step, ws)
            xs, ys = rank_slice(tokens, rank, ws).chunk(n_micro), rank_slice(targets, rank, ws).chunk(n_micro)
            for micro in range(n_micro):
                model.set_is_last_backward(micro == n_micro - 1)
                (model.loss(xs[micro], ys[micro]) / n_micro).backward()
                assert all(p.grad is not None for p in model.parameters())
            ref.loss(tokens, targets).backward()
            assert_grads_match(model, ref)
            for module in (model, ref):
                module.zero_grad(set_to_none=True)
    finally:
        PaddedScatterInput.fill = original_fill
    assert len(fills) == 2 * n_micro  # the padded bucket's kept buffer served all its reductions
    assert_all_sharded(model)


def test_synced_microbatches_with_reductions_in_flight(worlds):
    worlds.run(2, _synced_microbatches_in_flight, 3)


def _padding_reads_as_nan(rank, ws, with_hook):
    """fsdp2 leaves the padding of its kept buffers unwritten (the reduce-scatter input's; the
    all-gather output's, copied out only where real rows are): poisoned with NaN here, it
    reaches no gradient, and a user's all-reduce hook still sees zeros there, as with PyTorch's
    FSDP2 (the reduce-scatter input's padding is zeroed for it)."""
    from fsdp2.runtime.gather import ReusedGatherOutput
    from fsdp2.runtime.reduce import PaddedScatterInput

    model, ref = gpt_pair()  # 67 vocabulary rows, 3 x 36 qkv rows on 2 ranks: padded
    seen = []
    if with_hook:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(lambda output: seen.append(output.clone()))
    original_fill, original_allocate = PaddedScatterInput.fill, ReusedGatherOutput.allocate
    poisoned = []

    def fill(self, grads, **kwargs):
        self.buffer.untyped_storage().resize_(self._nbytes)  # what fill() does first
        poisoned.append(self.buffer.fill_(float("nan")))
        return original_fill(self, grads, **kwargs)

    def allocate(self):
        poisoned.append(original_allocate(self).fill_(float("nan")))
        return self.buffer

    PaddedScatterInput.fill, ReusedGatherOutput.allocate = fill, allocate
    try:
        for step in range(2):  # the kept buffers' second use: storage regrown
            tokens, targets = global_batch(step, ws)
            model.loss(rank_slice(tokens, rank, ws), rank_slice(targets, rank, ws)).backward()
            ref.loss(tokens, targets).backward()
            assert_grads_match(model, ref)
            for module in (model, ref):
                module.zero_grad(set_to_none=True)
    finally:
        PaddedScatterInput.fill, ReusedGatherOutput.allocate = original_fill, original_allocate
    assert poisoned, "no kept buffer served this step: the test poisons nothing"
    assert len(seen) == (6 if with_hook else 0)  # 3 groups, 2 steps
    assert not any(output.isnan().any() for output in seen), "the hook saw unzeroed padding"


@pytest.mark.parametrize("with_hook", [False, True])
def test_padding_left_unwritten_reaches_no_gradient(worlds, with_hook):
    worlds.run(2, _padding_reads_as_nan, with_hook)


@pytest.mark.parametrize("device,hook,zeroed", [("cpu", False, False), ("cpu", True, True), ("cuda", False, True)])
def test_reduce_scatter_padding_is_zeroed_where_something_reads_it(device, hook, zeroed):
    """Only CPU steps leave the padding as the allocator gave it: a user's hook sees the buffer
    whole, and on a GPU NCCL's TORCH_NCCL_NAN_CHECK reads collective inputs (uninitialized padding
    could trip it), so there it is zeroed (one kernel)."""
    from types import SimpleNamespace

    from fsdp2.runtime.group_step import ReduceSettings
    from fsdp2.runtime.reduce import GroupReduce

    reduce = SimpleNamespace(
        settings=ReduceSettings(all_reduce_hook=(lambda t: None) if hook else None),
        dp=SimpleNamespace(device=torch.device(device)),
    )
    assert GroupReduce._output_seen_whole.fget(reduce) is zeroed
