"""The small models of the parity tests."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from fsdp2.models import GPTConfig

# dim 36 and vocab 67 split unevenly on 4 ranks (and 67 on 2) on purpose.
CFG = GPTConfig(vocab_size=67, seq_len=16, dim=36, n_layers=2, n_heads=3)


class ReentrantCheckpointBlock(nn.Module):
    """``block`` under reentrant activation checkpointing."""

    def __init__(self, block):
        super().__init__()
        self.inner = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=True)


@dataclasses.dataclass
class Features:
    h: torch.Tensor


@dataclasses.dataclass
class Activation:
    x: torch.Tensor
    inner: Features  # nested


class _DataclassBlock(nn.Module):
    def __init__(self, d=12):
        super().__init__()
        self.l = nn.Linear(d, d)

    def forward(self, a):
        x = a.inner.h if isinstance(a, Activation) else a
        y = torch.tanh(self.l(x))
        return Activation(y, Features(y * 2))


class DataclassModel(nn.Module):
    """Blocks that hand each other nested dataclasses (``Activation``) instead of tensors."""

    def __init__(self, d=12):
        super().__init__()
        self.blocks = nn.ModuleList(_DataclassBlock(d) for _ in range(3))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.inner.h)

    def loss(self, x, y):
        return (self(x.float() / 67) - y.float().mean(-1, keepdim=True)).square().mean()


class OptionalLayers(nn.Module):
    """Linear layers; ``forward(x, use)`` also runs the optional layers ``use`` names (``extra``,
    ``spare``), never ``unused``: all three in the root's group, beside ``head``, which every call
    runs. Sharded by :func:`shard_optional_layers`: ``a`` unevenly on 2 ranks (padding), ``b`` on
    dim 1, the root's group evenly (on 2 and 4 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 13)
        self.b = nn.Linear(13, 12)
        self.extra = nn.Linear(12, 12)
        self.spare = nn.Linear(12, 12)
        self.unused = nn.Linear(12, 12)
        self.head = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor, use: tuple[str, ...] = ()) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        for name in use:
            h = h + getattr(self, name)(h)
        return self.head(h)

    @staticmethod
    def batch(micro: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s input of microbatch ``micro``."""
        return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * micro + rank))

    @staticmethod
    def loss(run, micro: int, rank: int, use: tuple[str, ...] = ()) -> torch.Tensor:
        return run(OptionalLayers.batch(micro, rank), use).float().pow(2).mean()


def shard_optional_layers(model: OptionalLayers, mesh, **kwargs) -> OptionalLayers:
    from torch.distributed.tensor import Shard

    from fsdp2 import fully_shard

    fully_shard(model.a, mesh=mesh, **kwargs)
    fully_shard(model.b, mesh=mesh, shard_placement_fn=lambda p: Shard(p.ndim - 1), **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def float8_mlp() -> nn.Module:
    """Linear layers whose dims torchao's float8 training takes (multiples of 16)."""
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))


def llama_sequence_parallel(model, tp_mesh):
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


class SkippableBlocks(nn.Module):
    """A root ``inp``/``head`` around blocks whose forward always runs but may leave their
    parameters unused: ``forward(x, skip)`` passes ``x`` through each block whose name is in
    ``skip``, so the block gathers and no gradient reaches it. ``late`` runs only when
    ``"late"`` is in ``run`` (a block gathered for the first time in a later step)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.first = _MaybeLinear()
        self.second = _MaybeLinear()
        self.late = _MaybeLinear()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, skip: tuple[str, ...] = (), run: tuple[str, ...] = ()) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = self.first(h, "first" in skip)
        h = self.second(h, "second" in skip)
        if "late" in run:
            h = self.late(h, "late" in skip)
        return self.head(h)


class _MaybeLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, skip: bool) -> torch.Tensor:
        return h * 1.0 if skip else torch.tanh(self.lin(h))
