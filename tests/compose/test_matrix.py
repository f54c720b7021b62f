"""Composition matrix: every feature alone and every pair of features, on 2 or 4 gloo ranks.

Each cell trains a tiny Llama (dim 32, 2 blocks) for 2 optimizer steps with the cell's features
applied to fsdp2 (the subject), and the same run with the features applied to a reference, from
the same initial weights on the same batches. A cell's expected outcome is one of:

- ``pytorch``: the reference is PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) with the
  same features; losses, gradient norms and final parameters are bitwise equal, and forward and
  backward issue the same collectives (counted by tests/support/parity.py's ``CollectiveCounter``).
- ``reference:TOL:REASON``: PyTorch cannot run a feature of the cell; the reference replaces it as
  the feature's ``reference`` says (compile -> eager, fsdp2's int8 all-gather -> the exact one,
  torchao's float8 all-gather -> float8 training without it, fsdp2.optim.Muon ->
  torch.optim.Muon on an unsharded replica, checkpoint -> the uninterrupted run) and is
  otherwise PyTorch's FSDP2. ``TOL`` 0 is bitwise; else losses agree within ``TOL`` relative and
  parameters within ``TOL`` absolute, for the reason given.
- ``refused:ERROR_TYPE:REGEX``: fsdp2 refuses the cell when it is built or at its first step with
  ``ERROR_TYPE`` (``FSDPUsageError``: fsdp2's, or, from a compiled call, dynamo's error quoting
  ``FSDPUsageError(``) whose message matches ``REGEX``.
- ``n/a:REASON``: not run (skipped with the reason): the two features want different meshes, and
  together they need 8 ranks.

FEATURES and CELLS are data; XFAIL lists the cells that are known fsdp2 defects (strict xfails).
``docs/composition.md`` is rendered from them (``python -m tests.compose.test_matrix --write``
regenerates it; a test checks it is current).

The selected cells run in one harness call per world size, the compiled ones in another (the
start-up of rank processes is shared); an error in a cell is caught on its ranks and reported
by that cell's test. Selecting cells with ``-k`` runs only those.

Every run must move every trainable parameter and no frozen one (so no cell passes by training
nothing), a checkpoint cell must have loaded into the layout it says, and
``test_the_comparison_tells_runs_apart`` shows that the comparison fails for runs that differ.

Optimizer: SGD with momentum (lr 0.1): element-wise, so bitwise cells stay bitwise, and unlike
Adam it does not turn rounding noise in near-zero gradients into full-size updates, so a
tolerance cell's bound means something.

Run time: about 3.5 minutes on 2 busy cores, most of it in the 12 compiled cells (3-12 s each).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp2.models import Llama, LlamaConfig
from tests.support.parity import CollectiveCounter

pytestmark = pytest.mark.slow  # every pair of features: minutes

CFG = LlamaConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4, hidden_dim=48)
STEPS = 2
ROWS_PER_RANK = 2  # per microbatch
LR = 0.1
MAX_NORM = 0.5
MUON_LR, ADAMW_LR = 0.02, 3e-3
DOCS = Path(__file__).resolve().parents[2] / "docs" / "composition.md"


# -- what a run is made of ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """Everything that distinguishes one training run from another."""

    mesh: str = "fsdp"  # fsdp: 1-D over 2 ranks; hsdp: 2x2 (replicate, shard); tp: 2x2 (dp, tp); ft: shard 2 + hook
    mp: bool = False  # MixedPrecisionPolicy(bf16 params, fp32 reduce)
    offload: bool = False  # CPUOffloadPolicy(pin_memory=False)
    ac: bool = False  # checkpoint_wrapper around every block (non-reentrant)
    adapters: bool = False  # frozen feed-forward and embedding, a trainable low-rank adapter beside the feed-forward
    meta: bool = False  # built on the meta device, fully_shard, to_empty, weights loaded
    float8: str | None = None  # torchao float8 training: "gather" (float8 all-gather) or "plain"
    lowp: bool = False  # fsdp2 set_all_gather_policy(AllGatherPolicy(torch.int8))
    compile: bool = False  # torch.compile(model, backend="aot_eager", fullgraph=True)
    nosync: bool = False  # 2 microbatches, set_requires_gradient_sync(False) on the first
    last_backward: bool = False  # 2 microbatches, set_is_last_backward(False) then (True)
    optimizer: str = "sgd"  # sgd | muon (fsdp2.optim.Muon) | replica-muon (torch.optim.Muon on an unsharded replica)
    clip: bool = False  # fsdp2.clip_grad_norm_ before each optimizer step
    ckpt: bool = False  # fsdp2.checkpoint.save after step 1, load into a fresh model, continue
    ckpt_reshard: bool = True  # ...a fresh model sharded by columns (Shard(1)) instead of rows
    twice: bool = False  # the last block applied twice per forward
    two_forwards: bool = False  # two forwards (a row of the microbatch each), one backward of their mean
    chunked: bool = False  # norm and output one group, applied per half of the sequence inside forward
    layers: int = CFG.n_layers  # transformer blocks (each its own group)

    @property
    def microbatches(self) -> int:
        return 2 if (self.nosync or self.last_backward) else 1

    @property
    def world(self) -> int:
        return 2 if self.mesh == "fsdp" else 4


@dataclass(frozen=True)
class Feature:
    title: str
    what: str  # how the run changes, for the docs
    setup: dict  # Setup fields the feature sets
    reference: dict = field(default_factory=dict)  # fields the reference runs with instead (PyTorch cannot run it)
    reference_is: str = ""  # for the docs: what the reference is then
    # Where fsdp2 issues fewer all-gathers than PyTorch's FSDP2 (the other collectives equal): why.
    fewer_gathers: str = ""


# Why eager fsdp2 issues fewer all-gathers than PyTorch's FSDP2 where a module runs more than once per backward.
_ONE_GATHER_PER_BACKWARD = (
    "in backward, a group that ran more than once stays gathered until all its uses' gradients are in (one "
    "all-gather); PyTorch's FSDP2 reshards after each use's backward and gathers again for the next"
)

FEATURES: dict[str, Feature] = {
    "mp": Feature("mixed precision", "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)", {"mp": True}),
    "hsdp": Feature("HSDP", "2x2 (replicate, shard) mesh on 4 ranks", {"mesh": "hsdp"}),
    "tp": Feature(
        "TP",
        "dp2 x tp2 on 4 ranks: parallelize_module on mesh['tp'] first, then fully_shard on mesh['dp']",
        {"mesh": "tp"},
    ),
    "ac": Feature("activation checkpointing", "checkpoint_wrapper (non-reentrant) around every block", {"ac": True}),
    "nosync": Feature(
        "no-sync accumulation", "2 microbatches, set_requires_gradient_sync(False) on the first", {"nosync": True}
    ),
    "lastbwd": Feature(
        "set_is_last_backward",
        "2 microbatches, set_is_last_backward(False) then (True), gradients synced each",
        {"last_backward": True},
    ),
    "compile": Feature(
        "compile",
        'torch.compile(model, backend="aot_eager", fullgraph=True) over the whole model',
        {"compile": True},
        {"compile": False},
        "the same run eager",
    ),
    "float8": Feature(
        "torchao float8",
        "convert_to_float8_training(Float8LinearConfig(enable_fsdp_float8_all_gather=True)), "
        "precompute_float8_dynamic_scale_for_fsdp after each step",
        {"float8": "gather"},
        {"float8": "plain"},
        "float8 training without the float8 all-gather (PyTorch cannot all-gather float8 over gloo)",
    ),
    "lowp": Feature(
        "fsdp2 int8 all-gather",
        "set_all_gather_policy(AllGatherPolicy(torch.int8))",
        {"lowp": True},
        {"lowp": False},
        "the exact all-gather",
    ),
    "muon": Feature(
        "Muon",
        "fsdp2.optim.Muon(muon_param_groups(model), lr=0.02, adamw_lr=3e-3) instead of SGD",
        {"optimizer": "muon"},
        {"optimizer": "replica-muon"},
        "torch.optim.Muon + AdamW on an unsharded replica stepped with the gathered gradients, copied back into the shards",
    ),
    "ft": Feature(
        "ft all-reduce hook",
        "fault-tolerant HSDP as fsdp2.ft wires it on 4 ranks: fully_shard on each replica group's 1-D shard mesh (2 ranks), "
        "set_all_reduce_hook averaging across the 2 replica groups (a plain all-reduce standing in for torchft's)",
        {"mesh": "ft"},
    ),
    "frozen": Feature(
        "frozen + adapter",
        "feed-forward weights and embedding frozen, a trainable low-rank adapter (32 -> 4 -> 32) beside each feed-forward",
        {"adapters": True},
    ),
    "meta": Feature(
        "meta-device init", 'built under torch.device("meta"), fully_shard, to_empty, state dict loaded', {"meta": True}
    ),
    "offload": Feature("CPU offload", "CPUOffloadPolicy(pin_memory=False)", {"offload": True}),
    "ckpt": Feature(
        "checkpoint",
        "fsdp2.checkpoint.save (model + optimizer) after step 1; load into a fresh model of other initial weights "
        "sharded by columns (Shard(1)) where the cell allows, else by rows; continue",
        {"ckpt": True},
        {"ckpt": False},
        "the uninterrupted run",
    ),
    "clip": Feature("clip_grad_norm_", "fsdp2.clip_grad_norm_(max_norm=0.5) before each step", {"clip": True}),
    "twice": Feature(
        "a module called twice",
        "the last block applied twice per forward (to its own output)",
        {"twice": True},
        fewer_gathers=_ONE_GATHER_PER_BACKWARD,
    ),
    "twofwd": Feature(
        "two forwards, one backward",
        "each microbatch as two forwards (one row each), one backward of their losses' mean",
        {"two_forwards": True},
        fewer_gathers=_ONE_GATHER_PER_BACKWARD,
    ),
    "chunked": Feature(
        "chunked output head",
        "fully_shard([norm, output]) as one group (torchtitan's), applied per half of the sequence inside forward",
        {"chunked": True},
        fewer_gathers=_ONE_GATHER_PER_BACKWARD,
    ),
}

# Cells that combine these features load the checkpoint into a fresh model sharded by rows, as saved:
NO_COLUMN_RESHARD = {
    "clip": "the gradient norm's partial sums follow the shard layout (not bitwise across layouts)",
    "float8": "torchao's float8 weights all-gather through fsdp_pre_all_gather, for dim-0 shards only",
}


def cell_id(features: tuple[str, ...]) -> str:
    return "+".join(features)


def all_cells() -> list[tuple[str, ...]]:
    names = list(FEATURES)
    return [(n,) for n in names] + list(itertools.combinations(names, 2))


def setups(features: tuple[str, ...]) -> tuple[Setup, Setup] | str:
    """(subject, reference) for a cell, or why the features cannot be combined."""
    subject: dict = {}
    for name in features:
        for key, value in FEATURES[name].setup.items():
            if key in subject and subject[key] != value:
                return f"{' and '.join(features)} both set {key}"
            subject[key] = value
        if name in NO_COLUMN_RESHARD:
            subject["ckpt_reshard"] = False
    reference = dict(subject)
    for name in features:
        reference.update(FEATURES[name].reference)
    return Setup(**subject), Setup(**reference)


# -- expected outcomes ---------------------------------------------------------------------------------

# Cell (features in FEATURES order, joined by "+") -> expected outcome:
#   "pytorch" | "reference:TOL:REASON" (REASON: what replaced which feature -- why not bitwise)
#   | "refused:ERROR_TYPE:REGEX" | "n/a:REASON"
CELLS: dict[str, str] = {
    "mp": "pytorch",
    "hsdp": "pytorch",
    "tp": "pytorch",
    "ac": "pytorch",
    "nosync": "pytorch",
    "lastbwd": "pytorch",
    "compile": "reference:0:the same run eager",
    "float8": "reference:0:float8 training without the float8 all-gather",
    "lowp": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "muon": "reference:0:torch.optim.Muon on an unsharded replica",
    "ft": "pytorch",
    "frozen": "pytorch",
    "meta": "pytorch",
    "offload": "pytorch",
    "ckpt": "reference:0:the uninterrupted run",
    "clip": "pytorch",
    "mp+hsdp": "pytorch",
    "mp+tp": "pytorch",
    "mp+ac": "pytorch",
    "mp+nosync": "pytorch",
    "mp+lastbwd": "pytorch",
    "mp+compile": "reference:0:the same run eager",
    "mp+float8": "reference:2e-3:float8 training without the float8 all-gather -- with bf16 parameters the float8 all-gather takes its scales from the fp32 masters, the reference from the bf16 copies",
    "mp+lowp": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "mp+muon": "reference:0:torch.optim.Muon on an unsharded replica",
    "mp+ft": "pytorch",
    "mp+frozen": "pytorch",
    "mp+meta": "pytorch",
    "mp+offload": "pytorch",
    "mp+ckpt": "reference:0:the uninterrupted run",
    "mp+clip": "pytorch",
    "hsdp+tp": "n/a:HSDP x TP needs 8 ranks (replicate x shard x tp, 2x2x2): tests/runtime/test_2d.py runs it against an unsharded model",
    "hsdp+ac": "pytorch",
    "hsdp+nosync": "pytorch",
    "hsdp+lastbwd": "pytorch",
    "hsdp+compile": "reference:0:the same run eager",
    "hsdp+float8": "reference:0:float8 training without the float8 all-gather",
    "hsdp+lowp": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "hsdp+muon": "reference:0:torch.optim.Muon on an unsharded replica",
    "hsdp+ft": "n/a:ft is HSDP already (its hook is the replicate dim); HSDP inside each torchft replica group needs 8 ranks (2 groups of 2x2)",
    "hsdp+frozen": "pytorch",
    "hsdp+meta": "pytorch",
    "hsdp+offload": "pytorch",
    "hsdp+ckpt": "reference:0:the uninterrupted run",
    "hsdp+clip": "pytorch",
    "tp+ac": "pytorch",
    "tp+nosync": "pytorch",
    "tp+lastbwd": "pytorch",
    "tp+compile": "reference:0:the same run eager",
    "tp+float8": "reference:2e-3:float8 training without the float8 all-gather -- under TP the float8 all-gather scales each TP shard by its own amax (torchao's fsdp_pre_all_gather reduces it over the FSDP mesh), the reference the whole weight by its amax",
    "tp+lowp": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "tp+muon": "refused:FSDPUsageError:tensor-parallel \\+ FSDP parameters .*are not supported -- fsdp2.optim.Muon gathers a matrix within one shard group; TP + FSDP parameters are sharded on two mesh dims (the error says to put them in an AdamW group)",
    "tp+ft": "n/a:TP inside each torchft replica group (dp 2 x tp 2 per group) needs 8 ranks",
    "tp+frozen": "pytorch",
    "tp+meta": "pytorch",
    "tp+offload": "pytorch",
    "tp+ckpt": "reference:0:the uninterrupted run",
    "tp+clip": "pytorch",
    "ac+nosync": "pytorch",
    "ac+lastbwd": "pytorch",
    "ac+compile": "reference:0:the same run eager",
    "ac+float8": "reference:0:float8 training without the float8 all-gather",
    "ac+lowp": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "ac+muon": "reference:0:torch.optim.Muon on an unsharded replica",
    "ac+ft": "pytorch",
    "ac+frozen": "pytorch",
    "ac+meta": "pytorch",
    "ac+offload": "pytorch",
    "ac+ckpt": "reference:0:the uninterrupted run",
    "ac+clip": "pytorch",
    "nosync+lastbwd": "pytorch",
    "nosync+compile": "reference:0:the same run eager",
    "nosync+float8": "reference:0:float8 training without the float8 all-gather",
    "nosync+lowp": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "nosync+muon": "reference:0:torch.optim.Muon on an unsharded replica",
    "nosync+ft": "pytorch",
    "nosync+frozen": "pytorch",
    "nosync+meta": "pytorch",
    "nosync+offload": "pytorch",
    "nosync+ckpt": "reference:0:the uninterrupted run",
    "nosync+clip": "pytorch",
    "lastbwd+compile": "reference:0:the same run eager",
    "lastbwd+float8": "reference:0:float8 training without the float8 all-gather",
    "lastbwd+lowp": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "lastbwd+muon": "reference:0:torch.optim.Muon on an unsharded replica",
    "lastbwd+ft": "pytorch",
    "lastbwd+frozen": "pytorch",
    "lastbwd+meta": "pytorch",
    "lastbwd+offload": "pytorch",
    "lastbwd+ckpt": "reference:0:the uninterrupted run",
    "lastbwd+clip": "pytorch",
    "compile+float8": "reference:0:the same run eager; float8 training without the float8 all-gather",
    "compile+lowp": "reference:2e-3:the same run eager; the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "compile+muon": "reference:0:the same run eager; torch.optim.Muon on an unsharded replica",
    "compile+ft": "reference:0:the same run eager",
    "compile+frozen": "reference:0:the same run eager",
    "compile+meta": "reference:0:the same run eager",
    "compile+offload": "reference:0:the same run eager",
    "compile+ckpt": "reference:0:the same run eager; the uninterrupted run",
    "compile+clip": "reference:0:the same run eager",
    "float8+lowp": "reference:2e-3:float8 training without the float8 all-gather; the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "float8+muon": "reference:0:float8 training without the float8 all-gather; torch.optim.Muon on an unsharded replica",
    "float8+ft": "reference:0:float8 training without the float8 all-gather",
    "float8+frozen": "reference:0:float8 training without the float8 all-gather",
    "float8+meta": "reference:0:float8 training without the float8 all-gather",
    "float8+offload": "reference:0:float8 training without the float8 all-gather",
    "float8+ckpt": "reference:0:float8 training without the float8 all-gather; the uninterrupted run, loaded by rows (float8 weights all-gather through fsdp_pre_all_gather, for dim-0 shards only: Shard(1) is refused by name)",
    "float8+clip": "reference:0:float8 training without the float8 all-gather",
    "lowp+muon": "reference:2e-2:the exact all-gather; torch.optim.Muon on an unsharded replica -- int8 weights (a scale per 128 elements) in forward and backward; the AdamW group's first steps move each weight by about lr (3e-3) whatever its gradient's size, so a near-zero gradient whose sign the int8 weights flip moves a weight by up to 2 lr a step",
    "lowp+ft": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "lowp+frozen": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "lowp+meta": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "lowp+offload": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "lowp+ckpt": "reference:2e-3:the exact all-gather; the uninterrupted run -- int8 weights (a scale per 128 elements) in forward and backward",
    "lowp+clip": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "muon+ft": "reference:0:torch.optim.Muon on an unsharded replica",
    "muon+frozen": "reference:0:torch.optim.Muon on an unsharded replica",
    "muon+meta": "reference:0:torch.optim.Muon on an unsharded replica",
    "muon+offload": "reference:0:torch.optim.Muon on an unsharded replica",
    "muon+ckpt": "reference:0:torch.optim.Muon on an unsharded replica; the uninterrupted run",
    "muon+clip": "reference:0:torch.optim.Muon on an unsharded replica",
    "ft+frozen": "pytorch",
    "ft+meta": "pytorch",
    "ft+offload": "pytorch",
    "ft+ckpt": "reference:0:the uninterrupted run",
    "ft+clip": "pytorch",
    "frozen+meta": "pytorch",
    "frozen+offload": "pytorch",
    "frozen+ckpt": "reference:0:the uninterrupted run",
    "frozen+clip": "pytorch",
    "meta+offload": "pytorch",
    "meta+ckpt": "reference:0:the uninterrupted run",
    "meta+clip": "pytorch",
    "offload+ckpt": "reference:0:the uninterrupted run",
    "offload+clip": "pytorch",
    "ckpt+clip": "reference:0:the uninterrupted run, loaded by rows (the gradient norm's partial sums follow the shard layout)",
    "mp+twice": "pytorch",
    "mp+twofwd": "pytorch",
    "mp+chunked": "pytorch",
    "hsdp+twice": "pytorch",
    "hsdp+twofwd": "pytorch",
    "hsdp+chunked": "pytorch",
    "tp+twice": "pytorch",
    "tp+twofwd": "pytorch",
    "tp+chunked": "pytorch",
    "ac+twice": "pytorch",
    "ac+twofwd": "pytorch",
    "ac+chunked": "pytorch",
    "nosync+twice": "pytorch-within:1e-6:in the synced backward after one without sync, PyTorch's FSDP2 reduce-scatters a module that ran more than once twice (the kept sum when the first use's backward ends, the rest at the second); fsdp2 reduce-scatters their sum once, as for a module that ran once (rounding)",
    "nosync+twofwd": "pytorch-within:1e-6:in the synced backward after one without sync, PyTorch's FSDP2 reduce-scatters a module that ran more than once twice (the kept sum when the first use's backward ends, the rest at the second); fsdp2 reduce-scatters their sum once, as for a module that ran once (rounding)",
    "nosync+chunked": "pytorch-within:1e-6:in the synced backward after one without sync, PyTorch's FSDP2 reduce-scatters a module that ran more than once twice (the kept sum when the first use's backward ends, the rest at the second); fsdp2 reduce-scatters their sum once, as for a module that ran once (rounding)",
    "lastbwd+twice": "pytorch",
    "lastbwd+twofwd": "pytorch",
    "lastbwd+chunked": "pytorch",
    "compile+twice": "reference:0:the same run eager",
    "compile+twofwd": "reference:1e-6:the same run eager -- each compiled forward's graph reduces its own gradient, eager reduces their sum once (rounding)",
    "compile+chunked": "reference:0:the same run eager",
    "float8+twice": "reference:0:float8 training without the float8 all-gather",
    "float8+twofwd": "reference:0:float8 training without the float8 all-gather",
    "float8+chunked": "reference:0:float8 training without the float8 all-gather",
    "lowp+twice": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "lowp+twofwd": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "lowp+chunked": "reference:2e-3:the exact all-gather -- int8 weights (a scale per 128 elements) in forward and backward",
    "muon+twice": "reference:0:torch.optim.Muon on an unsharded replica",
    "muon+twofwd": "reference:0:torch.optim.Muon on an unsharded replica",
    "muon+chunked": "reference:0:torch.optim.Muon on an unsharded replica",
    "ft+twice": "pytorch",
    "ft+twofwd": "pytorch",
    "ft+chunked": "pytorch",
    "frozen+twice": "pytorch",
    "frozen+twofwd": "pytorch",
    "frozen+chunked": "pytorch",
    "meta+twice": "pytorch",
    "meta+twofwd": "pytorch",
    "meta+chunked": "pytorch",
    "offload+twice": "pytorch",
    "offload+twofwd": "pytorch",
    "offload+chunked": "pytorch",
    "ckpt+twice": "reference:0:the uninterrupted run",
    "ckpt+twofwd": "reference:0:the uninterrupted run",
    "ckpt+chunked": "reference:0:the uninterrupted run",
    "clip+twice": "pytorch",
    "clip+twofwd": "pytorch",
    "clip+chunked": "pytorch",
    "twice": "pytorch",
    "twice+twofwd": "pytorch",
    "twice+chunked": "pytorch",
    "twofwd": "pytorch",
    "twofwd+chunked": "pytorch",
    "chunked": "pytorch",
}

# Cell -> what differs from the expectation in CELLS: fsdp2 defects, strict xfails until fixed.
XFAIL: dict[str, str] = {}


# -- building a run ------------------------------------------------------------------------------------


class _LowRank(nn.Module):
    def __init__(self, dim: int, rank: int = 4):
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)

    def forward(self, x):
        return self.up(self.down(x))


def _adapted_block_forward(self, x, cos, sin):
    x = x + self.attn(self.attn_norm(x), cos, sin)
    h = self.ffn_norm(x)
    return x + self.ffn(h) + self.adapter(h)  # the frozen base beside its trainable adapter


class _MultiCallLlama(Llama):
    """The Llama of the ``twice`` and ``chunked`` features: a module run more than once per forward."""

    twice = False  # the last block again, on its own output
    chunks = 1  # the output head (norm, output) per chunk of the sequence

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        if self.twice:
            x = self.blocks[-1](x, self.rope_cos, self.rope_sin)
        return torch.cat([self.output(self.norm(c)) for c in x.chunk(self.chunks, dim=1)], dim=1)


def _model(setup: Setup) -> nn.Module:
    model = Llama(dataclasses.replace(CFG, n_layers=setup.layers))
    if setup.twice or setup.chunked:
        model.__class__ = _MultiCallLlama
        model.twice, model.chunks = setup.twice, 2 if setup.chunked else 1
    if setup.adapters:
        from fsdp2.models.llama import Block

        cls = type("AdaptedBlock", (Block,), {"forward": _adapted_block_forward})
        for block in model.blocks:
            block.adapter = _LowRank(CFG.dim)
            block.__class__ = cls
            block.ffn.requires_grad_(False)
        model.tok_emb.requires_grad_(False)  # the first block's input needs no gradient
    if setup.float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=setup.float8 == "gather")
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda m, fqn: fqn.startswith("blocks.") and "adapter" not in fqn
        )
    return model


@dataclass
class _Meshes:
    fsdp: object  # the mesh fully_shard gets
    tp: object | None
    replicate_group: object | None  # ft: the hook's process group
    dp_rank: int
    dp_size: int


_MESHES: dict[tuple[str, int], _Meshes] = {}  # per rank process: one set of process groups per mesh kind


def _meshes(setup: Setup, rank: int, ws: int) -> _Meshes:
    if (setup.mesh, ws) not in _MESHES:
        _MESHES[setup.mesh, ws] = _make_meshes(setup, rank, ws)
    return _MESHES[setup.mesh, ws]


def _make_meshes(setup: Setup, rank: int, ws: int) -> _Meshes:
    from torch.distributed.device_mesh import init_device_mesh

    if setup.mesh == "fsdp":
        return _Meshes(init_device_mesh("cpu", (ws,)), None, None, rank, ws)
    if setup.mesh == "hsdp":
        return _Meshes(
            init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard")), None, None, rank, ws
        )
    if setup.mesh == "ft":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
        return _Meshes(mesh["shard"], None, mesh.get_group("replicate"), rank, ws)
    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
    return _Meshes(mesh["dp"], mesh["tp"], None, mesh["dp"].get_local_rank(), 2)


def _tp_plan(setup: Setup) -> dict:
    from fsdp2.models import tensor_parallel_plan

    if not setup.float8:
        return tensor_parallel_plan()
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    # torchao's float8 versions of the same Megatron-style plan
    return {
        k: Float8ColwiseParallel() if "Colwise" in type(v).__name__ else Float8RowwiseParallel()
        for k, v in tensor_parallel_plan().items()
    }


def _fully_shard_fn(engine: str):
    if engine == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp2 import fully_shard
    return fully_shard


def _build(setup: Setup, engine: str, meshes: _Meshes, seed: int = 0, columns: bool = False) -> nn.Module:
    """The model of ``setup``, sharded by ``engine`` ("torch" or "fsdp2"), initial weights from ``seed``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    torch.manual_seed(seed)
    with torch.device("meta") if setup.meta else contextlib.nullcontext():
        model = _model(setup)
    if meshes.tp is not None:
        for block in model.blocks:
            parallelize_module(block, meshes.tp, _tp_plan(setup))
    if setup.ac:
        model.blocks = nn.ModuleList(checkpoint_wrapper(block) for block in model.blocks)
    kwargs = {
        "mesh": meshes.fsdp,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if setup.mp
        else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy(pin_memory=False) if setup.offload else OffloadPolicy(),
    }
    if columns:
        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 else Shard(0)
    fully_shard = _fully_shard_fn(engine)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    if setup.chunked:
        fully_shard([model.norm, model.output], **kwargs)
    fully_shard(model, **kwargs)
    if setup.meta:
        model.to_empty(device="cpu")
        from fsdp2.models.llama import rotary_tables

        model.rope_cos, model.rope_sin = rotary_tables(CFG)  # non-persistent buffers: not in the state dict
        donor = _build(dataclasses.replace(setup, meta=False), engine, meshes, seed, columns)
        model.load_state_dict(donor.state_dict())
    if setup.lowp:
        from fsdp2 import AllGatherPolicy

        model.set_all_gather_policy(AllGatherPolicy(torch.int8))
    if meshes.replicate_group is not None:
        group = meshes.replicate_group

        def across_replicas(reduced: torch.Tensor) -> None:  # torchft's Manager.allreduce: an average
            import torch.distributed as dist

            dist.all_reduce(reduced, group=group)
            reduced.div_(dist.get_world_size(group))

        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():  # fsdp2's modules are PyTorch's FSDPModules too
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(across_replicas)
    return model


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The values of a (DTensor of a) torchao float8 training weight, or of a plain tensor."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return getattr(t, "_tensor", t).detach()


