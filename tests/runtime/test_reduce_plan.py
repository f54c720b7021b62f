"""Gradient reduction ops: fsdp2 passes the reduce ops and divisions PyTorch's FSDP2 passes.

On NCCL, AVG and PREMUL_SUM scale each rank's input inside the collective, so a SUM followed by a
division rounds differently: which op is passed is part of the result. There is no NCCL here, so
both frameworks train side by side on gloo under a recorder that stands in for NCCL: it logs every
reduce-scatter and all-reduce (op and scale) and every division by a scalar, and computes
PREMUL_SUM (which gloo lacks) as NCCL does, scaling the input before a gloo SUM. Per
configuration the logs must be equal, and the parameters bitwise equal.
"""

from __future__ import annotations

import collections
from unittest import mock
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp2 import compat
from fsdp2.models import GPT
from fsdp2.runtime import collectives
from fsdp2.runtime.reduce_plan import AVG, SUM, ReducePlan, ReduceOp
from tests.support.models import CFG
from tests.support.parity import assert_same_params, side_by_side_step
from tests.support.user_collectives import RecordingReduceScatter, describe_op, premul_factor


class _Divisions(TorchDispatchMode):
    """Counts divisions by a scalar, by divisor (the model's own are the same on both sides)."""

    DIVS = {"div", "div_"}

    def __init__(self, log: collections.Counter):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.DIVS and len(args) > 1:
            divisor = args[1]
            if isinstance(divisor, torch.Tensor) and divisor.dim() == 0:
                divisor = divisor.item()
            if isinstance(divisor, (int, float)):
                self.log[float(divisor)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _as_nccl(log: list):
    """Log the gradient collectives' ops into ``log``; compute PREMUL_SUM as NCCL would."""
    names = [n for n in ("reduce_scatter_tensor", "reduce_scatter_single") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}
    real_all_reduce, ours_reduce_scatter = dist.all_reduce, collectives._reduce_scatter
    ours_premul = collectives.supports_premul_sum

    def emulated(real, kind):
        def collective(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            log.append((kind, *describe_op(op)))
            if premul_factor(op) is not None:
                input, op = input * premul_factor(op), dist.ReduceOp.SUM
            return real(output, input, op=op, group=group, async_op=async_op)

        return collective

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        log.append(("all_reduce", *describe_op(op)))
        if premul_factor(op) is not None:
            tensor.mul_(premul_factor(op))
            op = dist.ReduceOp.SUM
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    for name, real in originals.items():
        setattr(dist, name, emulated(real, "reduce_scatter"))
    collectives._reduce_scatter = emulated(ours_reduce_scatter, "reduce_scatter")
    collectives.supports_premul_sum = lambda group: True  # the recorder is NCCL
    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        for name, real in originals.items():
            setattr(dist, name, real)
        collectives._reduce_scatter, collectives.supports_premul_sum = ours_reduce_scatter, ours_premul
        dist.all_reduce = real_all_reduce


def _mesh(hsdp: bool):
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        return init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _side_by_side(rank, ws, **settings):
    # The recorder is NCCL from the start: fsdp2 decides its reduce ops when a setting changes.
    with mock.patch.object(collectives, "supports_premul_sum", lambda group: True):
        return _side_by_side_on_nccl(rank, ws, **settings)


def _side_by_side_on_nccl(rank, ws, reduce_dtype=None, hsdp=False, factor=None, force_sum=False, hook=False):
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp2 import fully_shard

    mesh = _mesh(hsdp)
    mp = torch_fsdp.MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    torch.manual_seed(0)
    base = GPT(CFG)
    models, logs, seen = [], [], []
    for shard in (torch_fully_shard, fully_shard):
        model = copy.deepcopy(base)
        for block in model.blocks:
            shard(block, mesh=mesh, mp_policy=mp)
        shard(model, mesh=mesh, mp_policy=mp)
        # On the root only: neither setting is recursive in PyTorch.
        if factor is not None:
            model.set_gradient_divide_factor(factor)
        if force_sum:
            model.set_force_sum_reduction_for_comms(True)
        hooked: list = []
        if hook:
            model.set_all_reduce_hook(lambda output, hooked=hooked: hooked.append(output.clone()))
        models.append(model)
        logs.append(([], collections.Counter()))
        seen.append(hooked)
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in models]
    for step in range(2):
        for model, opt, (ops, divisions) in zip(models, optimizers, logs):
            with _as_nccl(ops), _Divisions(divisions):
                side_by_side_step(model, opt, step, rank, ws)
    # Per kind in issue order (fsdp2 issues a group's reduce-scatters before its all-reduces).
    (their_ops, their_divisions), (our_ops, our_divisions) = [(sorted(o, key=lambda e: e[0]), d) for o, d in logs]
    assert our_ops == their_ops, f"reduce ops: PyTorch {their_ops}, fsdp2 {our_ops}"
    assert our_divisions == their_divisions, f"divisions: PyTorch {their_divisions}, fsdp2 {our_divisions}"
    assert len(seen[0]) == len(seen[1]) and all(torch.equal(a, b) for a, b in zip(*seen)), "the hook saw other values"
    assert_same_params(*models)
    return their_ops


CASES = {
    # name: (world size, settings, PyTorch's reduce-scatter op in the blocks (no custom factor there))
    "fp32": (2, {}, ("avg",)),
    "bf16": (2, {"reduce_dtype": torch.bfloat16}, ("avg",)),
    "fp16": (4, {"reduce_dtype": torch.float16}, ("sum",)),
    "world1": (1, {}, None),
    "hsdp": (4, {"hsdp": True}, ("avg",)),
    "factor": (2, {"factor": 3.0}, ("avg",)),
    "factor_is_shard_size": (2, {"factor": 2.0}, ("avg",)),
    "hsdp_factor": (4, {"hsdp": True, "factor": 3.0}, ("avg",)),
    "force_sum_hook": (2, {"force_sum": True, "hook": True}, ("avg",)),
    "force_sum_factor": (2, {"force_sum": True, "factor": 3.0}, ("avg",)),
    "fp16_factor": (2, {"reduce_dtype": torch.float16, "factor": 3.0}, ("sum",)),
    # One rank: PyTorch's FSDP2 divides by the factor in place of the skipped reduce-scatter, on
    # top of its planned divisions (twice in all with fp16 or force-sum); fsdp2 does the same.
    "world1_factor": (1, {"factor": 3.0}, None),
    "world1_fp16_factor": (1, {"reduce_dtype": torch.float16, "factor": 3.0}, None),
    "world1_force_sum_factor": (1, {"force_sum": True, "factor": 3.0}, None),
}


# Cases where PyTorch's FSDP2 passes PREMUL_SUM: the recorder must read its scale back.
PREMUL_SUM_CASES = {"factor", "hsdp_factor"}


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_collectives_use_pytorch_fsdp2s_reduce_ops_and_divisions(worlds, case):
    if case in PREMUL_SUM_CASES and not hasattr(compat.premul_sum_op(0.5), "factor"):
        pytest.skip("torch 2.11's ReduceOp does not expose a PREMUL_SUM's scale, which the recorder needs")
    ws, settings, block_op = CASES[case]
    their_ops = worlds.run(ws, _side_by_side, **settings)[0]
    if block_op is not None:  # the recorder sees what it should
        assert ("reduce_scatter", *block_op) in their_ops, their_ops


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({"reduce_dtype": torch.float32}, ReducePlan(AVG, AVG)),
        ({"reduce_dtype": torch.float32, "shard_size": 1, "replicate_size": 1}, ReducePlan(SUM, SUM)),
        ({"reduce_dtype": torch.float16}, ReducePlan(SUM, SUM, (4.0,), 2.0)),  # 8 ranks: 4 before, 2 after
        ({"reduce_dtype": torch.float32, "force_sum": True}, ReducePlan(SUM, SUM, (), 8.0)),
        ({"reduce_dtype": torch.float32, "divide_factor": 3.0}, ReducePlan(ReduceOp("premul_sum", 1 / 3), SUM)),
        ({"reduce_dtype": torch.float32, "divide_factor": 4.0}, ReducePlan(AVG, SUM)),  # the shard group's size
        (
            {"reduce_dtype": torch.float32, "divide_factor": 3.0, "premul_sum_supported": False},
            ReducePlan(SUM, SUM, (), 3.0),
        ),
        ({"reduce_dtype": torch.float32, "divide_factor": 3.0, "shard_size": 1}, ReducePlan(SUM, SUM, (3.0,))),
        ({"reduce_dtype": torch.bfloat16, "device_type": "mtia"}, ReducePlan(SUM, SUM, (), 8.0)),
        # A factor of 1 at one shard rank: nothing to divide, whatever the dtype or setting.
        ({"reduce_dtype": torch.float32, "divide_factor": 1.0, "shard_size": 1}, ReducePlan(AVG, SUM)),
        ({"reduce_dtype": torch.float16, "divide_factor": 1.0, "shard_size": 1}, ReducePlan(SUM, SUM)),
        (
            {"reduce_dtype": torch.float32, "divide_factor": 1.0, "shard_size": 1, "force_sum": True},
            ReducePlan(SUM, SUM),
        ),
    ],
)
def test_reduce_plan_choices(kwargs, expected):
    """Cases the gloo side-by-side test cannot reach (a backend without PREMUL_SUM is gloo itself there)."""
    settings = {
        "shard_size": 4,
        "replicate_size": 2,
        "divide_factor": None,
        "force_sum": False,
        "premul_sum_supported": True,
    }
    assert ReducePlan.choose(**{**settings, **kwargs}) == expected


