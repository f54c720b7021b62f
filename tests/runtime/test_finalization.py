"""Who ends a backward iteration, and what resharding keeps: PyTorch 2.15's ``FSDPModule`` methods
``set_manual_backward_finalization``, ``finalize_backward(async_op=...)`` and
``set_keep_unsharded_storage``, on every supported torch.

Side by side with PyTorch's FSDP2 (bitwise losses and parameters, equal collective counts): where
the installed release has the methods, both implementations are driven the same way; where it has
not, PyTorch finalizes automatically the same gradients (backwards without sync, the last one
synced), which manual finalization must reproduce. Misuse raises one clear ``FSDPUsageError``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn

from fsdp2.models import GPT
from tests.support.models import CFG
from tests.support.parity import CollectiveCounter, assert_same_params, shard_blocks_then_root, step_batch, twins

MICROBATCHES = 3
PYTORCH_HAS_MANUAL_FINALIZATION = hasattr(torch_fsdp.FSDPModule, "finalize_backward")


def _backwards_then_finalize(model, step, rank, ws, async_op: bool) -> tuple[torch.Tensor, dict]:
    """Microbatch backwards without sync, then one finalization with sync; (summed loss, collectives)."""
    model.set_manual_backward_finalization(True)
    model.set_requires_gradient_sync(False)
    total = torch.zeros(())
    with CollectiveCounter() as comm:
        for micro in range(MICROBATCHES):
            x, y = step_batch(MICROBATCHES * step + micro, rank, ws)
            loss = model.loss(x, y)
            loss.backward()
            total += loss.detach()
        assert all(p.grad is None for p in model.parameters()), "a gradient was reduced before finalize_backward"
        assert not any("reduce_scatter" in name for name in comm.counts), comm.counts
        model.set_requires_gradient_sync(True)
        handle = model.finalize_backward(async_op=async_op)
        if async_op:
            handle.wait()
        else:
            assert handle is None
    assert all(p.grad is not None for p in model.parameters())
    model.set_manual_backward_finalization(False)
    return total, comm.counts


def _backwards_finalized_automatically(model, step, rank, ws) -> tuple[torch.Tensor, dict]:
    """The same gradients on a torch without manual finalization: the last backward syncs."""
    total = torch.zeros(())
    with CollectiveCounter() as comm:
        for micro in range(MICROBATCHES):
            model.set_requires_gradient_sync(micro == MICROBATCHES - 1)
            x, y = step_batch(MICROBATCHES * step + micro, rank, ws)
            loss = model.loss(x, y)
            loss.backward()
            total += loss.detach()
    return total, comm.counts


def _manual_finalization_side_by_side(rank, ws, async_op):
    from fsdp2 import GradientReductionHandle

    theirs, ours = twins(lambda: GPT(CFG), shard_blocks_then_root)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    for step in range(2):
        if PYTORCH_HAS_MANUAL_FINALIZATION:
            their_loss, their_comm = _backwards_then_finalize(theirs, step, rank, ws, async_op)
        else:
            their_loss, their_comm = _backwards_finalized_automatically(theirs, step, rank, ws)
        our_loss, our_comm = _backwards_then_finalize(ours, step, rank, ws, async_op)
        assert torch.equal(their_loss, our_loss), step
        assert their_comm == our_comm, (step, their_comm, our_comm)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        assert_same_params(theirs, ours)
    ours.set_manual_backward_finalization(True)
    handle = ours.finalize_backward(async_op=True)  # nothing left to reduce: a handle all the same
    assert isinstance(handle, GradientReductionHandle)
    if hasattr(torch_fsdp, "GradientReductionHandle"):
        assert isinstance(handle, torch_fsdp.GradientReductionHandle)
    handle.wait()
    ours.set_manual_backward_finalization(False)


@pytest.mark.parametrize("async_op", [False, True], ids=["wait", "async"])
def test_manual_finalization_reduces_what_the_backwards_left_like_pytorch(worlds, async_op):
    worlds.run(2, _manual_finalization_side_by_side, async_op)


def _gradients_reduced_during_backward_complete_at_finalize(rank, ws):
    """Gradient sync on during the backward: groups reduce as their gradients are ready, and the
    iteration still ends at finalize_backward (their results in ``.grad`` by then)."""
    theirs, ours = twins(lambda: GPT(CFG), shard_blocks_then_root)
    x, y = step_batch(0, rank, ws)
    theirs.loss(x, y).backward()
    ours.set_manual_backward_finalization(True)
    ours.loss(x, y).backward()
    ours.finalize_backward()
    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), name


def test_gradients_reduced_during_a_manually_finalized_backward(worlds):
    worlds.run(2, _gradients_reduced_during_backward_complete_at_finalize)


# -- misuse ------------------------------------------------------------------------------------------------


def _sharded_gpt():
    from fsdp2 import fully_shard

    torch.manual_seed(0)
    return shard_blocks_then_root(GPT(CFG), fully_shard)


def _finalization_misuse(rank, ws):
    from fsdp2 import FSDPUsageError

    x, y = step_batch(0, rank, ws)
    model = _sharded_gpt()
    assert model.finalize_backward() is None  # before the first forward: nothing to finalize
    model.finalize_backward(async_op=True).wait()
    with pytest.raises(FSDPUsageError, match=r"expects a bool, got 1"):
        model.set_manual_backward_finalization(1)
    # Set on a module that turns out not to be the root: refused at the first forward.
    model.blocks[0].set_manual_backward_finalization(True)
    with pytest.raises(FSDPUsageError, match=r"fully_shard\(Block\).*not the root.*first module to run forward is GPT"):
        model.loss(x, y)
    model.reset_iter_state()
    model.blocks[0].set_manual_backward_finalization(False)
    model.loss(x, y).backward()
    with pytest.raises(FSDPUsageError, match=r"Block.set_manual_backward_finalization: call it on the root .*\(GPT\)"):
        model.blocks[0].set_manual_backward_finalization(True)
    with pytest.raises(FSDPUsageError, match=r"finalize_backward: backward is finalized automatically"):
        model.finalize_backward()
    model.set_manual_backward_finalization(True)
    with pytest.raises(FSDPUsageError, match=r"Block.finalize_backward: call it on the root"):
        model.blocks[0].finalize_backward()

    # From inside a backward: neither the mode nor the iteration may change there.
    loss = model.loss(x, y)
    raised = []

    def from_backward(grad):
        for call in (lambda: model.set_manual_backward_finalization(False), model.finalize_backward):
            try:
                call()
            except FSDPUsageError as error:
                raised.append(str(error))
        return grad

    loss.register_hook(from_backward)
    loss.backward()
    assert len(raised) == 2, raised
    assert "set_manual_backward_finalization(False): called during backward" in raised[0]
    assert "finalize_backward: called during backward" in raised[1]
    # After the backward, until finalized, the mode stays.
    with pytest.raises(FSDPUsageError, match=r"started under manual finalization has not ended"):
        model.set_manual_backward_finalization(False)
    handle = model.finalize_backward(async_op=True)
    with pytest.raises(FSDPUsageError, match=r"finalize_backward of GPT: the gradient reduction .* still pending"):
        model.finalize_backward()
    with pytest.raises(FSDPUsageError, match=r"the forward of GPT: the gradient reduction .* still pending"):
        model.loss(x, y)
    with pytest.raises(FSDPUsageError, match=r"started under manual finalization has not ended"):
        model.set_manual_backward_finalization(False)
    handle.wait()
    handle.wait()  # once done, again: nothing
    model.set_manual_backward_finalization(False)

    # reset_iter_state abandons a pending reduction: its handle says so.
    model.set_manual_backward_finalization(True)
    model.loss(x, y).backward()
    handle = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    with pytest.raises(FSDPUsageError, match=r"reset_iter_state\(\) abandoned the gradient reduction"):
        handle.wait()
    model.set_manual_backward_finalization(False)  # the iteration was reset: the mode may change
    model.loss(x, y).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_manual_finalization_misuse_is_refused(worlds):
    worlds.run(2, _finalization_misuse)


def _hsdp_sums_kept_for_later(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2 import FSDPUsageError, fully_shard

    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), mesh=mesh)
    model.set_manual_backward_finalization(True)
    model.set_requires_all_reduce(False)
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(FSDPUsageError, match=r"keeps HSDP sums for a later all-reduce.*set_requires_all_reduce"):
        model.finalize_backward()
    model.reset_iter_state()


def test_manual_finalization_refuses_hsdp_sums_kept_for_later(worlds):
    worlds.run(4, _hsdp_sums_kept_for_later)


# -- keeping the unsharded storage ---------------------------------------------------------------------------


def _kept_storage(rank, ws):
    def unsharded_storage(module):
        module.unshard()
        weight = module.lm_head.weight if hasattr(module, "lm_head") else module.attn.qkv.weight
        assert not isinstance(weight, torch.distributed.tensor.DTensor)
        return weight, weight.untyped_storage().data_ptr()

    theirs, ours = twins(lambda: GPT(CFG), shard_blocks_then_root)
    models = [ours] + ([theirs] if hasattr(theirs, "set_keep_unsharded_storage") else [])
    for model in models:
        model.set_keep_unsharded_storage(True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    kept = {}
    for step in range(2):
        for model, opt in zip((theirs, ours), optimizers):
            x, y = step_batch(step, rank, ws)
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
        assert_same_params(theirs, ours)
        for module in (ours, ours.blocks[0]):
            weight, pointer = unsharded_storage(module)
            module.reshard()
            assert weight.untyped_storage().nbytes() > 0, "resharding freed the kept storage"
            assert kept.setdefault(id(module), pointer) == pointer, "the gathered parameter moved"
    # Turned off: the next reshard frees it again (PyTorch's default).
    ours.set_keep_unsharded_storage(False, recurse=False)
    weight, _ = unsharded_storage(ours)
    ours.reshard()
    assert weight.untyped_storage().nbytes() == 0
    weight, _ = unsharded_storage(ours.blocks[0])
    ours.blocks[0].reshard()
    assert weight.untyped_storage().nbytes() > 0  # not recursive: the block still keeps it


def test_keep_unsharded_storage_keeps_the_gathered_memory_and_trains_like_pytorch(worlds):
    worlds.run(2, _kept_storage)


# -- a finalize_backward() forgotten -----------------------------------------------------------------


def _grads(model) -> dict:
    """Each parameter's ``.grad`` as a user reads it: None, a reduced DTensor (its local shard), or
    a plain tensor (a group's unreduced gradient, still registered as the module's parameter)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = None if g is None else ("reduced", g.to_local()) if hasattr(g, "to_local") else ("unreduced", g)
    return out