class _ReplicaMuon:
    """torch.optim.Muon + AdamW stepping an unsharded replica of the trainable parameters on the
    model's gathered gradients; the results are copied back into the model's shards."""

    def __init__(self, model: nn.Module):
        from fsdp2.optim.muon import default_use_muon

        rule = default_use_muon(model)
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.replica = {n: nn.Parameter(_plain(p).clone()) for n, p in self.params}
        muon = [self.replica[n] for n, p in self.params if rule(n, p)]
        other = [self.replica[n] for n, p in self.params if not rule(n, p)]
        self.opts = [torch.optim.Muon(muon, lr=MUON_LR), torch.optim.AdamW(other, lr=ADAMW_LR, weight_decay=0.1)]

    def step(self):
        from torch.distributed.tensor import distribute_tensor

        for n, p in self.params:
            self.replica[n].grad = None if p.grad is None else _plain(p.grad).clone()
        for opt in self.opts:
            opt.step()
        with torch.no_grad():
            for n, p in self.params:
                local = distribute_tensor(self.replica[n].detach(), p.device_mesh, p.placements, src_data_rank=None)
                target = p.to_local()
                getattr(target, "_tensor", target).copy_(local.to_local())

    def zero_grad(self):
        for n, p in self.params:
            p.grad = None


