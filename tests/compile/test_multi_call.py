"""Modules that run more than once per backward, under the compiled whole step.

``torch.compile(model, fullgraph=True)`` against eager fsdp2 on the same gloo world, from the same
init, step by step (losses, every parameter's gradient, the parameters after AdamW):

- a fully_shard'ed module called twice in one forward (a block applied twice, a head applied per
  chunk): bitwise, as eager, since the compiled step sums both uses' gradients before its one
  reduction, as eager sums them in the unsharded parameter;
- two compiled forwards before one backward: each graph reduces its own gradient, eager reduces
  their sum: equal within rounding;
- a chunked loss over a GPT's output head, inside the compiled forward: bitwise.

Each with ``reshard_after_forward`` True, False and 2 (of 4 ranks), gradient accumulation without
sync, bf16 mixed precision, HSDP and tensor parallelism. What the compiled step cannot do as
eager does (settings changed between a compiled forward and its backward) raises.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.slow  # dynamo traces of whole steps


class MultiCall(nn.Module):
    """``b`` applied twice, ``head`` applied per chunk; ``extra`` only when asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.extra = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(torch.relu(self.b(h))))
        if use_extra:
            h = h + self.extra(h)
        return torch.cat([self.head(c) for c in h.chunk(2)])


class ChunkedLossGPT(nn.Module):
    """A GPT whose forward returns its loss, the output head applied per sequence chunk."""

    def __init__(self, cfg, chunks: int = 2) -> None:
        super().__init__()
        from fsdp2.models import GPT

        self.gpt = GPT(cfg)
        self.chunks = chunks

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        gpt = self.gpt
        x = gpt.embed(tokens)
        for block in gpt.blocks:
            x = block(x)
        x = gpt.ln_f(x)
        total = 0
        for xc, yc in zip(x.chunk(self.chunks, dim=1), targets.chunk(self.chunks, dim=1)):
            logits = gpt.lm_head(xc)
            total = total + F.cross_entropy(logits.flatten(0, 1).float(), yc.flatten(), reduction="sum")
        return total / targets.numel()


def _gpt_cfg():
    from fsdp2.models import GPTConfig

    return GPTConfig(vocab_size=40, seq_len=8, dim=16, n_layers=2, n_heads=2)


def _meshes(kind: str, ws: int):
    """(fully_shard's mesh, the TP mesh or None, the data-parallel rank that picks the batch)."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "dp":
        mesh = init_device_mesh("cpu", (ws,))
        return mesh, None, mesh.get_local_rank()
    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
        return mesh, None, torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"], mesh["dp"].get_local_rank()


def _build(pattern: str, tp_mesh, shard_kwargs: dict) -> nn.Module:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from fsdp2 import fully_shard

    torch.manual_seed(0)
    if pattern == "chunked_head":
        model = ChunkedLossGPT(_gpt_cfg())
        for block in model.gpt.blocks:
            fully_shard(block, **shard_kwargs)
        fully_shard(model.gpt.lm_head, **shard_kwargs)
        return fully_shard(model, **shard_kwargs)
    model = MultiCall()
    if tp_mesh is not None:
        plan = {name: ColwiseParallel(output_layouts=Replicate()) for name in ("a", "b", "head", "extra")}
        parallelize_module(model, tp_mesh, plan)
    for name in ("a", "b", "head", "extra"):
        fully_shard(getattr(model, name), **shard_kwargs)
    return fully_shard(model, **shard_kwargs)


def _loss(pattern: str, run, step: int, micro: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dp_rank)
    if pattern == "chunked_head":
        cfg = _gpt_cfg()
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g)
        return run(tokens[:, :-1], tokens[:, 1:])
    x = torch.randn(4, 8, generator=g)
    if pattern == "twice":
        return run(x).pow(2).mean()
    # two_forwards: two compiled calls, one backward; the second without ``extra``, the first with
    return run(x, True).pow(2).mean() + run(2 * x + 1).pow(2).mean()


def _full(t):
    return None if t is None else t.detach().full_tensor()


def _side_by_side(rank, ws, pattern, reshard=True, precision="fp32", microbatches=1, mesh_kind="dp", steps=3):
    """Per executor: the losses, every step's gradients and the final parameters."""
    import torch._dynamo

    from fsdp2 import MixedPrecisionPolicy

    torch._dynamo.reset()
    mesh, tp_mesh, dp_rank = _meshes(mesh_kind, ws)
    shard_kwargs = {"mesh": mesh, "reshard_after_forward": reshard}
    if precision == "bf16":
        shard_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    results = {}
    for name in ("eager", "compiled"):
        model = _build(pattern, tp_mesh, shard_kwargs)  # the same initial weights (seeded)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if name == "compiled" else model
        # SGD: unlike Adam it does not turn rounding noise in near-zero gradients into full-size
        # updates, so the tolerance of the two-forwards cases bounds something.
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses, grads = [], []
        for step in range(steps):
            for micro in range(microbatches):  # all but the last without gradient sync
                model.set_requires_gradient_sync(micro == microbatches - 1)
                loss = _loss(pattern, run, step, micro, dp_rank)
                loss.backward()
                losses.append(loss.detach().float())
                if micro < microbatches - 1:
                    assert all(p.grad is None for p in model.parameters()), "a gradient written without sync"
            grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
        results[name] = (losses, grads, [_full(p) for p in model.parameters()])
    torch._dynamo.reset()
    return results


