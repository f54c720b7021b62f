"""The long run: ``python -m tests.fuzz --programs 2000 --seed 1`` draws programs from the seed and
runs each on fsdp2 and PyTorch's FSDP2 side by side; a failing program is shrunk and printed as a
test, and (``--all``) the search goes on for failures of other kinds (``fuzzer.signature``). It
prints the programs run, the time, and every finding."""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--programs", type=int, default=200, help="programs to draw (per search)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated: 2, 4 or both")
    parser.add_argument("--compiled", choices=["never", "sometimes", "always"], default="sometimes")
    parser.add_argument("--shrink-seconds", type=float, default=300.0)
    parser.add_argument("--all", action="store_true", help="after a finding, search on for others")
    parser.add_argument("--skip-known", action="store_true", help="leave out programs with a known unfixed defect")
    parser.add_argument(
        "--minutes", type=float, default=None, help="search seed after seed for this long (the last one finishes)"
    )
    parser.add_argument("--verbose", action="store_true", help="one line per program run")
    args = parser.parse_args(argv)

    from tests.fuzz import generate
    from tests.fuzz.fuzzer import Fuzzer, signature
    from tests.harness import WorldPool

    compiled = {"never": False, "sometimes": None, "always": True}[args.compiled]
    sizes = tuple(int(n) for n in args.world_sizes.split(","))
    strategy = generate.programs(world_sizes=sizes, compiled=compiled)
    pool = WorldPool()
    fuzzer = Fuzzer(
        pool, shrink_seconds=args.shrink_seconds, skip_known=args.skip_known, log=print if args.verbose else None
    )
    findings, signatures = [], set()
    start = time.monotonic()
    seed = args.seed
    try:
        while True:
            finding = fuzzer.search(strategy, args.programs, seed, known_signatures=signatures)
            elapsed = time.monotonic() - start
            out_of_time = args.minutes is not None and elapsed > 60 * args.minutes
            if finding is not None:
                findings.append(finding)
                signatures.add(signature(finding.program, finding.outcome))
                print(
                    f"\n=== finding {len(findings)} (seed {seed}): first failing program "
                    f"{elapsed - finding.shrunk_in_s:.0f} s "
                    f"after the start ({finding.programs_before} programs before it in this search), shrunk in "
                    f"{finding.shrunk_in_s:.0f} s\n{finding.report}",
                    flush=True,
                )
            # Go on with the next seed: with --minutes until they run out, else after a finding (--all).
            if out_of_time or (args.minutes is None and (finding is None or not args.all)):
                break
            if finding is not None and not args.all:
                break
            seed += 1
    finally:
        pool.close()
    elapsed = time.monotonic() - start
    run_time = fuzzer.seconds
    print(
        f"\n{fuzzer.runs} programs in {elapsed:.0f} s "
        f"({60 * fuzzer.runs / max(run_time, 1e-9):.1f} programs per minute "
        f"of running them), outcomes {fuzzer.statuses}, {fuzzer.skipped_known} left out as known, "
        f"{len(findings)} finding(s)"
    )
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
