"""Side by side with PyTorch's FSDP2: one model built twice from one seed, one copy sharded by
``torch.distributed.fsdp.fully_shard`` and one by ``fsdp2.fully_shard``, trained on the same batches
in the same gloo world; losses and parameters compared bitwise, collectives counted at dispatch.
Shared by the test modules that compare fsdp2 with PyTorch (run inside rank processes)."""

from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp2.models import GPTConfig

CFG = GPTConfig(vocab_size=67, seq_len=16, dim=36, n_layers=2, n_heads=3)


def world_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def shard_blocks_then_root(model, fully_shard, **kwargs):
    mesh = world_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def twins(build, shard):
    """(PyTorch-sharded, fsdp2-sharded) copies of one model built from one seed."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp2 import fully_shard

    torch.manual_seed(0)
    base = build()
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    shard(theirs, torch_fully_shard)
    shard(ours, fully_shard)
    return theirs, ours


def batch(step, rank, ws, cfg=CFG):
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


def train_step(model, opt, step, rank, ws, loss_fn=None):
    """One training step; returns (loss, {collective: count})."""
    x, y = batch(step, rank, ws)
    with CollectiveCounter() as comm:
        loss = loss_fn(model, x, y) if loss_fn else model.loss(x, y)
        if loss.requires_grad:  # else the loss_fn ran its own backward(s) and returned the value
            loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach(), comm.counts


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def assert_same_params(theirs, ours):
    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert torch.equal(full(a), full(b)), f"parameter {name} differs from PyTorch FSDP2"


def train_side_by_side(theirs, ours, rank, ws, steps=3, loss_fn=None, optimizer=torch.optim.AdamW, before_step=None):
    their_opt, our_opt = optimizer(theirs.parameters(), lr=1e-2), optimizer(ours.parameters(), lr=1e-2)
    for step in range(steps):
        if before_step is not None:
            before_step(theirs, step)
            before_step(ours, step)
        their_loss, their_comm = train_step(theirs, their_opt, step, rank, ws, loss_fn)
        our_loss, our_comm = train_step(ours, our_opt, step, rank, ws, loss_fn)
        assert torch.equal(their_loss, our_loss), (step, their_loss.item(), our_loss.item())
        assert their_comm == our_comm, (step, their_comm, our_comm)
        assert_same_params(theirs, ours)
