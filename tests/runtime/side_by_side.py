"""Support for side-by-side tests: one model sharded by PyTorch's FSDP2 and by fsdp2, compared bitwise.

The same model is built once from one seed and deep-copied; one copy is sharded by
``torch.distributed.fsdp.fully_shard``, the other by ``fsdp2.fully_shard``, and both train on the same
batches in the same gloo world. Losses, parameters and the collectives issued (counted at dispatch,
as DTensor's ``CommDebugMode`` counts them) must be equal.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode


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


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def assert_same_params(theirs: nn.Module, ours: nn.Module) -> None:
    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert torch.equal(full(a), full(b)), f"parameter {name} differs from PyTorch FSDP2"


def assert_same_layout(theirs: nn.Module, ours: nn.Module) -> None:
    """Every parameter is a DTensor on an equal mesh with equal placements in both."""
    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert (a.device_mesh, a.placements) == (b.device_mesh, b.placements), (
            name,
            (a.device_mesh, a.placements),
            (b.device_mesh, b.placements),
        )


def llama_sequence_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """torchtitan's tensor parallelism with sequence parallelism for ``fsdp2.models.Llama``: the
    residual stream is split along the sequence, the norms run on it (their weights replicated, so
    their gradients are pending sums across TP ranks), attention and MLP are Megatron-split."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.blocks:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attn_norm": SequenceParallel(),
                "attn": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "attn.wq": ColwiseParallel(),
                "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "ffn.w1": ColwiseParallel(),
                "ffn.w3": ColwiseParallel(),
                "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    return model
