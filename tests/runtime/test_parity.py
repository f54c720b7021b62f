"""Parity: fully_shard training matches an unsharded single-process model, step by step.

Every rank builds the same reference model and trains it on the whole global batch; the
sharded copy trains on this rank's slice. After each step we compare the global loss and
every parameter (gathered with DTensor's ``full_tensor``) against the reference.

Tolerances: fp32 runs differ only by summation order of the gradient reduction
(``atol=2e-5, rtol=1e-4`` on parameters and losses). bf16 runs (bf16 compute, fp32 reduction
and master weights) are compared with an unsharded reference doing the same mixed precision;
they differ by where bf16 rounding happens (each rank's partial gradient vs. the whole
batch's), so they get ``atol=rtol=TOL_BF16``.
"""

import copy
from dataclasses import dataclass

import pytest
import torch

from fsdp2.models import GPT, GPTConfig

# Uneven on purpose: 67 vocab rows, 36-wide layers, 16 positions don't split evenly over 3 or 4 ranks.
TINY = GPTConfig(vocab_size=67, seq_len=16, dim=36, n_layers=2, n_heads=3)
STEPS = 4
TOL_BF16 = 5e-4
BATCH_PER_RANK = 2


@dataclass(frozen=True)
class Case:
    reshard_after_forward: bool | int = True
    bf16: bool = False
    microbatches: int = 1
    shard_dim: int = 0
    tie_weights: bool = False
    # AdamW's first update is lr * sign(grad): in bf16 a near-zero gradient's sign is noise, so
    # max-difference parity is only meaningful with an optimizer linear in the gradient.
    optimizer: str = "adamw"

    @property
    def tolerance(self) -> dict:
        return dict(atol=TOL_BF16, rtol=TOL_BF16) if self.bf16 else dict(atol=2e-5, rtol=1e-4)


def _batch(step: int, micro: int, world_size: int, cfg: GPTConfig):
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH_PER_RANK * world_size, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _shard(model: GPT, world_size: int, case: Case) -> GPT:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from fsdp2 import MixedPrecisionPolicy, fully_shard

    kwargs = dict(
        mesh=init_device_mesh("cpu", (world_size,)),
        reshard_after_forward=case.reshard_after_forward,
        shard_placement_fn=(lambda p: Shard(case.shard_dim if p.dim() > case.shard_dim else 0)),
    )
    if case.bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def train_side_by_side(rank: int, world_size: int, case: Case) -> list[dict]:
    import torch.distributed as dist

    cfg = GPTConfig(**{**TINY.__dict__, "tie_weights": case.tie_weights})
    torch.manual_seed(0)
    reference = GPT(cfg)
    model = _shard(copy.deepcopy(reference), world_size, case)
    ref_opt = _optimizer(reference, case)
    opt = _optimizer(model, case)
    rows = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    history = []
    for step in range(STEPS):
        loss_sum = torch.zeros(())
        ref_loss_sum = torch.zeros(())
        for micro in range(case.microbatches):
            last = micro == case.microbatches - 1
            model.set_requires_gradient_sync(last)
            tokens, targets = _batch(step, micro, world_size, cfg)
            loss = model.loss(tokens[rows], targets[rows]) / case.microbatches
            loss.backward()
            loss_sum += loss.detach().float()
            ref_loss = _reference_backward(reference, tokens, targets, case)
            ref_loss_sum += ref_loss.detach()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        dist.all_reduce(loss_sum)
        diffs = {
            name: (p.full_tensor() - ref_p).abs().max().item()
            for (name, p), ref_p in zip(model.named_parameters(), reference.parameters())
        }
        history.append({"loss": loss_sum.item() / world_size, "ref_loss": ref_loss_sum.item(), "param_diffs": diffs})
    return history


def _optimizer(model: GPT, case: Case) -> torch.optim.Optimizer:
    if case.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _reference_backward(reference: GPT, tokens, targets, case: Case) -> torch.Tensor:
    """Loss and gradients of the unsharded reference, accumulated into its fp32 ``.grad``s.

    For bf16 cases the reference does what MixedPrecisionPolicy does, without sharding: compute
    on a bf16 copy of the fp32 weights, then hand fp32 gradients to the fp32 optimizer.
    """
    if not case.bf16:
        loss = reference.loss(tokens, targets) / case.microbatches
        loss.backward()
        return loss
    shadow = copy.deepcopy(reference).to(torch.bfloat16)
    loss = shadow.loss(tokens, targets) / case.microbatches
    loss.backward()
    for master, low in zip(reference.parameters(), shadow.parameters()):
        grad = low.grad.float()
        master.grad = grad if master.grad is None else master.grad + grad
    return loss.detach().float()


def _assert_parity(history: list[dict], case: Case) -> None:
    tol = case.tolerance
    for step, record in enumerate(history):
        assert record["loss"] == pytest.approx(record["ref_loss"], rel=tol["rtol"], abs=tol["atol"]), f"step {step}"
        worst = max(record["param_diffs"].items(), key=lambda kv: kv[1])
        assert worst[1] <= tol["atol"] + tol["rtol"], f"step {step}: {worst[0]} differs by {worst[1]:.3g}"


CASES = {
    "fp32": Case(),
    "keep-after-forward": Case(reshard_after_forward=False),
    "bf16-params-fp32-reduce": Case(bf16=True, optimizer="sgd"),
    "grad-accumulation": Case(microbatches=2),
    "shard-dim-1": Case(shard_dim=1),
    "tied-embeddings": Case(tie_weights=True),
    "reshard-to-2-ranks": Case(reshard_after_forward=2),
    "reshard-to-2-ranks-bf16": Case(reshard_after_forward=2, bf16=True, shard_dim=1, optimizer="sgd"),
}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", ["fp32", "keep-after-forward"])
def test_parity_across_world_sizes(worlds, world_size, case):
    history = worlds.run(world_size, train_side_by_side, CASES[case])
    _assert_parity(history[0], CASES[case])
    # Every rank sees the same global loss and the same full parameters.
    assert all(h == history[0] for h in history)


@pytest.mark.parametrize("case", [c for c in CASES if c not in ("fp32", "keep-after-forward")])
def test_parity_features(worlds, case):
    history = worlds.run(4, train_side_by_side, CASES[case])
    _assert_parity(history[0], CASES[case])


def test_parity_really_detects_a_difference(worlds):
    """Guard against a vacuous parity check: a deliberately different reference must fail it."""
    history = worlds.run(2, train_side_by_side, Case())[0]
    history[-1]["param_diffs"]["tok_emb.weight"] = 1e-3
    with pytest.raises(AssertionError, match="tok_emb.weight"):
        _assert_parity(history, Case())
