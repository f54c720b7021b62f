"""Low-precision all-gather (``AllGatherPolicy``, set with ``FSDPModule.set_all_gather_policy``).

- Parity: every gathered parameter equals what tests/runtime/test_quantize.py's float64 reference
  quantizer makes of the master's padded rank slots, exactly (2 and 3 ranks, uneven shards,
  padding inside dim-1 slots, HSDP 2x2, TP + FSDP 2x2, CPU offload); 1-D parameters travel as
  plain ``param_dtype``; the master shards are never touched.
- ``reshard_after_forward=2`` on 4 ranks: what is kept after forward are the gathered wire
  rows (values + scales, half the bytes of bf16 rows), re-gathered over 2 ranks in backward and
  dequantized again: backward sees exactly forward's values, by construction.
- Quality: 20 steps of the test GPT within 1% of the bf16 all-gather's loss at every step
  (the 300-step run is a benchmark: benchmarks/RESULTS.md); compiled blocks compose.
- Bytes: ``count_comm`` equals ``estimate_memory``'s prediction exactly (per-group policies,
  forward prefetch); <= 0.53x of bf16's on the benchmark GPT. Checkpoints hold the
  full-precision masters. Misuse raises FSDPUsageError.
"""

import pytest
import torch

from fsdp2.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=67, seq_len=16, dim=36, n_layers=2, n_heads=3)
WIDE = GPTConfig(vocab_size=67, seq_len=16, dim=40, n_layers=2, n_heads=4)  # 40 columns: uneven over 3 ranks
BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _policy(name: str, **kwargs):
    from fsdp2 import AllGatherPolicy

    return AllGatherPolicy({"int8": torch.int8, "float8": torch.float8_e4m3fn}[name], **kwargs)


def _states(model):
    return [m._fsdp_state for m in model.modules() if "_fsdp_state" in m.__dict__]


def _batch(step, rank, ws, dp_rank=None):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CFG.vocab_size, (2 * ws, CFG.seq_len + 1), generator=g)
    r = rank if dp_rank is None else dp_rank
    return tokens[2 * r : 2 * r + 2, :-1], tokens[2 * r : 2 * r + 2, 1:]


# -- the reference: what a rank must receive for one parameter ---------------------------------------


def _master_input(p, group):
    """The tensor fully_shard split (the full parameter, or its TP-local part), from every rank's shard."""
    import torch.distributed as dist

    shards = [None] * dist.get_world_size(group)
    dist.all_gather_object(shards, p.local_shard.detach().cpu(), group=group)
    return torch.cat(shards, dim=p.layout.dim)


def _reference_gathered(p, group, policy):
    from tests.support.quantize_reference import reference_dequantize, reference_quantize

    layout = p.layout
    slots = torch.empty(layout.world, layout.padded_shard_numel, dtype=p.local_shard.dtype)
    layout.copy_full_in(_master_input(p, group), slots)  # zero padding, as each rank's slot holds it
    n = layout.padded_shard_numel
    rows = torch.stack(
        [reference_dequantize(reference_quantize(slot, policy)[0], n, policy, p.param_dtype) for slot in slots]
    )
    return layout.copy_full_out(rows, torch.empty(layout.world * n, dtype=p.param_dtype)).clone()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _check_gathered(model, policy) -> int:
    """Unshard every group by hand and compare each parameter with the reference; returns how
    many parameters were quantized."""
    from fsdp2.runtime.codecs import PlainCodec, QuantizedCodec

    quantized = 0
    for state in _states(model):
        group = state.group
        masters = [p.local_shard.clone() for p in group.params]
        state.modules[0].unshard()
        for p, master in zip(group.params, masters):
            gathered = _local(p.unsharded_param).detach()
            if p.sharded_param.ndim >= 2:
                assert isinstance(p.codec, QuantizedCodec), p.fqn
                expected = _reference_gathered(p, group.dp.shard_group, policy)
                quantized += 1
            else:  # skip_1d: gathered as they are, in param_dtype
                assert isinstance(p.codec, PlainCodec), p.fqn
                expected = _master_input(p, group.dp.shard_group).to(p.param_dtype)
            assert gathered.dtype == expected.dtype and torch.equal(gathered, expected), p.fqn
        state.modules[0].reshard()
        for p, master in zip(group.params, masters):
            assert torch.equal(p.local_shard, master), f"{p.fqn}: the master shard changed"
    return quantized