def _optimizer(setup: Setup, model: nn.Module):
    if setup.optimizer == "muon":
        from fsdp2.optim import Muon, muon_param_groups

        return Muon(muon_param_groups(model), lr=MUON_LR, adamw_lr=ADAMW_LR)
    if setup.optimizer == "replica-muon":
        return _ReplicaMuon(model)
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)


def _batch(step: int, micro: int, meshes: _Meshes):
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, CFG.vocab_size, (ROWS_PER_RANK * meshes.dp_size, CFG.seq_len + 1), generator=g)
    rows = tokens[ROWS_PER_RANK * meshes.dp_rank : ROWS_PER_RANK * (meshes.dp_rank + 1)]
    return rows[:, :-1], rows[:, 1:]


def _loss(run, x, y):
    return F.cross_entropy(run(x).flatten(0, 1).float(), y.flatten())


def _microbatch_loss(setup: Setup, model: nn.Module, run, step: int, micro: int, meshes: _Meshes) -> torch.Tensor:
    """Microbatch ``micro`` of ``step``: the model's accumulation settings for it, then its loss
    (``two_forwards``: the mean of two forwards' losses, a row each)."""
    last = micro == setup.microbatches - 1
    if setup.nosync:
        model.set_requires_gradient_sync(last)
    if setup.last_backward:
        model.set_is_last_backward(last)
    x, y = _batch(step, micro, meshes)
    if setup.two_forwards:
        return (_loss(run, x[:1], y[:1]) + _loss(run, x[1:], y[1:])) / 2
    return _loss(run, x, y)


