"""Features combined: eager and compiled steps on one model, step settings between steps.

Each case is equal to PyTorch's FSDP2 (bitwise), or, where PyTorch cannot run it, to eager
fsdp2 / the unsharded model within the tolerance stated at the case, or it is refused at the
call that would diverge with an ``FSDPUsageError`` naming what to do.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

from fsdp2.models import GPT
from tests.support.models import (
    CFG,
    Activation,
    DataclassModel,
    Features,
    OptionalLayers,
    float8_mlp,
    shard_optional_layers,
)
from tests.support.parity import (
    accumulated_reference_grads,
    assert_compiled_equals_eager,
    assert_reference_grads,
    assert_same_params,
    full_tensor,
    shard_blocks_then_root,
    step_batch,
    token_loss,
    twins,
    world_mesh,
)
from tests.support.user_collectives import RecordingReduceScatter

pytestmark = pytest.mark.slow  # dynamo traces of whole steps, 4-rank worlds


def _refused(call, match: str) -> None:
    """``call()`` raises fsdp2's ``FSDPUsageError`` with ``match`` in its message: itself from an
    eager call; from a compiled call, dynamo's error quoting the one its trace observed."""
    from fsdp2 import FSDPUsageError

    with pytest.raises(Exception, match=match) as raised:
        call()
    assert isinstance(raised.value, FSDPUsageError) or "FSDPUsageError(" in str(raised.value), raised.value


def _train_gpt(run, model, steps: int, rank: int, ws: int) -> tuple[list, list]:
    """``steps`` AdamW steps of ``run`` (``model``, compiled or not) on the GPT batches: the losses
    and the final full parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = token_loss(run, *step_batch(step, rank, ws))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [full_tensor(p) for p in model.parameters()]


def _grads(model):
    return {name: None if p.grad is None else full_tensor(p.grad) for name, p in model.named_parameters()}


# -- set_is_last_backward(False): gradients written as PyTorch writes them ----------------------------


def _not_last_backward(rank, ws):
    theirs, ours = twins(lambda: GPT(CFG), shard_blocks_then_root)
    for model in (theirs, ours):
        model.set_is_last_backward(False)
        model.loss(*step_batch(0, rank, ws)).backward()
    their_grads, our_grads = _grads(theirs), _grads(ours)
    for name, grad in their_grads.items():
        assert (grad is None) == (our_grads[name] is None), name
        if grad is not None:
            assert torch.equal(grad, our_grads[name]), name
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    for opt in opts:
        opt.step()
    assert_same_params(theirs, ours)


def test_not_last_backward_writes_gradients_like_pytorch(worlds):
    worlds.run(2, _not_last_backward)


# -- eager and compiled calls on one model ----------------------------------------------------------


def _compiled_twin(rank, ws):
    """(eager-sharded GPT, its torch.compile(fullgraph=True), unsharded reference)."""
    from fsdp2 import fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = GPT(CFG)
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fully_shard(block, mesh=world_mesh())
    fully_shard(model, mesh=world_mesh())
    return model, torch.compile(model, backend="aot_eager", fullgraph=True), reference


def _mixed_accumulation(rank, ws, eager_first, precision, keeps):
    """Two microbatches of one accumulation through different executors (the eager model and its
    torch.compile(fullgraph=True)), the first keeping its sums (``keeps``: without gradient sync,
    or HSDP 2x2 without the all-reduce): the gradients are the unsharded model's, within fp32
    rounding. ``extra``, run only by the eager microbatch, and ``spare``, only by the compiled one,
    get theirs, ``unused`` none. Nothing of it is left kept: the next accumulation, all through the
    first executor, is the reference's too."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2 import MixedPrecisionPolicy

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = OptionalLayers()
    kwargs, dtype = {}, torch.float32
    if precision == "bf16":
        dtype = torch.bfloat16
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if keeps == "partial":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = world_mesh()
    model = shard_optional_layers(copy.deepcopy(reference), mesh, **kwargs)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)

    def keep_sums(keep: bool) -> None:
        if keeps == "partial":
            model.set_requires_all_reduce(not keep)
        else:
            model.set_requires_gradient_sync(not keep)

    runs = [(model, ("extra",)), (compiled, ("spare",))]  # (executor, the optional layers it runs)
    if not eager_first:
        runs.reverse()
    for micro, (run, use) in enumerate(runs):
        keep_sums(micro == 0)
        OptionalLayers.loss(run, micro, rank, use).backward()
        if micro == 0:
            assert all(p.grad is None for p in model.parameters())
    expected = accumulated_reference_grads(reference, [(micro, use) for micro, (_, use) in enumerate(runs)], ws, dtype)
    assert None not in (expected["extra.weight"], expected["spare.weight"]) and expected["unused.weight"] is None
    assert_reference_grads(model, expected)
    model.zero_grad()
    run, use = runs[0]
    for micro in (2, 3):
        keep_sums(micro == 2)
        OptionalLayers.loss(run, micro, rank, use).backward()
    assert_reference_grads(model, accumulated_reference_grads(reference, [(2, use), (3, use)], ws, dtype))
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "keeps, precision, ws",
    [("unsynced", "fp32", 2), ("unsynced", "bf16", 2), ("partial", "fp32", 4)],
    ids=["no-sync", "no-sync-bf16", "hsdp-no-all-reduce"],
)
@pytest.mark.parametrize("eager_first", [True, False], ids=["eager-then-compiled", "compiled-then-eager"])
def test_eager_and_compiled_microbatches_share_one_accumulation(worlds, eager_first, keeps, precision, ws):
    worlds.run(ws, _mixed_accumulation, eager_first, precision, keeps)


