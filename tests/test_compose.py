"""Features combined: eager and compiled steps on one model, step settings between steps.

Each case is equal to PyTorch's FSDP2 (bitwise), or, where PyTorch cannot run it, to eager
fsdp2 / the unsharded model within the tolerance stated at the case, or it is refused at the
call that would diverge with an ``FSDPUsageError`` naming what to do.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from tests.test_dropin import CFG, _assert_same_params, _batch, _full, _shard_blocks_then_root, _twins
from fsdp2.models import GPT


def _grads(model):
    return {name: None if p.grad is None else _full(p.grad) for name, p in model.named_parameters()}


# -- set_is_last_backward(False): gradients written as PyTorch writes them ----------------------------


def _not_last_backward(rank, ws):
    theirs, ours = _twins(lambda: GPT(CFG), _shard_blocks_then_root)
    for model in (theirs, ours):
        model.set_is_last_backward(False)
        model.loss(*_batch(0, rank, ws)).backward()
    their_grads, our_grads = _grads(theirs), _grads(ours)
    for name, grad in their_grads.items():
        assert (grad is None) == (our_grads[name] is None), name
        if grad is not None:
            assert torch.equal(grad, our_grads[name]), name
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    for opt in opts:
        opt.step()
    _assert_same_params(theirs, ours)


def test_not_last_backward_writes_gradients_like_pytorch(worlds):
    worlds.run(2, _not_last_backward)