class _Stage:
    """Where a run is, for the report of a refusal: 'build', then 'step N'."""

    def __init__(self):
        self.name = "build"


def _train(setup: Setup, engine: str, rank: int, ws: int, ckpt_dir: str | None, stage: _Stage) -> dict:
    """Losses, gradient norms and final full parameters of one run."""
    import torch._dynamo

    meshes = _meshes(setup, rank, ws)
    if setup.compile:
        torch._dynamo.reset()

    def make(seed, columns=False):
        model = _build(setup, engine, meshes, seed, columns)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if setup.compile else model
        return model, run, _optimizer(setup, model)

    def precompute(model):
        if setup.float8 == "gather":
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)

    model, run, opt = make(seed=0)
    initial = {n: (_plain(p).float().clone(), p.requires_grad) for n, p in model.named_parameters()}
    losses, norms, ckpt_layout, comm = [], [], "", {}
    for step in range(STEPS):
        stage.name = f"step {step}"
        if setup.ckpt and step == 1:
            from fsdp2 import checkpoint

            checkpoint.save(ckpt_dir, model, opt)
            model, run, opt = make(seed=1, columns=setup.ckpt_reshard)
            checkpoint.load(ckpt_dir, model, opt)
            precompute(model)
            ckpt_layout = str(sorted({str(p.placements) for p in model.parameters() if p.ndim == 2}))
        total = torch.zeros(())
        for micro in range(setup.microbatches):
            # The collectives forward and backward issue, counted as tests/support/parity.py counts them.
            with contextlib.nullcontext() if setup.compile else CollectiveCounter() as counter:
                loss = _microbatch_loss(setup, model, run, step, micro, meshes) / setup.microbatches
                loss.backward()
            if counter is not None:
                for name, n in counter.counts.items():
                    comm[name] = comm.get(name, 0) + n
            total += loss.detach().float()
        if setup.clip:
            from fsdp2 import clip_grad_norm_

            norms.append(clip_grad_norm_(model.parameters(), max_norm=MAX_NORM).detach().clone())
        opt.step()
        opt.zero_grad()
        precompute(model)
        losses.append(total)
    params = {n: _plain(p).float() for n, p in model.named_parameters()}
    if setup.compile:
        torch._dynamo.reset()
    # Not vacuous: every trainable parameter moved, no frozen one did.
    untrained = [n for n, (p, trains) in initial.items() if trains and torch.equal(p, params[n])]
    frozen_moved = [n for n, (p, trains) in initial.items() if not trains and not torch.equal(p, params[n])]
    return {
        "losses": losses,
        "norms": norms,
        "params": params,
        "untrained": untrained,
        "frozen_moved": frozen_moved,
        "ckpt_layout": ckpt_layout,
        "comm": comm,
    }