def _eager_state_before_a_compiled_step(rank, ws, how):
    model, compiled, _ = _compiled_twin(rank, ws)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    token_loss(compiled, *step_batch(0, rank, ws)).backward()
    opt.step()
    opt.zero_grad()
    if how == "unshard":
        model.blocks[1].unshard()
        match = "reshard"
    else:
        model.set_reshard_after_backward(False)
        match = "set_reshard_after_backward"
    _refused(lambda: token_loss(compiled, *step_batch(1, rank, ws)).backward(), match)
    # Nothing changed: undone, the compiled step runs and every parameter is the optimizer's.
    if how == "unshard":
        model.blocks[1].reshard()
    else:
        model.set_reshard_after_backward(True)
    token_loss(compiled, *step_batch(1, rank, ws)).backward()
    assert [id(p) for p in model.parameters()] == [id(p) for group in opt.param_groups for p in group["params"]]
    assert all(p.grad is not None for p in model.parameters())
    torch._dynamo.reset()


@pytest.mark.parametrize("how", ["unshard", "reshard_after_backward"])
def test_eager_state_a_compiled_step_would_ignore_is_refused(worlds, how):
    worlds.run(2, _eager_state_before_a_compiled_step, how)


# -- tensor parallel under the compiled whole step ---------------------------------------------------