def _gathered_parity(rank, ws, *, qdtype, mp, wide_dim1, offload):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = GPT(WIDE if wide_dim1 else CFG)
    mesh = init_device_mesh("cpu", (ws,))
    kwargs = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(**mp),
        offload_policy=CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy(),
        # Dim-1 shards of 40 columns over 3 ranks: padding inside every rank's slot.
        shard_placement_fn=(lambda p: Shard(1) if p.ndim == 2 else None) if wide_dim1 else None,
    )
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    policy = _policy(qdtype, **({"block_size": 32, "scale_dtype": torch.float32} if wide_dim1 else {}))
    model.set_all_gather_policy(policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(0, rank, ws)
    model.loss(x, y).backward()  # a step first: gathered values come from trained masters
    opt.step()
    return _check_gathered(model, policy)


@pytest.mark.parametrize(
    "ws,qdtype,mp,wide_dim1,offload",
    [
        (2, "int8", BF16, False, False),
        (2, "float8", BF16, False, True),
        (3, "int8", {}, True, False),  # fp32 params, fp32 scales, block 32, dim-1 shards
        (3, "float8", BF16, False, False),
    ],
    ids=["2-int8-bf16", "2-float8-bf16-offload", "3-int8-fp32-dim1", "3-float8-bf16"],
)
def test_gathered_parameters_equal_the_reference_quantizer(worlds, ws, qdtype, mp, wide_dim1, offload):
    counts = worlds.run(ws, _gathered_parity, qdtype=qdtype, mp=mp, wide_dim1=wide_dim1, offload=offload)
    assert counts[0] == 2 + 4 * CFG.n_layers + 1  # embeddings, 4 matrices per block, head


def _gathered_parity_2d(rank, ws, use_tp):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fsdp2 import MixedPrecisionPolicy, fully_shard
    from fsdp2.models import Llama, LlamaConfig, tensor_parallel_plan

    torch.manual_seed(0)
    names = ("dp", "tp") if use_tp else ("replicate", "shard")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    dp_mesh = mesh["dp"] if use_tp else mesh
    model = copy.deepcopy(Llama(LlamaConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4, hidden_dim=48)))
    mp = MixedPrecisionPolicy(**BF16)
    for block in model.blocks:
        if use_tp:
            parallelize_module(block, mesh["tp"], tensor_parallel_plan())
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    policy = _policy("int8", block_size=16)
    model.set_all_gather_policy(policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank = mesh["dp"].get_local_rank() if use_tp else rank
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))[2 * dp_rank : 2 * dp_rank + 2]
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    return _check_gathered(model, policy)


@pytest.mark.parametrize("use_tp", [False, True], ids=["hsdp-2x2", "tp-fsdp-2x2"])
def test_gathered_parameters_on_2d_meshes(worlds, use_tp):
    assert worlds.run(4, _gathered_parity_2d, use_tp)[0] > 0


# -- reshard_after_forward=2: keep the wire rows ---------------------------------------------------------


def _subgroup_rows(rank, ws):
    from fsdp2 import MixedPrecisionPolicy, fully_shard
    from fsdp2.tools.comm_stats import count_comm

    torch.manual_seed(0)
    model = GPT(CFG)
    mp = MixedPrecisionPolicy(**BF16)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=2, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.set_all_gather_policy(_policy("int8"))
    seen = {"forward": [], "backward": []}
    weight = lambda block: block.mlp[0].weight.detach().clone()  # noqa: E731

    def in_backward(module, args, out):
        # A hook on the block's output runs after fsdp2's own pre-backward hook there: gathered.
        out.register_hook(lambda grad: seen["backward"].append(weight(module)))

    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, args: seen["forward"].append(weight(m)))
        block.register_forward_hook(in_backward)
    x, y = _batch(0, rank, ws)
    with count_comm() as forward:
        loss = model.loss(x, y)
    group = model.blocks[0]._fsdp_state.group
    kept = [(t.dtype, t.numel() * t.element_size()) for t in group._subgroup_rows]
    with count_comm() as backward:
        loss.backward()
    # Backward runs the blocks in reverse: its values must be forward's, bit for bit.
    for f, b in zip(seen["forward"], reversed(seen["backward"])):
        assert f.dtype == torch.bfloat16 and torch.equal(f, b)
    per_block = forward.bytes["all_gather"] - _root_gather_bytes(model)
    return kept, forward.calls["all_gather"], backward.calls["all_gather"], per_block, backward.bytes["all_gather"]


def _root_gather_bytes(model):
    from fsdp2.runtime.buckets import gather_row_bytes

    group = model._fsdp_state.group
    return group.dp.shard_size * gather_row_bytes([c for p in group.params for c in p.codec.columns()])