def _compare(subject: dict, reference: dict) -> dict:
    loss_diff = max(
        (abs(a.item() - b.item()) / max(abs(b.item()), 1e-12) for a, b in zip(subject["losses"], reference["losses"])),
        default=0.0,
    )
    norm_diff = max(
        (abs(a.item() - b.item()) / max(abs(b.item()), 1e-12) for a, b in zip(subject["norms"], reference["norms"])),
        default=0.0,
    )
    assert subject["params"].keys() == reference["params"].keys()
    worst, worst_name = 0.0, None
    for name, a in subject["params"].items():
        diff = (a - reference["params"][name]).abs().max().item()
        if diff > worst or worst_name is None:
            worst, worst_name = diff, name
    bitwise = (
        all(torch.equal(a, b) for a, b in zip(subject["losses"], reference["losses"]))
        and all(torch.equal(a, b) for a, b in zip(subject["norms"], reference["norms"]))
        and all(torch.equal(a, reference["params"][n]) for n, a in subject["params"].items())
    )
    return {
        "bitwise": bitwise,
        "loss_diff": max(loss_diff, norm_diff),
        "param_diff": worst,
        "worst_param": worst_name,
        "losses": [x.item() for x in subject["losses"]],
        "reference_losses": [x.item() for x in reference["losses"]],
        "comm": subject["comm"],
        "reference_comm": reference["comm"],
    }


