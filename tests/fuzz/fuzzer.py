"""Drawing programs with hypothesis, running them, shrinking a failing one within a time budget.

``Fuzzer.search`` runs up to ``programs`` programs drawn from ``strategy`` (seeded, so a seed names
a fixed list of programs); the first failing program is shrunk by hypothesis (each candidate is
run on the world: a hang costs its timeout per candidate, so shrinking stops after
``shrink_seconds``, keeping the smallest failing program found by then) and comes back as a
``Finding`` with the program printed as a test to paste.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from tests.fuzz import oracle
from tests.fuzz.check import FAILING, outcome, report
from tests.fuzz.program import Program
from tests.fuzz.runner import Outcome


class ProgramFailed(AssertionError):
    """A program whose fsdp2 runs differ from their oracle, hang or crash."""


@dataclass
class Finding:
    program: Program
    outcome: Outcome
    report: str
    found_after_s: float  # from the start of the search to the first failing program
    programs_before: int  # programs run before it (the failing one excluded)
    shrunk_in_s: float


@dataclass
class Fuzzer:
    worlds: object
    shrink_seconds: float = 120.0
    skip_known: bool = False  # leave out programs with a known unfixed defect's ingredients
    log: object = None  # print-like, one line per program
    runs: int = 0
    seconds: float = 0.0
    statuses: dict = field(default_factory=dict)
    skipped_known: int = 0
    _cache: dict = field(default_factory=dict)

    def run(self, program: Program) -> Outcome:
        if program not in self._cache:
            start = time.monotonic()
            result = outcome(self.worlds, program)
            self.seconds += time.monotonic() - start
            self.runs += 1
            self.statuses[result.status] = self.statuses.get(result.status, 0) + 1
            self._cache[program] = result
            if self.log:
                self.log(f"program {self.runs}: {result.status} ({len(program.calls)} calls, {result.seconds:.1f} s)")
                if result.status == "broken":  # the tester's or the generator's fault: show it
                    self.log(report(program, result))
        return self._cache[program]

    def search(self, strategy, programs: int, seed: int, known_signatures=()) -> Finding | None:
        """Up to ``programs`` programs of ``strategy`` from ``seed``; the first failure, shrunk.
        Failures with one of ``known_signatures`` (findings already made) count as passing."""
        start = time.monotonic()
        state = {"first": None, "count": 0, "best": None}

        def check(program: Program) -> None:
            if self.skip_known and oracle.known_defects(program):
                self.skipped_known += 1
                return
            if state["first"] is None:
                state["count"] += 1
            elif time.monotonic() - state["first"] > self.shrink_seconds:
                # Out of shrinking time: only programs already seen failing fail again.
                cached = self._cache.get(program)
                if cached is None or cached.status not in FAILING:
                    return
            result = self.run(program)
            if result.status in FAILING and signature(program, result) not in known_signatures:
                if state["first"] is None:
                    state["first"] = time.monotonic()
                    state["found_after"] = state["first"] - start
                if state["best"] is None or _size(program) <= _size(state["best"]):
                    state["best"] = program
                raise ProgramFailed(report(program, result))

        test = settings(
            max_examples=programs,
            deadline=None,
            database=None,
            derandomize=False,
            phases=[Phase.generate, Phase.shrink],
            report_multiple_bugs=False,
            suppress_health_check=list(HealthCheck),
            print_blob=False,
        )(given(strategy)(check))
        test = hypothesis_seed(seed)(test)
        try:
            test()
        except Exception:
            if state["first"] is None:  # not a program's failure: the tester's
                raise
        if state["first"] is None:
            return None
        best = state["best"]
        result = self._cache[best]
        return Finding(
            program=best,
            outcome=result,
            report=report(best, result),
            found_after_s=state["found_after"],
            programs_before=state["count"] - 1,
            shrunk_in_s=time.monotonic() - state["first"],
        )


def _size(program: Program) -> tuple[int, int]:
    return (len(program.calls), len(repr(program)))


def signature(program: Program, result: Outcome) -> tuple:
    """What kind of failure: its status, the type of call it happened at, what differed (a
    gradient None against a tensor, a small or a large difference in values, another layout) or
    which error where, and the modes the program ran in."""
    lines = result.detail.splitlines()
    head = lines[0] if lines else ""
    call = type(program.calls[result.call]).__name__ if 0 <= result.call < len(program.calls) else "setup"
    if result.status in ("hang", "crash"):
        what = ""
    elif "raised" in head:
        where = next((line.strip() for line in lines if line.strip().startswith("at ")), "")
        what = (lines[1].split(":")[0] if len(lines) > 1 else "") + " " + where
    else:
        what = lines[1] if len(lines) > 1 else ""
        small = re.search(r"differs by up to ([\d.e+-]+)", what)
        if small:
            what = "values differ by rounding" if float(small.group(1)) < 1e-6 else "values differ"
        elif " in the oracle, " in what:
            what = re.sub(r"^.*?: ([^:]*)$", r"\1", what)
            what = re.sub(r"\d+", "N", what)
    modes = sorted(
        m for m in ("set_manual_backward_finalization(True)", "compiled forward") if m in oracle.ingredients(program)
    )
    return (result.status, call, what, tuple(modes))
