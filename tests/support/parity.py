"""Comparisons of one training run against another, run inside the rank processes.

- Side by side with PyTorch's FSDP2 (``twins``, ``train_side_by_side``): the same model is built
  twice from one seed, one copy sharded by ``torch.distributed.fsdp.fully_shard`` and one by
  ``fsdp2.fully_shard``; both train on the same batches in the same gloo world. Losses and
  parameters must be bitwise equal and the collectives issued (counted at dispatch) the same.
- Against the unsharded model (``gpt_pair``, ``train_parity``): the reference trains on the
  *global* batch in this process, the sharded copy on this rank's slice of it. With equal slices
  the average of the per-rank mean losses equals the global mean loss and the averaged gradients
  equal the global-batch gradient, so losses and parameters match within fp32 tolerance
  (``ATOL``/``RTOL``).
- Compiled against eager fsdp2 (``assert_compiled_equals_eager``): the losses and final full
  parameters of both runs, bitwise or within the rounding of compiled kernels.

Options after the positional (rank, world, models) arguments are keyword-only.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp2.models import GPT, GPTConfig
from tests.support.models import CFG

# -- side by side with PyTorch's FSDP2 --------------------------------------------------------------


def world_mesh():
    """The 1-D CPU mesh over the whole world."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def shard_blocks_then_root(model, fully_shard, **kwargs):
    """``fully_shard`` (PyTorch's or fsdp2's) each of ``model.blocks``, then the model, on ``world_mesh()``."""
    world = world_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=world, **kwargs)
    fully_shard(model, mesh=world, **kwargs)
    return model


def twins(build: Callable[[], nn.Module], shard: Callable[[nn.Module, Callable], object]):
    """(PyTorch-sharded, fsdp2-sharded) copies of one model built from one seed. ``shard(model,
    fully_shard)`` gets PyTorch's ``fully_shard`` for the first copy and fsdp2's for the second."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp2 import fully_shard

    torch.manual_seed(0)
    base = build()
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    shard(theirs, torch_fully_shard)
    shard(ours, fully_shard)
    return theirs, ours


def step_batch(step, rank, ws, cfg=CFG):
    """This rank's (tokens, targets) of training step ``step``: 2 sequences of the global batch."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, cfg.vocab_size, (2 * ws, cfg.seq_len + 1), generator=g)
    local = tokens[2 * rank : 2 * rank + 2]
    return local[:, :-1], local[:, 1:]


class CollectiveCounter(TorchDispatchMode):
    """Counts the c10d collectives (and functional collectives) issued, as DTensor's
    ``CommDebugMode`` does, without its module tracking, which fails when a backward runs
    between a module's forwards (a chunked loss)."""

    NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if func.namespace in self.NAMESPACES and "wait" not in name:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def side_by_side_step(model, opt, step, rank, ws, *, loss_fn=None):
    """One training step on ``step_batch(step, ...)``; returns (loss, {collective: count})."""
    x, y = step_batch(step, rank, ws)
    with CollectiveCounter() as comm:
        loss = loss_fn(model, x, y) if loss_fn else model.loss(x, y)
        if loss.requires_grad:  # else the loss_fn ran its own backward(s) and returned the value
            loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach(), comm.counts


def full_tensor(t):
    """A DTensor's full tensor (collective); anything else as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def assert_same_params(theirs, ours):
    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert torch.equal(full_tensor(a), full_tensor(b)), f"parameter {name} differs from PyTorch FSDP2"


def assert_same_layout(theirs: nn.Module, ours: nn.Module) -> None:
    """Every parameter is a DTensor on an equal mesh with equal placements in both."""
    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert (a.device_mesh, a.placements) == (b.device_mesh, b.placements), (
            name,
            (a.device_mesh, a.placements),
            (b.device_mesh, b.placements),
        )


def train_side_by_side(theirs, ours, rank, ws, *, steps=3, loss_fn=None, optimizer=torch.optim.AdamW, before_step=None):
    """``steps`` steps of both twins: bitwise equal losses, collective counts and parameters at each.
    ``before_step(model, step)`` runs on both before each step."""
    their_opt, our_opt = optimizer(theirs.parameters(), lr=1e-2), optimizer(ours.parameters(), lr=1e-2)
    for step in range(steps):
        if before_step is not None:
            before_step(theirs, step)
            before_step(ours, step)
        their_loss, their_comm = side_by_side_step(theirs, their_opt, step, rank, ws, loss_fn=loss_fn)
        our_loss, our_comm = side_by_side_step(ours, our_opt, step, rank, ws, loss_fn=loss_fn)
        assert torch.equal(their_loss, our_loss), (step, their_loss.item(), our_loss.item())
        assert their_comm == our_comm, (step, their_comm, our_comm)
        assert_same_params(theirs, ours)


# -- against the unsharded model ----------------------------------------------------------------------

ATOL, RTOL = 1e-5, 1e-4
LOCAL_BATCH = 3
STEPS = 2


def assert_near(actual, expected, what=""):
    """Equal within the fp32 tolerance of a sharded run against the unsharded one."""
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def global_batch(step: int, ws: int, cfg: GPTConfig = CFG):
    """(tokens, targets) of every rank at ``step``: ``LOCAL_BATCH`` sequences per rank."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (LOCAL_BATCH * ws, cfg.seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (LOCAL_BATCH * ws, cfg.seq_len), generator=g)
    return tokens, targets


