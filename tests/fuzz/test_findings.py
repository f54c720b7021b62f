"""Programs the differential tester found failing, shrunk, each kept as a regression test.

Each test is the program the tester printed; while its defect is unfixed it is a strict xfail
whose reason says what goes wrong, and ``oracle.KNOWN_UNFIXED`` holds the defect's ingredients so
the fast tier leaves out programs that have them. Fixing a defect: delete the xfail here and the
entry there.
"""

from __future__ import annotations

import pytest
import torch.distributed.fsdp as torch_fsdp

from tests.fuzz.check import assert_program_passes
from tests.fuzz.program import (
    Backward,
    Block,
    FinalizeBackward,
    Forward,
    Model,
    OptimizerStep,
    Program,
    Setter,
    Wrap,
    ZeroGrad,
)

PYTORCH_2_15 = hasattr(torch_fsdp.FSDPModule, "finalize_backward")  # its FSDP2's newest method


def test_a_group_unused_on_one_rank_is_reduced_like_pytorch(worlds):
    program = Program(
        model=Model(blocks=(Block(wrap=Wrap()), Block(kind="gated", wrap=Wrap()))),
        calls=(
            Setter(method="set_reduce_scatter_unused_params", value=True),
            Forward(closed=(("blocks.1", (1,)),)),
            Backward(),
            OptimizerStep(),
        ),
    )
    assert_program_passes(worlds, program)


def test_a_group_unused_on_every_rank_gets_zero_gradients_like_pytorch(worlds):
    program = Program(
        model=Model(blocks=(Block(kind="gated", wrap=Wrap()),)),
        calls=(
            Setter(method="set_reduce_scatter_unused_params", value=True),
            Forward(closed=(("blocks.0", (0, 1)),)),
            Backward(),
            OptimizerStep(),
        ),
    )
    assert_program_passes(worlds, program)


def test_a_group_not_run_in_a_step_gets_zero_gradients_like_pytorch(worlds):
    program = Program(
        model=Model(
            dim=4,
            vocab=5,
            input="linear",
            blocks=(Block(bias=False, wrap=Wrap()), Block(bias=False, wrap=Wrap()), Block(bias=False, wrap=Wrap())),
            head_bias=False,
        ),
        calls=(
            Setter(method="set_reduce_scatter_unused_params", value=True),
            Forward(),
            Backward(),
            OptimizerStep(),
            ZeroGrad(),
            Forward(batch=1, bypassed=("blocks.2",)),
            Backward(),
            OptimizerStep(),
            ZeroGrad(),
        ),
    )
    assert_program_passes(worlds, program)


@pytest.mark.skipif(not PYTORCH_2_15, reason="the oracle: PyTorch 2.15's FSDP2 manual finalization")
def test_a_synced_backward_under_manual_finalization_writes_gradients_like_pytorch_2_15(worlds):
    program = Program(
        model=Model(dim=4, vocab=5, input="linear", blocks=(Block(bias=False, wrap=Wrap()),), head_bias=False),
        calls=(
            Setter(method="set_manual_backward_finalization", value=True),
            Forward(),
            Backward(),
            FinalizeBackward(),
            OptimizerStep(),
            ZeroGrad(),
        ),
    )
    assert_program_passes(worlds, program)


def test_integer_reshard_after_forward_on_an_unflattened_mesh(worlds):
    program = Program(
        model=Model(world_size=4, mesh="unflattened-slice", blocks=(Block(kind="linear", wrap=Wrap(reshard=2)),)),
        calls=(Forward(), Backward()),
    )
    assert_program_passes(worlds, program)


def test_integer_reshard_after_forward_trains_like_pytorch(worlds):
    program = Program(
        model=Model(
            world_size=4,
            dim=4,
            vocab=5,
            input="linear",
            blocks=(Block(bias=False, wrap=Wrap()),),
            head_bias=False,
            root=Wrap(reshard=2),
        ),
        calls=(Forward(), Backward(), OptimizerStep()),
    )
    assert_program_passes(worlds, program)


def test_gradient_sync_on_turns_the_hsdp_all_reduce_on_like_pytorch(worlds):
    program = Program(
        model=Model(mesh="hsdp", blocks=(Block(wrap=Wrap()),)),
        calls=(
            Setter(method="set_requires_all_reduce", value=False),
            Forward(),
            Backward(),
            Setter(method="set_requires_gradient_sync", value=True),
            Forward(batch=1),
            Backward(),
            OptimizerStep(),
        ),
    )
    assert_program_passes(worlds, program)


def test_uses_of_a_parameter_add_up_like_pytorch_with_a_narrower_reduce_dtype(worlds):
    program = Program(
        model=Model(
            blocks=(Block(kind="mlp", bias=False, twice=True, wrap=Wrap(mp="fp32-params-fp16-reduce")),),
            root=Wrap(mp="fp32-params-fp16-reduce"),
        ),
        calls=(Forward(), Backward()),
    )
    assert_program_passes(worlds, program)


# -- the compiled whole step (a trace each: slow) -------------------------------------------------------------


@pytest.mark.slow
def test_compiled_microbatches_then_finalize_backward(worlds):
    program = Program(
        model=Model(blocks=(Block(wrap=Wrap()),)),
        calls=(
            Setter(method="set_manual_backward_finalization", value=True),
            Setter(method="set_requires_gradient_sync", value=False),
            Forward(compiled=True),
            Backward(),
            Forward(batch=1, compiled=True),
            Backward(),
            Setter(method="set_requires_gradient_sync", value=True),
            FinalizeBackward(),
            OptimizerStep(),
        ),
    )
    assert_program_passes(worlds, program)


