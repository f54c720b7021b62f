"""The differential tester's own checks: a difference, an error and a hang planted in fsdp2's run
are each reported (so a passing program means the runs agreed), the 2.15 oracle of manual
finalization accepts what PyTorch 2.15 does, and a program prints as Python that rebuilds it."""

from __future__ import annotations

import time

import torch
from hypothesis import HealthCheck, given, settings

from tests.fuzz import generate, runner
from tests.fuzz.check import outcome, run_once
from tests.fuzz.program import (
    Backward,
    Block,
    Checkpoint,
    ClipGradNorm,
    FinalizeBackward,
    Forward,
    Model,
    OptimizerStep,
    Program,
    Setter,
    StateDict,
    Wrap,
    ZeroGrad,
    format_program,
)

TRAINING = Program(
    model=Model(blocks=(Block(wrap=Wrap()), Block(kind="mlp", norm="layer"))),
    calls=(
        Forward(),
        Backward(),
        ClipGradNorm(),
        OptimizerStep(),
        ZeroGrad(),
        StateDict(),
        Forward(batch=1),
        Backward(),
        OptimizerStep(),
        Checkpoint(),
        ZeroGrad(set_to_none=False),
        Forward(batch=2),
        Backward(),
        OptimizerStep(),
        StateDict(load=True),
        Checkpoint(load=True),
    ),
)


def _with_planted(plant, rank, ws, program, status_dir, patience):
    """``runner.run_program`` with ``plant(ctx, run, index, call)`` run after each of fsdp2's calls."""
    original = runner.execute

    def execute(ctx, run, index, call):
        result = original(ctx, run, index, call)
        if run.name == "fsdp2":
            plant(ctx, run, index, call)
        return result

    runner.execute = execute
    try:
        return runner.run_program(rank, ws, program, status_dir, patience)
    finally:
        runner.execute = original


def _nudge_a_gradient(ctx, run, index, call):
    if isinstance(call, Backward) and index == 7:
        grad = run.params[0].grad.to_local()
        grad.view(-1)[0] = torch.nextafter(grad.view(-1)[0], torch.tensor(float("inf")))


def _raise_at_a_step(ctx, run, index, call):
    if isinstance(call, OptimizerStep) and index == 8:
        raise ValueError("planted")


def _skip_nothing_but_add_a_collective(ctx, run, index, call):
    if isinstance(call, Forward) and index == 6 and ctx.rank == 0:
        torch.distributed.all_reduce(torch.ones(1), group=ctx.meshes.dp.get_group())


def planted_difference(rank, ws, program, status_dir, patience):
    return _with_planted(_nudge_a_gradient, rank, ws, program, status_dir, patience)


def planted_error(rank, ws, program, status_dir, patience):
    return _with_planted(_raise_at_a_step, rank, ws, program, status_dir, patience)


def planted_hang(rank, ws, program, status_dir, patience):
    return _with_planted(_skip_nothing_but_add_a_collective, rank, ws, program, status_dir, patience)


def test_a_training_program_passes(worlds):
    result = outcome(worlds, TRAINING)
    assert (result.status, result.calls_run) == ("passed", len(TRAINING.calls)), result.detail


def test_a_gradient_one_ulp_off_is_reported(worlds):
    result = outcome(worlds, TRAINING, planted_difference)
    assert (result.status, result.call) == ("differs", 7), result.detail
    assert "emb.weight.grad: differs by up to" in result.detail, result.detail


def test_an_error_only_fsdp2_raises_is_reported(worlds):
    result = outcome(worlds, TRAINING, planted_error)
    assert (result.status, result.call) == ("differs", 8), result.detail
    assert "fsdp2 raised on rank 0, torch did not" in result.detail and "planted" in result.detail


def test_a_hang_is_reported_within_seconds(worlds):
    start = time.monotonic()
    result = run_once(worlds, TRAINING, planted_hang)  # (outcome() confirms it with longer timeouts)
    assert (result.status, result.call) == ("hang", 6), result.detail
    assert "fsdp2 on rank 0 hung" in result.detail, result.detail
    assert time.monotonic() - start < runner.HANG_S + 30


def test_manual_finalization_is_compared_with_what_pytorch_2_15_does(worlds):
    """A backward without sync that finalize_backward() completes with sync on: no gradient before
    the finalize, then PyTorch's (on torch < 2.15 its automatic finalization of the same sums)."""
    program = Program(
        model=Model(blocks=(Block(wrap=Wrap()),)),
        calls=(
            Setter("set_manual_backward_finalization", True),
            Setter("set_requires_gradient_sync", False),
            Forward(),
            Backward(),
            Forward(batch=1),
            Backward(),
            Setter("set_requires_gradient_sync", True),
            FinalizeBackward(),
            OptimizerStep(),
        ),
    )
    result = outcome(worlds, program)
    assert (result.status, result.calls_run) == ("passed", len(program.calls)), result.detail


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(generate.programs(compiled=None))
def test_a_program_prints_as_python_that_rebuilds_it(program):
    from tests.fuzz import program as module

    assert eval(format_program(program), vars(module)) == program
    assert "assert_program_passes(worlds, program)" in program.as_pytest()


def test_a_refusal_of_fsdp2_is_its_eager_twins_and_does_not_hide_a_compiled_difference():
    """A compiled program runs fsdp2 twice (compiled, and the same calls eager): a deliberate
    refusal is deliberate in both, and one the eager twin raises where the compiled run does not
    is reported, not taken for the refusal between PyTorch and the eager twin."""
    program = Program(model=Model(blocks=(Block(),)), calls=(FinalizeBackward(),))
    call = program.calls[0]
    refusal = "FSDPUsageRuntimeError: M.finalize_backward: fully_shard(M) keeps HSDP sums for a later all-reduce"
    names = ["torch", "fsdp2-eager", "fsdp2"]

    def judge(eager_error, compiled_error):
        raised = {"torch": [None], "fsdp2-eager": [eager_error], "fsdp2": [compiled_error]}
        return runner._judge_errors(program, 0, call, "call 0", names, raised)

    assert judge(refusal, refusal).status == "refused"
    result = judge(refusal, None)
    assert result.status == "differs" and "fsdp2-eager raised on rank 0, fsdp2 did not" in result.detail
    assert judge("ValueError: planted", "ValueError: planted").status == "differs"


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(generate.programs(compiled=None))
def test_no_clip_grad_norm_while_ranks_may_hold_different_gradients(program):
    """After ``zero_grad(set_to_none=True)`` on some ranks only, which parameters have a gradient
    may differ across ranks (PyTorch's ``clip_grad_norm_`` then issues different collectives and
    gloo aborts): no clipping until every rank sets them to None again."""
    differ = False
    for call in program.calls:
        if isinstance(call, ZeroGrad) and call.set_to_none:
            differ = call.ranks is not None
        assert not (differ and isinstance(call, ClipGradNorm)), format_program(program)
