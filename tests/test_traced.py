"""torch.compile(model, fullgraph=True) over fully_shard: the traced path (fsdp2.runtime.traced).

Compiled fsdp2 is checked against eager fsdp2 on the same gloo world: same losses and the same
parameters after a few optimizer steps, one graph without breaks, one all-gather and one
reduce-scatter per group, the next group's all-gather before this group's compute, backward
gathering again what forward resharded, and clear errors for what cannot be traced.
aot_eager (dynamo + AOTAutograd, no codegen) keeps most cases cheap; one case runs inductor.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp2.models import GPT, GPTConfig
from fsdp2.models.llama import Llama, LlamaConfig

GPT_CFG = GPTConfig(vocab_size=67, seq_len=16, dim=36, n_layers=2, n_heads=3)
LLAMA_CFG = LlamaConfig(vocab_size=61, seq_len=16, dim=32, n_layers=2, n_heads=4, hidden_dim=72, n_kv_heads=2)


def _build(kind: str):
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPT_CFG), GPT_CFG
    return Llama(LLAMA_CFG), LLAMA_CFG


def _shard(model, mesh=None, **kwargs):
    from fsdp2 import fully_shard

    layers = model.blocks if hasattr(model, "blocks") else model.layers
    for block in layers:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _batch(step, rank, world_size, cfg):
    tokens = torch.randint(0, cfg.vocab_size, (2 * world_size, cfg.seq_len + 1), generator=torch.Generator().manual_seed(step))
    rows = slice(2 * rank, 2 * rank + 2)
    return tokens[rows, :-1], tokens[rows, 1:]


def _loss(model, x, y):
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _train_side_by_side(rank, world_size, kind, steps, backend, shard_kwargs=None, mesh_shape=None):
    """Losses and final parameters of eager fsdp2 and of compiled fsdp2, from the same init."""
    import torch._dynamo
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    mesh = None
    if mesh_shape is not None:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    base, cfg = _build(kind)
    eager = _shard(copy.deepcopy(base), mesh, **(shard_kwargs or {}))
    traced = _shard(copy.deepcopy(base), mesh, **(shard_kwargs or {}))
    compiled = torch.compile(traced, backend=backend, fullgraph=True)
    results = {}
    for name, model, run in (("eager", eager, eager), ("compiled", traced, compiled)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(steps):
            x, y = _batch(step, rank, world_size, cfg)
            loss = _loss(run, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        results[name] = (losses, [p.detach().full_tensor() for p in model.parameters()])
    torch._dynamo.reset()
    return results


def _assert_same(results, exact=True):
    (eager_losses, eager_params), (losses, params) = results["eager"], results["compiled"]
    if exact:
        assert losses == eager_losses
        for a, b in zip(eager_params, params):
            assert torch.equal(a, b)
    else:
        for a, b in zip(eager_losses, losses):
            assert abs(a - b) <= 1e-5 * abs(a)
        for a, b in zip(eager_params, params):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_compiled_matches_eager_bitwise(worlds, kind):
    results = worlds.run(2, _train_side_by_side, kind, 3, "aot_eager")[0]
    _assert_same(results)
