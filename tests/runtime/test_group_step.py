"""A group's step (fsdp2.runtime.group_step.GroupStep): every setter makes it anew, and both
executors read only it; the compiled graph names a bucket's reduction by one key; the order of
the pieces after a reduce-scatter is decided once for both executors."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

from fsdp2.runtime.group_step import Mode
from fsdp2.runtime.schedule import AfterForward


class _UserComm:
    """A user's collective (PyTorch FSDP2's protocol); never called here."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output, input, group, async_op=False, **kwargs):
        raise AssertionError("not called")


def _sharded(world_size: int, mesh_shape=None):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2 import fully_shard

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    mesh = None if mesh_shape is None else init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _group(module):
    return module.__dict__["_fsdp_state"].group


# setter -> (the call, what the new step says: a predicate of the step before and after)
SETTERS = {
    "set_requires_gradient_sync": (
        lambda m: m.set_requires_gradient_sync(False),
        lambda before, step: step.mode is Mode.UNSYNCED,
    ),
    "set_reduce_scatter_unused_params": (
        lambda m: m.set_reduce_scatter_unused_params(True),
        lambda before, step: step.include_unused,
    ),
    "set_reshard_after_forward": (
        lambda m: m.set_reshard_after_forward(False),
        lambda before, step: (
            step.after_forward is AfterForward.KEEP and step.after_forward_for(is_root=False) is AfterForward.KEEP
        ),
    ),
    "set_custom_all_gather": (
        lambda m: m.set_custom_all_gather(_UserComm()),
        lambda before, step: isinstance(step.gather.custom, _UserComm) and step.gather.custom_key is not None,
    ),
    "set_gradient_divide_factor": (
        lambda m: m.set_gradient_divide_factor(3.0),
        lambda before, step: step.reduce_steps[0].plan != before.reduce_steps[0].plan,
    ),
    "set_force_sum_reduction_for_comms": (
        lambda m: m.set_force_sum_reduction_for_comms(True),
        lambda before, step: step.reduce_steps[0].plan != before.reduce_steps[0].plan,
    ),
    "set_all_reduce_hook": (
        lambda m: m.set_all_reduce_hook(lambda reduced: None),
        lambda before, step: step.reduce_steps[0].hooked,
    ),
    "set_custom_reduce_scatter": (
        lambda m: m.set_custom_reduce_scatter(_UserComm()),
        lambda before, step: step.reduce_steps[0].custom_reduce_scatter is not None,
    ),
}


@pytest.mark.parametrize("setter", sorted(SETTERS))
def test_every_setter_makes_the_groups_step_anew(fake_world, setter):
    """A setter changes a setting and the group's step follows at once (the compiled step reads
    only the step, while dynamo traces, where nothing may be decided); the compiled step's gradient
    sinks follow the new reduce steps."""
    fake_world(2)
    model = _sharded(2)
    group = _group(model[0])
    before = group.step
    change, says = SETTERS[setter]
    assert not says(before, before)
    change(model[0])
    assert says(before, group.step), group.step
    for step in group.step.reduce_steps:
        assert group.sinks.of(step).serves(step)


def test_set_requires_all_reduce_makes_an_hsdp_groups_step_partial(fake_world):
    fake_world(4)
    model = _sharded(4, mesh_shape=(2, 2))
    group = _group(model[0])
    assert group.step.mode is Mode.SYNCED
    model[0].set_requires_all_reduce(False)
    assert group.step.mode is Mode.PARTIAL
    model[0].set_requires_gradient_sync(False)
    assert group.step.mode is Mode.UNSYNCED


def test_a_graphs_reduction_key_names_it_whole(fake_world):
    """``fsdp2::grad_port`` carries one string: the step's digest key, the backward mode and the
    flags the trace adds. It names the reduction whole, for every mode and flag."""
    from fsdp2.runtime.traced_graph import BucketReduction

    fake_world(2)
    spec = _group(_sharded(2)[0]).step.reduce_steps[0].spec
    flags = ("counted", "takes_unsynced", "takes_partial", "include_unused")
    keys = set()
    for mode, values in itertools.product(Mode, itertools.product((False, True), repeat=len(flags))):
        reduction = BucketReduction(spec, mode, **dict(zip(flags, values)))
        assert BucketReduction.named(reduction.key) == reduction
        keys.add(reduction.key)
    assert len(keys) == len(Mode) * 2 ** len(flags)


class _Recorded:
    """A runner of ``ReduceSpec.after_reduce_scatter`` that records the pieces in order."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def piece(at, reduced):
            self.calls.append(name)
            return reduced

        return piece


@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("hsdp, mode", [(False, Mode.SYNCED), (True, Mode.SYNCED), (True, Mode.PARTIAL)])
def test_the_pieces_after_a_reduce_scatter_in_pytorchs_order(fake_world, hsdp, hooked, mode):
    """Both executors run what follows a reduce-scatter through one function: under HSDP the
    partial sums join the all-reduce (a PARTIAL backward, HSDP only, keeps the sum instead), then
    the user's hook and the division; nothing where there is nothing to do (averaging
    reduce-scatter, no hook)."""
    fake_world(4 if hsdp else 2)
    model = _sharded(4 if hsdp else 2, mesh_shape=(2, 2) if hsdp else None)
    if hooked:
        model[0].set_all_reduce_hook(lambda reduced: None)
    spec = _group(model[0]).step.reduce_steps[0].spec
    run = _Recorded()
    spec.after_reduce_scatter(torch.zeros(4), mode, run)
    expected = []
    if hsdp:
        expected = ["keep_partial"] if mode is Mode.PARTIAL else ["add_partial", "all_reduce"]
    if mode is Mode.SYNCED and (hooked or spec.plan.divide_after != 1):
        expected.append("hook_and_divide")
    assert run.calls == expected


def test_set_requires_gradient_sync_decides_little_per_group(fake_world):
    """``set_requires_gradient_sync`` runs at every microbatch of an accumulation, on every group:
    the group's new step reuses what the setting does not change (the reduce steps and the
    compiled step's sinks for them, the after-forward actions), a handful of fsdp2's calls per
    group, not a re-decision of the whole step."""
    from fsdp2 import fully_shard
    from fsdp2.models import GPT, GPTConfig
    from fsdp2.tools.host_work import FSDP_CODE, count_host_work

    fake_world(8)
    calls = {}
    for layers in (2, 10):
        model = GPT(GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=layers, n_heads=2))
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)

        def toggle():
            model.set_requires_gradient_sync(False)
            model.set_requires_gradient_sync(True)

        calls[layers] = count_host_work(toggle, count_ops=False).calls_in(FSDP_CODE)
    per_group_and_call = (calls[10] - calls[2]) / 8 / 2
    assert per_group_and_call <= 8, calls