def _run_cell(rank: int, ws: int, features: tuple[str, ...], root_dir: str) -> dict:
    subject, reference = setups(features)
    stage = _Stage()
    ckpt_dir = os.path.join(root_dir, cell_id(features))
    try:
        ours = _train(subject, "fsdp2", rank, ws, ckpt_dir, stage)
    except Exception as error:  # noqa: BLE001 - a refusal (or a defect) is this cell's result
        import torch._dynamo

        torch._dynamo.reset()
        return {
            "status": "error",
            "stage": stage.name,
            "type": type(error).__name__,
            "fsdp_usage": _is_fsdp_usage_error(error),
            "message": f"{type(error).__name__}: {error}",
        }
    theirs = _train(reference, "torch", rank, ws, None, _Stage())
    return {
        "status": "ok",
        **_compare(ours, theirs),
        **{k: ours[k] for k in ("untrained", "frozen_moved", "ckpt_layout")},
    }


def _is_fsdp_usage_error(error: BaseException) -> bool:
    from fsdp2 import FSDPUsageError

    return isinstance(error, FSDPUsageError) or "FSDPUsageError(" in str(error)


def run_cells(rank: int, ws: int, cells: list[tuple[str, ...]], root_dir: str) -> dict:
    """Every cell in ``cells`` on this world, one after the other; per cell its result on this rank."""
    import traceback

    import torch.distributed as dist

    results = {}
    for features in cells:
        start = time.perf_counter()
        try:
            result = _run_cell(rank, ws, features, root_dir)
        except Exception:  # noqa: BLE001 - the reference failed: reported by the cell's test
            result = {"status": "broken", "message": traceback.format_exc()}
        result["seconds"] = time.perf_counter() - start
        results[cell_id(features)] = result
        dist.barrier()
    return results


# -- the tests -----------------------------------------------------------------------------------------


def _parse(outcome: str) -> tuple[str, str, str]:
    """(kind, tolerance or error type, reason or regex)."""
    kind, _, rest = outcome.partition(":")
    if kind in ("reference", "refused", "pytorch-within"):
        first, _, second = rest.partition(":")
        return kind, first, second
    return kind, "", rest


def _params():
    for features in all_cells():
        cid = cell_id(features)
        marks = [pytest.mark.xfail(strict=True, reason=XFAIL[cid])] if cid in XFAIL else []
        yield pytest.param(cid, id=cid, marks=marks)


_RESULTS: dict[str, dict] = {}


def _groups(selected: list[str]) -> list[tuple[int, list[tuple[str, ...]]]]:
    """Harness calls for the selected cells: one per world size, compiled cells in another."""
    groups: dict[tuple[int, bool], list] = {}
    for cid in selected:
        if _parse(CELLS[cid])[0] == "n/a":
            continue
        features = tuple(cid.split("+"))
        subject, _ = setups(features)
        groups.setdefault((subject.world, subject.compile), []).append(features)
    return [(world, cells) for (world, _), cells in sorted(groups.items())]