def _tp_compiled_vs_eager(rank, ws, steps, mixed=False):
    """FSDP on 'dp' x TP on 'tp' (TP first, then fully_shard on the dp mesh, as torchtitan does):
    eager and compiled (fullgraph, aot_eager) from the same init, AdamW. ``mixed``: each step two
    microbatches, the first without gradient sync, through different executors (eager then
    compiled, then the other way round), against all of them eager: equal within fp32 rounding
    (eager keeps its sums as TP DTensors and reduces them over TP once, the compiled step per
    microbatch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fsdp2 import fully_shard
    from fsdp2.models import Llama, LlamaConfig, tensor_parallel_plan

    torch._dynamo.reset()
    cfg = LlamaConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4, hidden_dim=48)
    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    base = Llama(cfg)
    runs = {}
    for name in ("eager", "compiled"):
        model = copy.deepcopy(base)
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], tensor_parallel_plan())
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        dp_rank = mesh["dp"].get_local_rank()
        for step in range(steps):
            microbatches = 2 if mixed else 1
            for micro in range(microbatches):
                model.set_requires_gradient_sync(micro == microbatches - 1)
                run = model if name == "eager" else compiled
                if mixed and name == "compiled":
                    run = (model, compiled)[(step + micro) % 2]
                tokens = torch.randint(
                    0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(step + 100 * micro)
                )
                rows = tokens[2 * dp_rank : 2 * dp_rank + 2]
                loss = token_loss(run, rows[:, :-1], rows[:, 1:])
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        runs[name] = (losses, [p.detach().full_tensor() for p in model.parameters()])
    torch._dynamo.reset()
    assert_compiled_equals_eager(runs, exact=not mixed)


def test_tensor_parallel_compiled_whole_step_matches_eager(worlds):
    worlds.run(4, _tp_compiled_vs_eager, 5)


def test_tensor_parallel_eager_and_compiled_microbatches_share_one_accumulation(worlds):
    worlds.run(4, _tp_compiled_vs_eager, 2, True)


# -- torchao float8 all-gather under the compiled whole step ------------------------------------------


def _float8_compiled_vs_eager(rank, ws, param_dtype):
    """torchao float8 training with the float8 all-gather (the weights' tensor-subclass hooks),
    eager and compiled whole (fullgraph, aot_eager) from the same init: the first step before any
    precomputed scale, then ``precompute_float8_dynamic_scale_for_fsdp`` after each step, and one
    step of two microbatches, the first without gradient sync."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    from fsdp2 import MixedPrecisionPolicy, fully_shard

    torch._dynamo.reset()
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    runs = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        model = float8_mlp()
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        for index in (0, 2):
            fully_shard(model[index], mesh=init_device_mesh("cpu", (ws,)), mp_policy=mp)
        fully_shard(model, mesh=init_device_mesh("cpu", (ws,)), mp_policy=mp)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if name == "compiled" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(4):
            microbatches = 2 if step == 2 else 1
            for micro in range(microbatches):
                model.set_requires_gradient_sync(micro == microbatches - 1)
                x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
                loss = run(x).float().pow(2).mean()
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
            if step:  # the first step after one without: the scale comes from the compiled step itself
                precompute_float8_dynamic_scale_for_fsdp(model)
        runs[name] = (losses, [p.detach().full_tensor() for p in model.parameters()])
    torch._dynamo.reset()
    assert_compiled_equals_eager(runs)
    assert all(not torch.equal(a, b) for a, b in zip(runs["eager"][1], _initial_float8_mlp_params(ws)))


def _initial_float8_mlp_params(ws):

    torch.manual_seed(0)
    return [p.detach() for p in float8_mlp().parameters()]


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_torchao_float8_all_gather_compiled_whole_equals_eager(worlds, param_dtype):
    """The compiled whole step gathers float8 weights through torchao's hooks as eager does (one
    all-gather of their bytes per group) and reduces their gradients as any bucket's: bitwise."""
    pytest.importorskip("torchao")
    worlds.run(2, _float8_compiled_vs_eager, param_dtype)


# -- inputs cast under the compiled whole step ---------------------------------------------------------


def _dataclass_input_compiled_vs_eager(rank, ws):
    """A dataclass input (nested) to a model with bf16 parameters and ``cast_forward_inputs``:
    the compiled step casts it as eager does (output and gradients bitwise)."""
    from fsdp2 import MixedPrecisionPolicy, fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    base = DataclassModel()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(rank)
    x = Activation(torch.randn(4, 12, generator=generator), Features(torch.randn(4, 12, generator=generator)))
    runs = {}
    for name in ("eager", "compiled"):
        model = copy.deepcopy(base)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if name == "compiled" else model
        out = run(x)
        out.float().sum().backward()
        runs[name] = (out.detach(), [full_tensor(p.grad) for p in model.parameters()])
    torch._dynamo.reset()
    (eager_out, eager_grads), (out, grads) = runs["eager"], runs["compiled"]
    assert out.dtype == torch.bfloat16 and torch.equal(out, eager_out)
    for a, b in zip(eager_grads, grads):
        assert torch.equal(a, b)


def test_dataclass_inputs_are_cast_under_the_compiled_whole_step(worlds):
    worlds.run(2, _dataclass_input_compiled_vs_eager)


# -- the all-reduce hook under the compiled whole step -------------------------------------------------


def _all_reduce_hook_compiled_vs_eager(rank, ws):
    """A hook that scales each reduced bucket in place, with bf16 reduction of fp32 parameters:
    the compiled step calls it on the same tensors (dtype, values) as eager, before the division."""
    from fsdp2 import MixedPrecisionPolicy, fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    base = GPT(CFG)
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    runs = {}
    for name in ("eager", "compiled"):
        model = copy.deepcopy(base)
        seen = []

        def hook(reduced, seen=seen):
            seen.append(reduced.clone())
            reduced.mul_(0.5)

        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        for module in (*model.blocks, model):
            module.set_all_reduce_hook(hook)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if name == "compiled" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            token_loss(run, *step_batch(step, rank, ws)).backward()
            opt.step()
            opt.zero_grad()
        # As a multiset: the two executors may call the hooks of one backward in another order.
        seen.sort(key=lambda t: (t.numel(), t.float().sum().item()))
        runs[name] = (seen, [full_tensor(p) for p in model.parameters()])
    torch._dynamo.reset()
    (eager_seen, eager_params), (seen, params) = runs["eager"], runs["compiled"]
    assert len(seen) == len(eager_seen) == 2 * (len(base.blocks) + 1)
    for a, b in zip(eager_seen, seen):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
    for a, b in zip(eager_params, params):
        assert torch.equal(a, b)


def test_all_reduce_hook_under_the_compiled_whole_step_equals_eager(worlds):
    worlds.run(2, _all_reduce_hook_compiled_vs_eager)


# -- reshard_after_forward=k under the compiled whole step ---------------------------------------------


def _gather_ops(graph) -> list[tuple[int, str]]:
    """(group size, group name) of each all-gather in an FX graph."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if "all_gather_into_tensor" in str(node.target):
            found.append((node.args[1], node.args[2]))
        elif "auto_functionalized" in str(node.target) and "all_gather_into_tensor_out" in str(node.args[0]):
            found.append((node.kwargs["group_size"], node.kwargs["group_name"]))  # the *_out variant
    return found


def _reshard_to_subgroup_compiled_vs_eager(rank, ws):
    """``reshard_after_forward=2`` on 4 ranks: compiled (fullgraph) equals eager bitwise, and
    with a rematerialising partitioner the backward graph re-gathers each block over 2 ranks (the
    forward gathers over the 2 ranks at this rank's subgroup position, then over the subgroup)."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from fsdp2 import fully_shard

    graphs = {"forward": [], "backward": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm.graph)
            return gm.forward

        return compiler

    backend = aot_autograd(
        fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=min_cut_rematerialization_partition
    )
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = GPT(CFG)
    runs = {}
    for name in ("eager", "compiled"):
        model = copy.deepcopy(base)
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=2)
        fully_shard(model)
        run = torch.compile(model, backend=backend, fullgraph=True) if name == "compiled" else model
        runs[name] = _train_gpt(run, model, 3, rank, ws)
        subgroups = [model.blocks[0]._fsdp_state.group.reshard_after_forward.subgroup]
    torch._dynamo.reset()
    assert_compiled_equals_eager(runs)
    (forward,), (backward,) = graphs["forward"], graphs["backward"]
    blocks = len(base.blocks)
    forward_sizes = sorted(size for size, _ in _gather_ops(forward))
    assert forward_sizes == [2] * (2 * blocks) + [ws], forward_sizes  # each block: across, then subgroup; the root
    subgroup = subgroups[0].group.group_name
    assert _gather_ops(backward) == [(2, subgroup)] * blocks  # over the subgroup, from the kept rows


def test_reshard_after_forward_to_a_subgroup_under_the_compiled_whole_step(worlds):
    worlds.run(4, _reshard_to_subgroup_compiled_vs_eager)


# -- parameters forward did not use ----------------------------------------------------------------------


class _WithUnused(torch.nn.Module):
    """``skipped`` runs only when asked; ``never`` never does (both in the root's group)."""

    def __init__(self):
        super().__init__()
        self.first, self.skipped, self.never = (torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, use_skipped: bool):
        h = torch.relu(self.first(x))
        if use_skipped:
            h = torch.relu(self.skipped(h))
        return self.head(h)


def _unused_params_compiled_vs_eager(rank, ws):
    """A parameter no forward used gets no gradient (``.grad`` None, so AdamW's weight decay leaves
    it alone), in the compiled step as in eager fsdp2 and PyTorch's FSDP2: alone, and in an
    accumulation whose first microbatch (without sync) used it and whose last did not."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp2 import fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    base = _WithUnused()
    runs = {}
    for name in ("pytorch", "eager", "compiled"):
        model = copy.deepcopy(base)
        (torch_fully_shard if name == "pytorch" else fully_shard)(model)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if name == "compiled" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        grads = []
        for step, uses in enumerate(([False], [True, False])):
            for micro, use_skipped in enumerate(uses):
                model.set_requires_gradient_sync(micro == len(uses) - 1)
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro + rank))
                run(x, use_skipped).sum().backward()
            grads.append({n: p.grad is None for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
        runs[name] = (grads, [full_tensor(p) for p in model.parameters()])
    torch._dynamo.reset()
    for name in ("eager", "compiled"):
        assert runs[name][0] == runs["pytorch"][0], (name, runs[name][0])
        assert all(torch.equal(a, b) for a, b in zip(runs["pytorch"][1], runs[name][1])), name
    none_at_first = runs["pytorch"][0][0]
    assert none_at_first["skipped.weight"] and none_at_first["never.weight"] and not none_at_first["first.weight"]
    assert not runs["pytorch"][0][1]["skipped.weight"] and runs["pytorch"][0][1]["never.weight"]


def test_unused_parameters_get_no_gradient_under_the_compiled_whole_step(worlds):
    worlds.run(2, _unused_params_compiled_vs_eager)


class _Gated(torch.nn.Module):
    """Called every step; its parameters used only while ``opened``."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, h, opened: bool):
        return h + self.lin(h) if opened else h * 1.0


class _WithGate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.never = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.gate = _Gated()
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, opened: bool):
        return self.head(self.gate(torch.relu(self.first(x)), opened))


