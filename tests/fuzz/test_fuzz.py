"""Differential testing against PyTorch's FSDP2: random programs, every rank, every call.

Each program is a model, its wrapping and a training script's calls (tests/fuzz/program.py), drawn
by hypothesis (tests/fuzz/generate.py) and run on fsdp2 and on PyTorch's FSDP2 side by side in the
harness's gloo world (tests/fuzz/runner.py). After every call, on every rank, what a user can
observe (results, losses, parameters, ``.grad`` including None, optimizer state, state dicts,
which calls raised) must be bitwise equal, both must raise (fsdp2 with an ``FSDPUsageError`` naming
the module), or the difference must be a deliberate one listed in tests/fuzz/oracle.py. Compiled
programs are also run by eager fsdp2 and must equal it. A program that hangs fails within
seconds. A failing program is shrunk and printed as a test to paste into test_findings.py.

The fast tier runs fixed programs (a seed each): eager ones on 2 and 4 ranks and a few compiled
ones, leaving out programs with the ingredients of a known unfixed defect
(``oracle.KNOWN_UNFIXED``). The slow tier runs more; ``--hypothesis-profile long`` makes it run
thousands, as ``python -m tests.fuzz`` does.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

from tests.fuzz import generate
from tests.fuzz.fuzzer import Fuzzer

# Programs per run of the fast tier: about a minute and a half on 2 cores, with the compiled ones.
EAGER_PROGRAMS = 60
COMPILED_PROGRAMS = 2
SLOW_PROGRAMS = 60
SHRINK_SECONDS = 120


def _search(worlds, strategy, programs: int, seed: int) -> None:
    fuzzer = Fuzzer(worlds, shrink_seconds=SHRINK_SECONDS, skip_known=True)
    finding = fuzzer.search(strategy, programs, seed)
    assert finding is None, finding.report
    assert fuzzer.runs > 0, "every program was left out"


def test_random_eager_programs_agree_with_pytorch(worlds):
    _search(worlds, generate.programs(compiled=False), EAGER_PROGRAMS, seed=1)


def test_random_compiled_programs_agree_with_eager_and_pytorch(worlds):
    _search(worlds, generate.programs(world_sizes=(2,), compiled=True, max_steps=2), COMPILED_PROGRAMS, seed=2)


@pytest.mark.slow
def test_many_random_programs(worlds):
    """More programs, a tenth of them compiled: ``SLOW_PROGRAMS``, or under a hypothesis profile
    that asks for more examples than hypothesis' default (``--hypothesis-profile long``: 2000), that
    many."""
    asked = settings().max_examples
    _search(worlds, generate.programs(compiled=None), asked if asked > 100 else SLOW_PROGRAMS, seed=3)