@pytest.fixture(scope="module")
def matrix(worlds, request, tmp_path_factory):
    """Results of every selected cell, run in a few harness calls (per world size)."""
    selected = [
        item.callspec.params["cell"]
        for item in request.session.items
        if item.module is sys.modules[__name__] and hasattr(item, "callspec") and "cell" in item.callspec.params
    ]
    root = tmp_path_factory.mktemp("matrix")
    for world, cells in _groups(selected):
        start = time.perf_counter()
        try:
            results = worlds.run(world, run_cells, cells, str(root), timeout=900)
            print(
                f"\n{len(cells)} cells on {world} ranks: {time.perf_counter() - start:.1f} s "
                f"(cells {sum(r['seconds'] for r in results[0].values()):.1f} s)"
            )
        except Exception as error:  # noqa: BLE001 - each cell's test reports it
            for features in cells:
                _RESULTS[cell_id(features)] = {"status": "broken", "message": f"harness call failed: {error}"}
            continue
        for cid, result in results[0].items():
            statuses = {r[cid]["status"] for r in results}
            if len(statuses) > 1:
                result = {"status": "broken", "message": f"ranks disagree: {[r[cid] for r in results]}"}
            _RESULTS[cid] = result
    return _RESULTS


@pytest.mark.parametrize("cell", list(_params()))
def test_cell(matrix, cell):
    expected = CELLS[cell]
    kind, tol, reason = _parse(expected)
    if kind == "n/a":
        pytest.skip(f"not run: {reason}")
    result = matrix[cell]
    if kind == "refused":
        assert result["status"] == "error", f"{cell}: expected a refusal matching {reason!r}, got {result}"
        assert result["stage"] in ("build", "step 0"), result
        if tol == "FSDPUsageError":
            assert result["fsdp_usage"], result["message"]
        else:
            assert result["type"] == tol, result["message"]
        assert re.search(reason.partition(" -- ")[0], result["message"]), result["message"]
        return
    assert result["status"] == "ok", f"{cell}: {result['message']}"
    assert not result["untrained"] and not result["frozen_moved"], result
    subject, _ = setups(tuple(cell.split("+")))
    if subject.ckpt:  # loaded into a model sharded by columns where the cell allows
        assert ("Shard(dim=1)" in result["ckpt_layout"]) == subject.ckpt_reshard, result["ckpt_layout"]
    if kind == "pytorch":  # and the same collectives issued in forward and backward
        comm, reference_comm = dict(result["comm"]), dict(result["reference_comm"])
        if any(FEATURES[name].fewer_gathers for name in cell.split("+")):  # at most as many all-gathers
            gathers, reference_gathers = comm.pop(_ALL_GATHER, 0), reference_comm.pop(_ALL_GATHER, 0)
            assert gathers <= reference_gathers, (result["comm"], result["reference_comm"])
        assert comm == reference_comm, (result["comm"], result["reference_comm"])
    if kind == "pytorch-within":  # at most PyTorch's collectives of each kind
        for op, n in result["comm"].items():
            assert n <= result["reference_comm"].get(op, 0), (result["comm"], result["reference_comm"])
    if kind == "pytorch" or float(tol) == 0:
        assert result["bitwise"], f"{cell}: not bitwise: {result}"
    else:
        assert result["loss_diff"] <= float(tol) and result["param_diff"] <= float(tol), f"{cell}: {result}"


_ALL_GATHER = "c10d._allgather_base_"


# -- the compiled step's collectives against eager's, per compile cell ------------------------------------

# Compile cells where the compiled step issues other collectives than eager fsdp2 (each a design
# choice the docs state), and what differs; every other compile cell issues eager's, call for call.
_GATHERS_PER_CALL = (
    "under reshard_after_forward the compiled backward gathers a group again once per call of its module "
    "(its recomputed gathers), eager once for all calls; the reductions are equal"
)
COMPILED_COLLECTIVES_DIFFER: dict[str, str] = {
    "compile+twice": _GATHERS_PER_CALL,
    "compile+chunked": _GATHERS_PER_CALL,
    "compile+twofwd": "each compiled forward is a graph whose backward gathers and reduces its own gradients; eager "
    "gathers once and reduces their sum once",
}


def _step_collectives(rank: int, ws: int, features: tuple[str, ...]) -> dict:
    """fsdp2's collectives (count_comm: calls and bytes per kind) of one training step's forwards
    and backwards, eager and compiled whole, of ``features``' subject run. The compiled step with
    a partitioner that rematerialises (aot_eager's keeps views of gathered parameters, so its
    backward would gather less than eager's: docs/compile.md). One block: each block is a group
    like the other, and tracing a second would only double the compile time."""
    import torch._dynamo

    from fsdp2.tools import count_comm

    subject = dataclasses.replace(setups(features)[0], layers=1)
    meshes = _meshes(subject, rank, ws)
    counts = {}
    for name in ("eager", "compiled"):
        torch._dynamo.reset()
        model = _build(subject, "fsdp2", meshes)
        run = (
            torch.compile(model, backend="aot_eager_decomp_partition", fullgraph=True) if name == "compiled" else model
        )

        def step(step):
            for micro in range(subject.microbatches):
                _microbatch_loss(subject, model, run, step, micro, meshes).backward()
            model.zero_grad()

        step(0)  # compiled once (and retraced inside the counter)
        with count_comm() as stats:
            step(1)
        counts[name] = {kind: (n, stats.bytes[kind]) for kind, n in stats.calls.items() if n}
    torch._dynamo.reset()
    return counts


def _compile_cells() -> list[str]:
    return [cid for cid in CELLS if "compile" in cid.split("+") and _parse(CELLS[cid])[0] not in ("n/a", "refused")]


@pytest.mark.parametrize("cell", _compile_cells())
def test_compiled_step_issues_eager_collectives(worlds, cell):
    """Per compile cell: the compiled whole step issues eager fsdp2's collectives (calls and bytes
    per kind), except where COMPILED_COLLECTIVES_DIFFER says how and why."""
    features = tuple(cell.split("+"))
    subject, _ = setups(features)
    counts = worlds.run(subject.world, _step_collectives, features)[0]
    if cell in COMPILED_COLLECTIVES_DIFFER:
        assert counts["compiled"] != counts["eager"], f"{cell}: now equal; drop it from COMPILED_COLLECTIVES_DIFFER"
        print(cell, counts)
        return
    assert counts["compiled"] == counts["eager"], counts


def _control(rank: int, ws: int) -> bool:
    """The comparison can fail: fsdp2 with mixed precision against PyTorch without it."""
    return _compare(
        _train(Setup(mp=True), "fsdp2", rank, ws, None, _Stage()), _train(Setup(), "torch", rank, ws, None, _Stage())
    )["bitwise"]


def test_the_comparison_tells_runs_apart(worlds):
    assert worlds.run(2, _control) == [False, False]


def _float8_tensor_parallel_compiled(rank: int, ws: int) -> bool:
    import torch._dynamo

    setup = Setup(mesh="tp", float8="gather", compile=True)
    with pytest.raises(Exception, match="torchao's float8 all-gather.*tensor-parallel") as raised:
        _train(setup, "fsdp2", rank, ws, None, _Stage())
    torch._dynamo.reset()
    return _is_fsdp_usage_error(raised.value)