def test_reshard_after_forward_keeps_quantized_rows(worlds):
    kept, forward_calls, backward_calls, forward_block_bytes, backward_bytes = worlds.run(4, _subgroup_rows)[0]
    # Kept: this rank's half of the block's gathered wire rows (values + scales), not bf16 rows.
    assert kept == [(torch.uint8, forward_block_bytes // 2 // 2)]
    assert (forward_calls, backward_calls) == (3, 2)  # root + 2 blocks; then the 2 blocks over 2 ranks
    # Every rank's row again, in wire format (bf16 rows would be ~2x), each member holding half of them.
    assert backward_bytes == forward_block_bytes


# -- quality, compile, bytes, checkpoints -------------------------------------------------------------


def _train(rank, ws, qdtype, steps, compile_blocks=False):
    import torch._dynamo

    from fsdp2 import MixedPrecisionPolicy, fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CFG)
    mp = MixedPrecisionPolicy(**BF16)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
        if compile_blocks:
            block.compile(backend="aot_eager")
    fully_shard(model, mp_policy=mp)
    if qdtype is not None:
        model.set_all_gather_policy(_policy(qdtype))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        x, y = _batch(step % 4, rank, ws)  # a few batches, revisited: the loss falls
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _quality(rank, ws):
    bf16 = _train(rank, ws, None, 20)
    return bf16, _train(rank, ws, "int8", 20), _train(rank, ws, "float8", 20)


def test_training_quality_close_to_bf16_all_gather(worlds):
    for bf16, int8, float8 in worlds.run(2, _quality):
        assert bf16[-1] < 0.85 * bf16[0]  # it trains
        for quantized in (int8, float8):
            worst = max(abs(q - b) / b for q, b in zip(quantized, bf16))
            assert worst < 0.01, worst


def _compiled(rank, ws):
    return _train(rank, ws, "int8", 3), _train(rank, ws, "int8", 3, compile_blocks=True)


def test_compiled_blocks_with_quantized_all_gather(worlds):
    eager, compiled = worlds.run(2, _compiled)[0]
    for a, b in zip(eager, compiled):
        assert abs(a - b) <= 1e-5 * abs(a)


def _bytes_and_checkpoint(rank, ws, path):
    from fsdp2 import MixedPrecisionPolicy, checkpoint, fully_shard
    from fsdp2.models.gpt import Block
    from fsdp2.tools.comm_stats import count_comm
    from fsdp2.tools.estimate import estimate_memory

    torch.manual_seed(0)
    model = GPT(CFG)
    mp = MixedPrecisionPolicy(**BF16)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    policy = _policy("int8")
    for block in model.blocks:  # the root's embeddings and head stay exact
        block.set_all_gather_policy(policy)
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x, y = _batch(step, rank, ws)
        with count_comm() as stats:
            model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
    with torch.device("meta"):
        meta = GPT(CFG)
    predicted = estimate_memory(
        meta,
        ws,
        groups=lambda m: isinstance(m, Block),
        mp_policy=mp,
        all_gather_policy=lambda name: None if name == "<root>" else policy,
    ).comm_bytes_per_step
    checkpoint.save(path, model, opt)
    masters = {name: p.full_tensor() for name, p in model.named_parameters()}
    torch.manual_seed(1)
    plain = GPT(CFG)
    checkpoint.load(path, plain)
    saved = {name: p.detach() for name, p in plain.named_parameters()}
    same = all(saved[k].dtype == torch.float32 and torch.equal(saved[k], v) for k, v in masters.items())
    return dict(stats.bytes), predicted, same


def test_comm_bytes_match_the_estimate_and_checkpoints_hold_masters(worlds, tmp_path):
    for counted, predicted, same in worlds.run(2, _bytes_and_checkpoint, str(tmp_path / "ckpt")):
        assert counted["all_gather"] == predicted["all_gather"]
        assert counted["reduce_scatter"] == predicted["reduce_scatter"]  # gradients untouched
        assert same  # the checkpoint holds the fp32 masters, nothing quantized


def test_all_gather_bytes_at_most_0_53x_of_bf16():
    """On the benchmark GPT (benchmarks/bench_fsdp.py's "small") at 8 ranks, with the default
    policy (1-D parameters exact): the estimate, which count_comm matches exactly."""
    from fsdp2 import MixedPrecisionPolicy
    from fsdp2.models.gpt import Block
    from fsdp2.tools.estimate import estimate_memory

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=2048, seq_len=128, dim=256, n_layers=4, n_heads=4))
    mp = MixedPrecisionPolicy(**BF16)

    def gathered(policy):
        est = estimate_memory(model, 8, groups=lambda m: isinstance(m, Block), mp_policy=mp, all_gather_policy=policy)
        return est.comm_bytes_per_step["all_gather"]

    for qdtype in ("int8", "float8"):
        assert gathered(_policy(qdtype)) <= 0.53 * gathered(None)


# -- misuse -------------------------------------------------------------------------------------------


def _misuse(rank, ws):
    from fsdp2 import FSDPUsageError, fully_shard

    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    with pytest.raises(FSDPUsageError, match="expected an fsdp2.AllGatherPolicy or None, got str"):
        model.set_all_gather_policy("int8")
    policy = _policy("int8")

    def during_forward(module, args):
        model.set_all_gather_policy(policy, recurse=False)

    handle = model.blocks[0].register_forward_pre_hook(during_forward)
    x, y = _batch(0, rank, ws)
    with pytest.raises(
        FSDPUsageError, match="called during forward; change the all-gather policy between training steps"
    ):
        model.loss(x, y)
    handle.remove()
    model.reset_iter_state()
    assert all(type(p.codec).__name__ == "PlainCodec" for s in _states(model) for p in s.group.params)  # unchanged
    model.loss(x, y).backward()


def test_set_all_gather_policy_misuse(worlds):
    worlds.run(2, _misuse)
