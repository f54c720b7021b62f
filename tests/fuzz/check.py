"""Running programs on the harness's worlds and judging them: ``outcome`` runs one program,
``assert_program_passes`` fails a test with the program printed as a test to paste."""

from __future__ import annotations

import os
import re
import tempfile
import time

from tests.fuzz import oracle
from tests.fuzz.program import Program, format_program
from tests.fuzz.runner import COMPILED_HANG_S, HANG_S, Outcome, run_program
from tests.harness import RankFailure

FAILING = ("differs", "hang", "crash")


# A hang is confirmed by running the program again with timeouts this many times longer (on a busy
# machine a rank may still be tracing a compiled call when its partner's collective times out).
CONFIRM_PATIENCE = 4


def call_timeout(program: Program, patience: float = 1) -> float:
    """The harness's limit for one program: well past the hang timeouts of all its calls."""
    per_call = (COMPILED_HANG_S if program.compiled else HANG_S) * patience
    return 60 + 3 * per_call + 2 * len(program.calls)


def outcome(worlds, program: Program, entry=run_program) -> Outcome:
    """Run ``program`` (through ``entry``: ``run_program`` or a stand-in with its signature); a hang
    counts only if the program hangs again with ``CONFIRM_PATIENCE`` times the timeouts."""
    result = run_once(worlds, program, entry, 1)
    if result.status == "hang":
        again = run_once(worlds, program, entry, CONFIRM_PATIENCE)
        again.seconds += result.seconds
        return again
    return result


def run_once(worlds, program: Program, entry=run_program, patience: float = 1) -> Outcome:
    """One run of ``program``, its hang timeouts times ``patience``."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fsdp2-fuzz-status-") as status_dir:
        try:
            result = worlds.run(
                program.world_size,
                entry,
                program,
                status_dir,
                patience,
                timeout=call_timeout(program, patience),
            )[0]
        except RankFailure as failure:  # the harness has replaced the world
            return _failed(program, str(failure), status_dir, time.monotonic() - start)
    if result.desynced:
        worlds.discard(program.world_size)
    return result


def _failed(program: Program, text: str, status_dir: str, seconds: float) -> Outcome:
    """A program no rank finished: where each rank was, and how it failed."""
    where = []
    for rank in range(program.world_size):
        path = os.path.join(status_dir, f"rank{rank}")
        note = open(path).read() if os.path.exists(path) else "not started"
        where.append(f"rank {rank} was in {note}")
    died = re.findall(r"rank (\d+): process died \(exit code (-?\d+)\)", text)
    if died:
        status = "crash"
        cause = "; ".join(f"rank {r} died (exit code {code})" for r, code in died)
        if any(code == "-6" for _, code in died):
            cause += (
                " (gloo aborts a process whose collective's sizes differ from its peers': a rank skipped a collective)"
            )
    else:
        status, cause = "hang", "no rank answered in time"
    index = re.search(r"call (-?\d+)", where[0])
    detail = f"{cause}\n" + "\n".join(where) + f"\n\n{text[-3000:]}"
    return Outcome(status, int(index.group(1)) if index else -1, detail, seconds=seconds)


def report(program: Program, result: Outcome) -> str:
    known = oracle.known_defects(program)
    lines = [
        f"{result.status} at call {result.call} after {result.seconds:.1f} s: {result.detail}",
        f"known unfixed defects with these ingredients: {', '.join(known)}" if known else "",
        "",
        "Paste as a test into tests/fuzz/test_findings.py:",
        "",
        program.as_pytest("test_finding"),
    ]
    return "\n".join(line for line in lines if line is not None)


def assert_program_passes(worlds, program: Program) -> Outcome:
    result = outcome(worlds, program)
    assert result.status not in FAILING, report(program, result)
    return result


__all__ = ["assert_program_passes", "outcome", "report", "format_program"]