def test_torchao_float8_all_gather_on_tensor_parallel_weights_under_the_compiled_whole_step_is_refused(worlds):
    """A triple beyond the pairs (tp, float8 gather, compile). Under TP the compiled step's float8
    hooks would scale each TP shard by its own amax (the precomputed whole-weight scale does not
    reach them), where eager uses the precomputed one: refused by name."""
    pytest.importorskip("torchao")
    assert worlds.run(4, _float8_tensor_parallel_compiled) == [True] * 4


def test_cells_cover_every_pair_and_agree_with_features():
    assert sorted(CELLS) == sorted(cell_id(c) for c in all_cells())
    assert set(XFAIL) <= set(CELLS)
    for features in all_cells():
        cid = cell_id(features)
        kind, tol, reason = _parse(CELLS[cid])
        assert kind in ("pytorch", "pytorch-within", "reference", "refused", "n/a"), cid
        pair = setups(features)
        if isinstance(pair, str):
            assert kind == "n/a", f"{cid}: {pair}"
            continue
        subject, reference = pair
        if kind in ("pytorch", "pytorch-within"):
            assert subject == reference, f"{cid}: PyTorch cannot run it as is: a reference cell"
        if kind == "pytorch-within":
            assert reason and float(tol) > 0, cid
        if kind == "reference":
            assert subject != reference and reason, cid
            float(tol)


# -- the docs table ------------------------------------------------------------------------------------

_SYMBOL = {"pytorch": "✓", "pytorch-within": "≈", "reference": "≈", "refused": "✗", "n/a": "–"}

_INTRO = f"""\
# Composition matrix

Generated from `tests/compose/test_matrix.py` (its `FEATURES`, `CELLS` and `XFAIL` tables) by
`python -m tests.compose.test_matrix --write`; a test there checks that this page is current. Do not edit
it by hand.

Every feature alone (the diagonal) and every pair of features is one test: {STEPS} optimizer steps
(SGD with momentum, lr 0.1, unless Muon) of a tiny Llama (dim 32, 2 blocks; every block and the
root fully_shard'ed) on 2 gloo ranks, or on 4 where a feature needs them, trained once with fsdp2
and once with the reference, from the same weights on the same batches. Every trainable parameter
must have moved and no frozen one.

- ✓: equal to PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) with the same features,
  bitwise (losses, gradient norms and final parameters), with the same collectives issued in
  forward and backward.
- ≈n: PyTorch cannot run a feature of the pair: equal to the reference of note n (what replaces
  that feature, below; PyTorch's FSDP2 for the rest), bitwise or within the tolerance stated there;
  or PyTorch runs it but reduces differently (note n says how): equal to PyTorch's FSDP2 within
  the tolerance stated there, with at most its collectives.
- ✗n: fsdp2 refuses the pair when it is built or at its first step with the error of note n
  (`FSDPUsageError`; from a compiled step, dynamo's error quoting it).
- –n: not run, for the reason of note n.
- ⚠n: a known fsdp2 defect: an expected failure in the tests until it is fixed.

The `compile` cells are also run once more, eager fsdp2 against the compiled step (with a
partitioner that rematerialises): the compiled step issues eager fsdp2's collectives, calls and
bytes, in every one of them except where a module runs more than once per backward
(`COMPILED_COLLECTIVES_DIFFER` says how; [compile.md](compile.md#modules-that-run-more-than-once-per-backward)).
"""


def _mark(cid: str, notes: list[str]) -> str:
    kind, tol, reason = _parse(CELLS[cid])
    if cid in XFAIL:
        text, symbol = f"**known defect (xfail)**: {XFAIL[cid]}. Expected: {_describe(kind, tol, reason)}", "⚠"
    elif kind == "pytorch":
        return "✓"
    else:
        text, symbol = _describe(kind, tol, reason), _SYMBOL[kind]
    if text not in notes:
        notes.append(text)
    return f"{symbol}{notes.index(text) + 1}"


def render() -> str:
    names = list(FEATURES)
    lines = [
        _INTRO,
        "## Features",
        "",
        "| feature | ranks | what the run does | reference where PyTorch cannot run it |",
        "| --- | --- | --- | --- |",
    ]
    for name, f in FEATURES.items():
        world = Setup(**f.setup).world
        what = f.what + (
            f" (✓ cells: at most PyTorch's all-gathers, the rest equal: {f.fewer_gathers})" if f.fewer_gathers else ""
        )
        lines.append(f"| `{name}` {f.title} | {world} | {what} | {f.reference_is or '(PyTorch runs it)'} |")
    notes: list[str] = []
    lines += [
        "",
        "## Matrix",
        "",
        "| | " + " | ".join(f"`{n}`" for n in names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for i, row in enumerate(names):
        marks = [
            _mark(cell_id((row,) if i == j else tuple(names[k] for k in sorted((i, j)))), notes)
            for j in range(len(names))
        ]
        lines.append(f"| `{row}` | " + " | ".join(marks) + " |")
    counts: dict[str, int] = {}
    for cid, outcome in CELLS.items():
        kind, tol, _ = _parse(outcome)
        key = (
            "known defects"
            if cid in XFAIL
            else {
                "pytorch": "bitwise equal to PyTorch",
                "pytorch-within": "within a tolerance of PyTorch",
                "refused": "refused",
                "n/a": "not run",
            }.get(kind)
        )
        key = key or ("bitwise equal to a reference" if float(tol) == 0 else "within a tolerance of a reference")
        counts[key] = counts.get(key, 0) + 1
    lines += ["", f"{len(CELLS)} cells: " + ", ".join(f"{n} {k}" for k, n in counts.items()) + ".", "", "## Notes", ""]
    lines += [f"{n}. {text}" for n, text in enumerate(notes, 1)]
    return "\n".join(lines) + "\n"


def _describe(kind: str, tol: str, reason: str) -> str:
    main, _, why = reason.partition(" -- ")
    if kind == "reference":
        if float(tol) == 0:
            return f"bitwise equal to the reference: {main}."
        return f"equal to the reference ({main}) within {tol} (losses relative, parameters absolute): {why}."
    if kind == "refused":
        return f"refused: {why}. {tol} matching `{main}`."
    if kind == "pytorch-within":
        return f"equal to PyTorch's FSDP2 within {tol} (losses relative, parameters absolute), with at most its collectives: {main}."
    return f"{main}."


def test_docs_table_is_current():
    assert DOCS.exists() and DOCS.read_text() == render(), "run: python -m tests.compose.test_matrix --write"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        DOCS.write_text(render())
        print(f"wrote {DOCS}")
    else:
        print(render())