def _assert_same_grads(theirs: dict, ours: dict, where: str, only_kinds_alike: bool = False) -> None:
    for name in theirs:
        a, b = theirs[name], ours[name]
        if only_kinds_alike and (a is None or b is None or a[0] != b[0]):
            continue
        assert (a is None) == (b is None), (where, name, a is None)
        if a is not None:
            assert a[0] == b[0] and torch.equal(a[1], b[1]), (where, name, a[0], b[0])


def _forgotten_finalize(rank, ws, zero_grad_by):
    theirs, ours = twins(lambda: GPT(CFG), shard_blocks_then_root)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    ours.set_manual_backward_finalization(True)
    if PYTORCH_HAS_MANUAL_FINALIZATION:
        theirs.set_manual_backward_finalization(True)
    elif zero_grad_by == "optimizer":
        # PyTorch 2.15 leaves the root's group (its inputs, tokens, need no gradient) unreduced
        # until finalize_backward(), in its unsharded parameters, which optimizer.zero_grad() does
        # not reach: the same gradients as a root without sync in the first iteration.
        theirs.set_requires_gradient_sync(False, recurse=False)
    x, y = step_batch(0, rank, ws)
    for model in (theirs, ours):
        model.loss(x, y).backward()  # and no finalize_backward()
    _assert_same_grads(_grads(theirs), _grads(ours), "after the first backward", only_kinds_alike=True)
    block_grads = _grads(ours)
    assert all(block_grads[n] is not None and block_grads[n][0] == "reduced" for n in block_grads if "blocks" in n)
    for model, opt in zip((theirs, ours), optimizers):
        (model if zero_grad_by == "module" else opt).zero_grad()
    theirs.set_requires_gradient_sync(True)
    x, y = step_batch(1, rank, ws)
    for model in (theirs, ours):
        model.loss(x, y).backward()
    ours.finalize_backward()
    if PYTORCH_HAS_MANUAL_FINALIZATION:
        theirs.finalize_backward()
    _assert_same_grads(_grads(theirs), _grads(ours), "after the second backward and finalize_backward()")
    for opt in optimizers:
        opt.step()
    assert_same_params(theirs, ours)


@pytest.mark.parametrize("zero_grad_by", ["module", "optimizer"])
def test_a_forgotten_finalize_backward_is_what_pytorch_does(worlds, zero_grad_by):
    """Manual finalization, a synced backward and no finalize_backward(), zero_grad(), the next
    iteration: the groups reduced in the backward have their gradients in ``.grad`` right after it
    (zero_grad() clears them: the next iteration has its batch alone); the root's group, whose
    inputs need no gradient, waits unreduced in its unsharded parameters, which ``module.zero_grad()``
    clears and ``optimizer.zero_grad()`` does not (its gradient joins the next reduction), as in
    PyTorch 2.15's FSDP2 (before 2.15: the same gradients, reproduced without the method)."""
    worlds.run(2, _forgotten_finalize, zero_grad_by)