def _gate_runs(rank, shard, opened, optimizer):
    """``_WithGate`` from one init, eager and compiled, under ``set_reduce_scatter_unused_params(True)``:
    per run and step the gradients (None where there is none) and the collectives counted, and the
    final parameters. ``shard(model)`` applies fully_shard; ``opened(step)`` opens the gate."""
    from fsdp2.tools import count_comm

    torch._dynamo.reset()
    torch.manual_seed(0)
    base = _WithGate()
    runs, comms = {}, {}
    for name in ("eager", "compiled"):
        model = copy.deepcopy(base)
        shard(model)
        model.set_reduce_scatter_unused_params(True)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if name == "compiled" else model
        opt = optimizer(model.parameters())
        grads, comms[name] = [], []
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            with count_comm() as stats:
                run(x, opened(step)).sum().backward()
            comms[name].append(dict(stats.calls))
            grads.append({n: None if p.grad is None else full_tensor(p.grad) for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs[name] = (grads, [full_tensor(p) for p in model.parameters()])
    torch._dynamo.reset()
    return runs["eager"], runs["compiled"], comms


def _unused_params_reduced_compiled_vs_eager(rank, ws):
    """``set_reduce_scatter_unused_params(True)``: a zero gradient for a parameter forward did not
    use, compiled as eager (AdamW's weight decay then moves it in both), also for a group none of
    whose parameters its first compiled step used (``gate``, its own fully_shard, closed in the
    first two steps); each step issues eager's reductions (the end of the compiled backward
    reduces only what the graph did not)."""
    from fsdp2 import fully_shard

    def shard(model):
        fully_shard(model.gate)
        fully_shard(model)

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    (eager_grads, eager_params), (grads, params), comms = _gate_runs(rank, shard, lambda step: step == 2, adamw)
    for step in range(3):
        assert eager_grads[step]["never.weight"] is not None and not eager_grads[step]["never.weight"].any()
        assert eager_grads[step]["gate.lin.weight"] is not None
        assert eager_grads[step]["gate.lin.weight"].any() == (step == 2)
        assert all(torch.equal(eager_grads[step][n], grads[step][n]) for n in eager_grads[step]), step
    assert all(torch.equal(a, b) for a, b in zip(eager_params, params))
    # The reductions eager's. The compiled step keeps such a group gathered from forward to
    # backward (docs/compile.md), where eager gathers ``gate`` again in its backward.
    for kind in ("reduce_scatter", "all_reduce"):
        assert [c[kind] for c in comms["compiled"]] == [c[kind] for c in comms["eager"]], comms
    assert [c["all_gather"] for c in comms["compiled"]] == [c["all_gather"] - 1 for c in comms["eager"]], comms


def test_reduce_scatter_unused_params_under_the_compiled_whole_step(worlds):
    worlds.run(2, _unused_params_reduced_compiled_vs_eager)


def _gate_open_on_some_ranks_compiled_vs_eager(rank, ws, hsdp, reshard):
    """``set_reduce_scatter_unused_params(True)``, the gate's parameters used on rank 0 only: every
    rank's compiled backward issues the same collectives (no re-gather that only the ranks using
    them need, the group reduced at the end of the backward on every rank), with eager's
    gradients, bitwise."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2 import fully_shard

    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard")) if hsdp else None

    def shard(model):
        fully_shard(model.gate, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh)

    def sgd(params):
        return torch.optim.SGD(params, lr=1e-2)

    (eager_grads, eager_params), (grads, params), comms = _gate_runs(
        rank, shard, lambda step: rank == 0 or step == 2, sgd
    )
    for step in range(3):
        assert all(torch.equal(eager_grads[step][n], grads[step][n]) for n in eager_grads[step]), step
    assert all(torch.equal(a, b) for a, b in zip(eager_params, params))
    for kind in ("reduce_scatter", "all_reduce"):
        assert [c[kind] for c in comms["compiled"]] == [c[kind] for c in comms["eager"]], comms


@pytest.mark.parametrize("hsdp, reshard", [(False, True), (False, None), (True, True)])
def test_parameters_used_on_some_ranks_only_under_the_compiled_whole_step(worlds, hsdp, reshard):
    """Ranks whose graphs issued different collectives in backward would make gloo abort (NCCL hang)."""
    worlds.run(4 if hsdp else 2, _gate_open_on_some_ranks_compiled_vs_eager, hsdp, reshard)


# -- custom collectives under the compiled whole step ------------------------------------------------


class _UserAllGather:
    """A user's all-gather (PyTorch's ``AllGather`` protocol): c10d's, with its calls counted."""

    def __init__(self):
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        import torch.distributed as dist

        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _custom_collectives_compiled_vs_eager(rank, ws):
    """``set_custom_all_gather`` / ``set_custom_reduce_scatter`` on every group: the compiled step
    calls the user's objects where eager does (as many calls, the same reduce ops), bitwise."""
    from fsdp2 import fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    base = GPT(CFG)
    runs, calls = {}, {}
    for name in ("eager", "compiled"):
        model = copy.deepcopy(base)
        gather, scatter = _UserAllGather(), RecordingReduceScatter()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        for module in (*model.blocks, model):
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if name == "compiled" else model
        runs[name] = _train_gpt(run, model, 2, rank, ws)
        calls[name] = (gather.calls, sorted(scatter.ops))
    torch._dynamo.reset()
    assert_compiled_equals_eager(runs)
    assert calls["compiled"] == calls["eager"] and calls["eager"][0] > 0, calls


def test_custom_collectives_under_the_compiled_whole_step_equal_eager(worlds):
    worlds.run(2, _custom_collectives_compiled_vs_eager)


# -- fsdp2's quantized all-gather under the compiled whole step -----------------------------------------


def _quantized_all_gather_compiled_vs_eager(rank, ws, dtype):
    """``set_all_gather_policy(AllGatherPolicy(dtype))`` on every group: the compiled step
    quantizes, gathers and dequantizes as eager does (the gradient passes straight through),
    bitwise; fewer bytes gathered than without the policy."""
    from fsdp2 import AllGatherPolicy, fully_shard
    from fsdp2.tools.comm_stats import count_comm

    torch._dynamo.reset()
    torch.manual_seed(0)
    base = GPT(CFG)
    runs, gathered = {}, {}
    for name in ("eager", "compiled", "compiled exact"):
        model = copy.deepcopy(base)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        if name != "compiled exact":
            model.set_all_gather_policy(AllGatherPolicy(dtype))
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if name != "eager" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            with count_comm() as stats:
                loss = token_loss(run, *step_batch(step, rank, ws))
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs[name] = (losses, [full_tensor(p) for p in model.parameters()])
        gathered[name] = stats.bytes["all_gather"]
    torch._dynamo.reset()
    assert_compiled_equals_eager(runs)
    assert gathered["compiled"] < gathered["compiled exact"] / 2, gathered


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "float8"])
def test_quantized_all_gather_under_the_compiled_whole_step_equals_eager(worlds, dtype):
    worlds.run(2, _quantized_all_gather_compiled_vs_eager, dtype)