def _assert_equal(results, exact: bool, rtol: float = 0.0, atol: float = 0.0) -> None:
    (eager_losses, eager_grads, eager_params), (losses, grads, params) = results["eager"], results["compiled"]
    for step, (theirs, ours) in enumerate(zip(eager_grads, grads, strict=True)):
        assert theirs.keys() == ours.keys()
        for name, grad in theirs.items():
            assert (grad is None) == (ours[name] is None), f"step {step}: {name} gradient None only on one side"
            if grad is None:
                continue
            if exact:
                assert torch.equal(grad, ours[name]), f"step {step}: {name} {(grad - ours[name]).abs().max()}"
            else:
                torch.testing.assert_close(ours[name], grad, rtol=rtol, atol=atol, msg=f"step {step}: {name}")
    if exact:
        assert [loss.item() for loss in losses] == [loss.item() for loss in eager_losses]
        for a, b in zip(eager_params, params, strict=True):
            assert torch.equal(a, b)
    else:
        torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=rtol, atol=atol)
        for a, b in zip(eager_params, params, strict=True):
            torch.testing.assert_close(b, a, rtol=rtol, atol=atol)


# Two compiled forwards reduce their gradients separately (eager: their sum once): fp32 rounding,
# or, with bf16 parameters, the rounding of eager's bf16 sum of the two (the graphs sum in fp32).
_TWO_FORWARDS_TOLERANCE = {"fp32": (1e-5, 1e-6), "bf16": (2e-2, 2e-3)}


def _check(results, pattern: str, precision: str) -> None:
    if pattern == "two_forwards":
        rtol, atol = _TWO_FORWARDS_TOLERANCE[precision]
        _assert_equal(results, exact=False, rtol=rtol, atol=atol)
    else:
        _assert_equal(results, exact=True)


@pytest.mark.parametrize("pattern", ["twice", "two_forwards", "chunked_head"])
def test_modules_run_twice_per_backward_train_like_eager(worlds, pattern):
    """Parameters kept after forward (the composition matrix's cells compile+twice, compile+twofwd
    and compile+chunked run the three patterns resharding after forward)."""
    _check(worlds.run(2, _side_by_side, pattern, False)[0], pattern, "fp32")


@pytest.mark.parametrize("pattern", ["twice", "two_forwards", "chunked_head"])
def test_reshard_to_a_subgroup(worlds, pattern):
    """reshard_after_forward=2 of 4 ranks: a second call re-gathers over the subgroup."""
    _check(worlds.run(4, _side_by_side, pattern, 2, steps=2)[0], pattern, "fp32")


@pytest.mark.parametrize("pattern", ["twice", "two_forwards", "chunked_head"])
def test_accumulation_without_sync_in_bf16(worlds, pattern):
    """Two microbatches, the first without gradient sync, bf16 parameters, fp32 reduction."""
    _check(worlds.run(2, _side_by_side, pattern, True, "bf16", 2)[0], pattern, "bf16")


@pytest.mark.parametrize(("pattern", "mesh_kind"), [("two_forwards", "hsdp"), ("twice", "tp")])
def test_hsdp_and_tensor_parallel(worlds, pattern, mesh_kind):
    """2 x 2 ranks, with accumulation without sync. (The two-forwards model also runs ``b`` twice
    and ``head`` per chunk in each forward; tests/compose/test_compose.py has several deliveries
    to one accumulation under TP.)"""
    _check(worlds.run(4, _side_by_side, pattern, True, "fp32", 2, mesh_kind, 2)[0], pattern, "fp32")


# -- what the compiled step refuses ---------------------------------------------------------------------


def _settings_changed_before_backward(rank, ws, how):
    """A compiled forward traced with one gradient-sync setting, its backward run under another
    (eager would follow the new one): backward raises, and nothing reaches ``.grad``."""
    import torch._dynamo

    torch._dynamo.reset()
    mesh, _, _ = _meshes("dp", ws)
    model = _build("twice", None, {"mesh": mesh})
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    if how == "between_forward_and_backward":
        loss = run(x).sum()
        model.set_requires_gradient_sync(False)
    else:  # two forwards before one backward, the first synced, the second not
        loss = run(x).sum()
        model.set_requires_gradient_sync(False)
        loss = loss + run(x).sum()
    with pytest.raises(Exception, match="changed between a compiled forward and its backward") as raised:
        loss.backward()
    assert "FSDPUsageError" in type(raised.value).__name__ + str(raised.value)
    assert all(p.grad is None for p in model.parameters())
    # The next accumulation starts clean.
    model.set_requires_gradient_sync(True)
    run(x).sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if not n.startswith("extra"))
    torch._dynamo.reset()


@pytest.mark.parametrize("how", ["between_forward_and_backward", "between_two_forwards"])
def test_gradient_sync_changed_before_a_compiled_backward_is_refused(worlds, how):
    worlds.run(2, _settings_changed_before_backward, how)
