"""Resume on another world size with the input pipeline's position:
examples/resume_any_world.py saves on 4 ranks mid-epoch and resumes on 2 and on 3."""

import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS, SAVE_AT = 6, 3  # 6 global batches of 12 cross the 40-sample epoch; the save is mid-epoch


def _train(rank: int, world_size: int, **kwargs) -> dict:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import resume_any_world

    return resume_any_world.train(rank, world_size, **kwargs)


@pytest.fixture(scope="module")
def saved_on_4(worlds, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("elastic") / "ckpt")
    return ckpt, worlds.run(4, _train, steps=STEPS, ckpt=ckpt, save_at=SAVE_AT)[0]


@pytest.mark.parametrize("new_world", [2, 3])
def test_resumed_job_sees_the_samples_an_uninterrupted_one_would(worlds, saved_on_4, new_world):
    ckpt, on_4 = saved_on_4
    uninterrupted = worlds.run(new_world, _train, steps=STEPS)[0]
    resumed = worlds.run(new_world, _train, steps=STEPS, ckpt=ckpt, resume=True)[0]

    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    for step in resumed:
        # The same samples as the uninterrupted runs on 4 and on new_world ranks: none skipped or repeated.
        assert resumed[step]["samples"] == on_4[step]["samples"] == uninterrupted[step]["samples"], step
    consumed = [i for step in sorted(on_4) for i in on_4[step]["samples"]]
    assert sorted(consumed[:40]) == list(range(40)) and len(set(consumed[40:])) == len(consumed[40:])

    # The model and optimizer state came back resharded: the losses follow an uninterrupted run on
    # new_world ranks up to the rounding of gradients reduced over 4 ranks instead of new_world
    # for the first SAVE_AT steps (a lost optimizer state or a skipped batch is off by far more).
    for step in resumed:
        assert resumed[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], rel=1e-5), step
        assert resumed[step]["loss"] == pytest.approx(on_4[step]["loss"], rel=1e-5), step


def test_resume_refuses_a_world_size_the_global_batch_does_not_split_over():
    with pytest.raises(ValueError, match="does not split over 5 ranks"):
        _train(0, 5, steps=STEPS, resume=True)  # checked before any collective or file