# -- HSDP without the all-reduce under the compiled whole step --------------------------------------------


def _hsdp_without_all_reduce_compiled_vs_eager(rank, ws):
    """HSDP 2x2: two microbatches, the first with ``set_requires_all_reduce(False)`` (reduce-scatter
    only, the sum kept), the second all-reducing both, compiled as eager, bitwise (microbatches of
    one accumulation through different executors: test_eager_and_compiled_microbatches_share_...)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2 import MixedPrecisionPolicy, fully_shard

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)  # the kept sums in the reduce dtype
    torch.manual_seed(0)
    base = GPT(CFG)
    runs = {}
    for name in ("eager", "compiled"):
        model = copy.deepcopy(base)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if name == "compiled" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(2):
            for micro in range(2):
                model.set_requires_all_reduce(micro == 1)
                loss = token_loss(run, *step_batch(2 * step + micro, rank, ws))
                loss.backward()
                losses.append(loss.detach())
                if micro == 0:
                    assert all(p.grad is None for p in model.parameters())  # the sums stay kept
            opt.step()
            opt.zero_grad()
        runs[name] = (losses, [full_tensor(p) for p in model.parameters()])
    torch._dynamo.reset()
    assert_compiled_equals_eager(runs)


def test_hsdp_without_all_reduce_under_the_compiled_whole_step_equals_eager(worlds):
    worlds.run(4, _hsdp_without_all_reduce_compiled_vs_eager)


# -- sequences of calls across the executors ------------------------------------------------------------


def _sequence_runs(rank, ws, build, shard, program, executors=("eager", "compiled")):
    """Run ``program(model, run, opt, record)`` on fresh copies of ``build()`` sharded by ``shard``:
    once all eager and once with ``run`` the compiled whole step (aot_eager). ``record`` keeps what
    a user can read (each parameter's ``.grad`` in full, None included) for the comparison."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = build()
    runs = {}
    for name in executors:
        model = copy.deepcopy(base)
        shard(model)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if name == "compiled" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        seen = []
        program(model, run, opt, lambda: seen.append(_grads(model)))
        runs[name] = (seen, [full_tensor(p) for p in model.parameters()])
    torch._dynamo.reset()
    return runs


def _assert_runs_equal(runs):
    (eager_seen, eager_params), (seen, params) = runs["eager"], runs["compiled"]
    assert len(seen) == len(eager_seen)
    for i, (a, b) in enumerate(zip(eager_seen, seen)):
        for name in a:
            assert (a[name] is None) == (b[name] is None), (i, name, a[name] is None)
            if a[name] is not None:
                assert torch.equal(a[name], b[name]), (i, name, (a[name] - b[name]).abs().max())
    for a, b in zip(eager_params, params):
        assert torch.equal(a, b)


def _gpt_blocks_then_root(model):
    from fsdp2 import fully_shard

    shard_blocks_then_root(model, fully_shard)


def _manual_finalization_compiled(rank, ws):
    def program(model, run, opt, record):
        model.set_manual_backward_finalization(True)
        for step in range(2):
            model.set_requires_gradient_sync(False)
            for micro in range(2):
                token_loss(run, *step_batch(2 * step + micro, rank, ws)).backward()
            model.set_requires_gradient_sync(True)
            model.finalize_backward()
            record()
            opt.step()
            opt.zero_grad()

    runs = _sequence_runs(rank, ws, lambda: GPT(CFG), _gpt_blocks_then_root, program)
    assert all(g is not None for g in runs["eager"][0][0].values())
    _assert_runs_equal(runs)


def test_manual_finalization_after_compiled_microbatches_equals_eager(worlds):
    """set_manual_backward_finalization(True), compiled microbatches without gradient sync, then
    sync on and finalize_backward(): the sums the compiled backwards kept are reduced into
    ``.grad``, as eager's are."""
    worlds.run(2, _manual_finalization_compiled)


def _skippable_blocks_sharded(model):
    from fsdp2 import fully_shard

    for block in (model.first, model.second, model.late):
        fully_shard(block)
    fully_shard(model)


def _group_run_only_by_an_eager_microbatch(rank, ws):
    from tests.support.models import SkippableBlocks

    def x(i):
        return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * i + rank))

    def program(model, run, opt, record):
        model.set_requires_gradient_sync(False)
        model(x(0), (), ("late",)).square().mean().backward()  # eager: the only microbatch running `late`
        model.set_requires_gradient_sync(True)
        run(x(1)).square().mean().backward()
        record()
        opt.step()
        opt.zero_grad()
        run(x(2)).square().mean().backward()
        record()
        opt.step()

    runs = _sequence_runs(rank, ws, SkippableBlocks, _skippable_blocks_sharded, program)
    assert runs["eager"][0][0]["late.lin.weight"] is not None and runs["eager"][0][1]["late.lin.weight"] is None
    _assert_runs_equal(runs)