def _custom_reduce_scatter_op(rank, ws):
    from fsdp2 import fully_shard

    model = fully_shard(torch.nn.Linear(4, 4), mesh=_mesh(hsdp=False))
    comm = RecordingReduceScatter()
    model.set_custom_reduce_scatter(comm)
    model(torch.ones(2, 4)).sum().backward()
    return comm.ops


def test_custom_reduce_scatter_gets_pytorchs_reduce_op(worlds):
    """PyTorch's FSDP2 passes ``op`` to a custom reduce-scatter; fsdp2 passes the same (AVG here)."""
    assert worlds.run(2, _custom_reduce_scatter_op)[0] == [("avg",)]


def test_the_plan_follows_each_setting_changed_after_it_was_chosen(fake_world):
    """``GroupReduce.plan`` keeps one plan per reduce dtype (a key dynamo reads as a constant) and
    chooses again when any setting it was chosen for is another object: divide factor, forced
    sums, custom reduce-scatter."""
    from fsdp2 import fully_shard

    fake_world(4)
    model = fully_shard(torch.nn.Linear(4, 4))
    reduce = model._fsdp_state.group.reduce

    def chosen(divide_factor=None, force_sum=False, premul=False):
        return ReducePlan.choose(
            shard_size=4,
            replicate_size=1,
            reduce_dtype=torch.float32,
            divide_factor=divide_factor,
            force_sum=force_sum,
            premul_sum_supported=premul,
            device_type="cpu",
        )

    first = reduce.plan(torch.float32)
    assert first == chosen() and reduce.plan(torch.float32) is first  # unchanged settings: the kept plan
    model.set_gradient_divide_factor(8.0)
    assert reduce.plan(torch.float32) == chosen(divide_factor=8.0) != first
    model.set_force_sum_reduction_for_comms(True)
    assert reduce.plan(torch.float32) == chosen(divide_factor=8.0, force_sum=True)
    model.set_force_sum_reduction_for_comms(False)
    model.set_custom_reduce_scatter(RecordingReduceScatter())  # takes PREMUL_SUM, as PyTorch's
    assert reduce.plan(torch.float32) == chosen(divide_factor=8.0, premul=True)


class _AtenDivisions(TorchDispatchMode):
    """Counts every ``aten.div*`` op run inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten" and func.overloadpacket.__name__.startswith("div"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _divisions_in_a_backward_with_factor_one(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2 import fully_shard

    model = fully_shard(torch.nn.Linear(8, 4, bias=False), mesh=init_device_mesh("cpu", (1,)))
    model.set_gradient_divide_factor(1.0)
    loss = model(torch.randn(2, 8)).sum()
    with _AtenDivisions() as divisions:
        loss.backward()
    assert model.weight.grad is not None
    return divisions.count


def test_a_divide_factor_of_one_on_one_rank_runs_no_division(worlds):
    """PyTorch's FSDP2 (2.15) skips dividing by 1 where one rank copies instead of reduce-scattering."""
    assert worlds.run(1, _divisions_in_a_backward_with_factor_one) == [0]