@pytest.mark.slow
def test_compiled_synced_backward_after_an_eager_microbatch(worlds):
    program = Program(
        model=Model(blocks=(Block(wrap=Wrap()), Block(wrap=Wrap()))),
        calls=(
            Setter(method="set_requires_gradient_sync", value=False),
            Forward(),
            Backward(),
            Setter(method="set_requires_gradient_sync", value=True),
            Forward(batch=1, compiled=True, bypassed=("blocks.1",)),
            Backward(),
            OptimizerStep(),
            ZeroGrad(),
            Forward(batch=2, compiled=True),
            Backward(),
            OptimizerStep(),
        ),
    )
    assert_program_passes(worlds, program)


@pytest.mark.slow
def test_compiled_step_reducing_in_fp16(worlds):
    program = Program(
        model=Model(blocks=(Block(wrap=Wrap(mp="fp16")),), root=Wrap(mp="fp16")),
        calls=(Forward(compiled=True), Backward(), OptimizerStep()),
    )
    assert_program_passes(worlds, program)


@pytest.mark.slow
def test_compiled_bf16_forward_with_a_row_per_rank_equals_eager(worlds):
    program = Program(
        model=Model(
            world_size=4,
            dim=4,
            vocab=5,
            input="linear",
            blocks=(Block(bias=False),),
            head_bias=False,
            root=Wrap(mp="bf16"),
        ),
        calls=(Forward(compiled=True), Backward()),
    )
    assert_program_passes(worlds, program)


@pytest.mark.slow
@pytest.mark.skipif(not PYTORCH_2_15, reason="the oracle: PyTorch 2.15's FSDP2 manual finalization")
def test_compiled_synced_backward_under_manual_finalization_equals_eager_once_finalized(worlds):
    program = Program(
        model=Model(dim=4, vocab=5, input="linear", blocks=(Block(bias=False, wrap=Wrap()),)),
        calls=(
            Setter(method="set_manual_backward_finalization", value=True),
            Forward(compiled=True),
            Backward(),
            FinalizeBackward(),
            OptimizerStep(),
            ZeroGrad(),
        ),
    )
    assert_program_passes(worlds, program)


@pytest.mark.slow
def test_a_compiled_and_an_eager_forward_before_one_backward_differ_by_rounding_only(worlds):
    program = Program(
        model=Model(
            dim=4,
            vocab=5,
            input="linear",
            blocks=(Block(kind="experts", wrap=Wrap(mp="bf16")), Block()),
            head_bias=False,
        ),
        calls=(
            Forward(compiled=True),
            Backward(),
            Forward(batch=1, compiled=True, closed=(("blocks.0", (0, 1)),), bypassed=("blocks.0",)),
            Forward(batch=2),
            Backward(),
            Setter(method="set_requires_gradient_sync", value=False),
            Forward(batch=3, compiled=True, bypassed=("blocks.0",)),
            Backward(),
            OptimizerStep(),
        ),
        optimizer="sgd",
    )
    assert_program_passes(worlds, program)


@pytest.mark.slow
def test_a_group_unused_in_its_first_compiled_step_gets_zero_gradients_like_eager(worlds):
    program = Program(
        model=Model(
            dim=4,
            vocab=5,
            input="linear",
            blocks=(
                Block(
                    kind="nested",
                    children=(Block(kind="gated", bias=False, wrap=Wrap()), Block(kind="gated", wrap=Wrap(mp="bf16"))),
                ),
            ),
        ),
        calls=(
            Setter(method="set_reduce_scatter_unused_params", value=True),
            Forward(compiled=True, closed=(("blocks.0.inner.0", (0, 1)),)),
            Backward(),
            Setter(method="set_requires_gradient_sync", value=False),
            Forward(batch=1, compiled=True),
            Backward(),
            OptimizerStep(),
        ),
        optimizer="sgd",
    )
    assert_program_passes(worlds, program)


@pytest.mark.slow
def test_compiled_step_with_parameters_unused_on_some_ranks(worlds):
    program = Program(
        model=Model(
            world_size=4,
            mesh="hsdp",
            input="linear",
            blocks=(
                Block(
                    kind="nested",
                    wrap=Wrap(reshard=True),
                    children=(Block(kind="gated", wrap=Wrap()), Block(bias=False)),
                ),
            ),
        ),
        calls=(
            Setter(method="set_reduce_scatter_unused_params", value=True),
            Forward(compiled=True),
            Backward(),
            Setter(method="set_requires_gradient_sync", value=False),
            Forward(batch=1, compiled=True, closed=(("blocks.0.inner.0", (0, 1, 2)),)),
            Forward(batch=2, compiled=True),
            Backward(),
            OptimizerStep(),
        ),
        optimizer="sgd",
    )
    assert_program_passes(worlds, program)


@pytest.mark.slow
def test_kept_sums_in_a_narrower_reduce_dtype_join_a_compiled_synced_backward_as_eager_adds_them(worlds):
    """fp32 parameters reduced in fp16, a microbatch without sync, then a synced compiled backward:
    eager adds its fp32 gradient to the fp16 sum in fp32 and rounds once; the graph cast its
    gradient to fp16 first (two roundings, fp16 ulps apart)."""
    program = Program(
        model=Model(
            dim=4,
            vocab=5,
            input="linear",
            blocks=(Block(wrap=Wrap(mp="fp32-params-fp16-reduce")),),
            head_bias=False,
            root=Wrap(mp="fp32-params-fp16-reduce"),
        ),
        calls=(
            Forward(compiled=True),
            Backward(),
            Setter(method="set_requires_gradient_sync", value=False),
            Forward(batch=1, compiled=True),
            Backward(),
            Setter(method="set_requires_gradient_sync", value=True),
            Forward(batch=2, compiled=True),
            Backward(),
            OptimizerStep(),
            ZeroGrad(),
        ),
    )
    assert_program_passes(worlds, program)