def test_a_group_only_an_eager_microbatch_ran_is_reduced_by_the_compiled_synced_backward(worlds):
    """An accumulation whose eager microbatch (without sync) ran a block the compiled synced
    microbatch does not: the block's sum is reduced at that backward, as eager reduces it, and
    nothing is left for the next step."""
    worlds.run(2, _group_run_only_by_an_eager_microbatch)


def _fp16_reduce_compiled(rank, ws, policy):
    from fsdp2 import MixedPrecisionPolicy

    def shard(model):
        from fsdp2 import fully_shard

        shard_blocks_then_root(model, fully_shard, mp_policy=MixedPrecisionPolicy(*policy))

    def program(model, run, opt, record):
        for step in range(2):
            token_loss(run, *step_batch(step, rank, ws)).backward()
            record()
            opt.step()
            opt.zero_grad()

    _assert_runs_equal(_sequence_runs(rank, ws, lambda: GPT(CFG), shard, program))


@pytest.mark.parametrize(
    "policy",
    [(torch.float16, torch.float16), (torch.float16,), (None, torch.float16)],
    ids=["fp16-params-fp16-reduce", "fp16-params", "fp16-reduce"],
)
def test_fp16_reduction_under_the_compiled_whole_step_equals_eager(worlds, policy):
    worlds.run(2, _fp16_reduce_compiled, policy)


