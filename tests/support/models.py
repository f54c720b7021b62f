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