def rank_slice(t: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
    """``rank``'s rows of a global batch."""
    return t.chunk(ws)[rank]


def mean_over_ranks(value: torch.Tensor, group=None) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value, group=group)
    return value / dist.get_world_size(group)


def shard_gpt(model: GPT, **kwargs) -> GPT:
    """fsdp2's ``fully_shard`` on each block, then the model."""
    from fsdp2 import fully_shard

    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def assert_params_match(model: nn.Module, ref: nn.Module, what: str = "param") -> None:
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(ref_params), (names, list(ref_params))
    for name, param in model.named_parameters():
        assert_near(full_tensor(param.detach()), ref_params[name].detach(), f"{what} {name}")


def assert_grads_match(model: nn.Module, ref: nn.Module) -> None:
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        ref_grad = ref_params[name].grad
        if ref_grad is None:
            assert param.grad is None, name
        else:
            assert param.grad is not None, name
            assert_near(full_tensor(param.grad), ref_grad, f"grad {name}")


def accumulated_reference_grads(reference: nn.Module, microbatches, ws: int, dtype=torch.float32) -> dict:
    """The unsharded ``reference``'s gradients (by name) of its ``loss(model, micro, rank, use)``
    over ``microbatches`` ((micro, use) pairs), each rank's computed in ``dtype`` (mixed
    precision's forward and backward), summed in fp32 (the reduce dtype) and averaged over the
    ``ws`` ranks; None for a parameter no microbatch reached."""
    model = copy.deepcopy(reference).to(dtype)
    names, params = zip(*model.named_parameters())
    sums = dict.fromkeys(names)

    def run(x, use):
        return model(x.to(dtype), use)  # inputs cast as mixed precision casts them

    for micro, use in microbatches:
        for rank in range(ws):
            loss = reference.loss(run, micro, rank, use)
            for name, grad in zip(names, torch.autograd.grad(loss, params, allow_unused=True)):
                if grad is not None:
                    sums[name] = grad.float() if sums[name] is None else sums[name] + grad.float()
    return {name: None if total is None else total / ws for name, total in sums.items()}


def assert_reference_grads(model: nn.Module, expected: dict, *, rtol=1e-5, atol=1e-6) -> None:
    """``model``'s gradients are ``expected`` (None where it says None), within fp32 rounding."""
    for name, p in model.named_parameters():
        if expected[name] is None:
            assert p.grad is None, name
        else:
            assert p.grad is not None, name
            torch.testing.assert_close(full_tensor(p.grad), expected[name], rtol=rtol, atol=atol, msg=name)


def assert_all_sharded(model: nn.Module) -> None:
    """Every parameter of every fsdp2 module is a DTensor again (resharded)."""
    from torch.distributed.tensor import DTensor

    from fsdp2 import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            for name, param in module.named_parameters(recurse=False):
                assert isinstance(param, DTensor), f"{type(module).__name__}.{name} is unsharded"


def step_and_zero(*optimizers) -> None:
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


def train_parity(rank, ws, model, ref, *, steps=STEPS, lr=0.05, loss_fn=None, group=None, dp_rank=None, dp_size=None):
    """SGD on ``model`` (local slices) and ``ref`` (global batch); assert equal losses, gradients and
    parameters. ``dp_rank``/``dp_size`` (default: the world's) pick this rank's slice; ``group``
    averages the losses. Returns the reference's losses."""
    dp_rank = rank if dp_rank is None else dp_rank
    dp_size = ws if dp_size is None else dp_size
    loss_fn = loss_fn or (lambda m, x, y: m.loss(x, y))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        tokens, targets = global_batch(step, dp_size)
        loss = loss_fn(model, rank_slice(tokens, dp_rank, dp_size), rank_slice(targets, dp_rank, dp_size))
        loss.backward()
        ref_loss = loss_fn(ref, tokens, targets)
        ref_loss.backward()
        assert_near(mean_over_ranks(loss, group), ref_loss.detach(), f"loss at step {step}")
        assert_grads_match(model, ref)
        step_and_zero(opt, ref_opt)
        losses.append(ref_loss.item())
    assert_params_match(model, ref)
    assert_all_sharded(model)
    return losses


def gpt_pair(cfg: GPTConfig = CFG, **shard_kwargs):
    """(fsdp2-sharded GPT on the world's mesh, its unsharded copy)."""
    ref = GPT(cfg)
    model = shard_gpt(copy.deepcopy(ref), mesh=world_mesh(), **shard_kwargs)
    return model, ref


# -- compiled against eager fsdp2 -------------------------------------------------------------------


def token_loss(model, x, y):
    """Cross entropy of ``model(x)``'s logits against ``y``, in fp32."""
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def assert_compiled_equals_eager(results, *, exact=True):
    """``results["eager"]`` and ``results["compiled"]``, each (losses, final full parameters): equal
    bitwise, or (``exact=False``) within 1e-5 relative, the rounding of compiled kernels."""
    (eager_losses, eager_params), (losses, params) = results["eager"], results["compiled"]
    if exact:
        assert losses == eager_losses
        for a, b in zip(eager_params, params, strict=True):
            assert torch.equal(a, b), (a - b).abs().max()
    else:
        for a, b in zip(eager_losses, losses):
            assert abs(a - b) <= 1e-5 * abs(a)
        for a, b in zip(eager_params, params):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