def _float8_only_groups_compiled(rank, ws):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def build():
        return torch.nn.Sequential(
            torch.nn.Linear(32, 64, bias=False), torch.nn.ReLU(), torch.nn.Linear(64, 32, bias=False)
        )

    def shard(model):
        from fsdp2 import fully_shard

        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)

    def program(model, run, opt, record):
        for step in range(2):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + rank))
            run(x).float().pow(2).mean().backward()
            record()
            opt.step()
            opt.zero_grad()

    _assert_runs_equal(_sequence_runs(rank, ws, build, shard, program))


def test_torchao_float8_all_gather_of_groups_of_only_float8_weights_compiled_equals_eager(worlds):
    """Linear layers without bias: each group holds float8 weights alone, gathered as one dtype."""
    pytest.importorskip("torchao")
    worlds.run(2, _float8_only_groups_compiled)


def _unused_blocks_compiled(rank, ws):
    from tests.support.models import SkippableBlocks

    def shard(model):
        _skippable_blocks_sharded(model)
        model.set_reduce_scatter_unused_params(True)

    def program(model, run, opt, record):
        # Every rank alike: blocks unused, a block gathered for the first time, one not run at all.
        for step, (skip, blocks) in enumerate(
            [((), ()), (("second",), ()), ((), ("late",)), (("late",), ("late",)), ((), ())]
        ):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            run(x, skip, blocks).square().mean().backward()
            record()
            opt.step()
            opt.zero_grad()

    runs = _sequence_runs(rank, ws, SkippableBlocks, shard, program)
    assert runs["eager"][0][4]["late.lin.weight"] is not None  # gathered before, not run: zeros
    _assert_runs_equal(runs)


def test_reduce_scatter_unused_params_of_blocks_not_run_under_the_compiled_whole_step(worlds):
    """set_reduce_scatter_unused_params(True): blocks whose parameters a step leaves unused, and a
    block gathered in an earlier step that this step does not run at all, get zero gradients at
    the end of the compiled backward as at the end of eager's."""
    worlds.run(2, _unused_blocks_compiled)
