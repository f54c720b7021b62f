"""Fault-tolerant HSDP (fsdp2.ft on torchft): what a lost replica group costs the survivors, and
how fast a restarted one heals.

    python benchmarks/bench_ft.py --hidden 65536 1048576 4194304 --repeats 3

Per size: 2 replica groups x 2 shard ranks (tests/ft/ft_job.py: lighthouse in this process,
heartbeat timeout --heartbeat-ms, loopback, gloo). Group 1 is SIGKILLed between steps 2 and 3;
the survivors' next committed step is timed from the kill. The survivor then waits at step 5
for the restarted group, which heals there from a live peer: its begin_step (quorum + state
transfer + load) less the survivor's begin_step of the same step is the heal time, divided by
the state a shard rank receives (its parameter and Adam shards, both ranks in parallel).
Prints one markdown row per size (medians over --repeats).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.ft.ft_job import FTJob  # noqa: E402

KILL_BEFORE, REJOIN_AT, STEPS = 3, 5, 7


def one_run(hidden: int, heartbeat_ms: int) -> dict:
    common = ["--steps", str(STEPS), "--hidden", str(hidden), "--timeout", "30"]
    with tempfile.TemporaryDirectory() as d, FTJob(Path(d), heartbeat_timeout_ms=heartbeat_ms) as job:
        job.launch(0, worker_args=common + ["--gate-at", "0", str(REJOIN_AT)])
        job.launch(1, worker_args=common + ["--gate-at", "0", "--die-before-step", str(KILL_BEFORE)])
        job.wait_lighthouse(participants=0, heartbeating=2)
        job.open_gate(0)
        job.wait_group(1, timeout=300)
        killed = min(float(p.read_text()) for p in job.gates.glob("killed_*"))
        job.wait_files(f"at_{REJOIN_AT}_r0*", 2, timeout=300)
        job.launch(1, 1, worker_args=common)
        job.wait_lighthouse(participants=1, heartbeating=2, timeout=300)
        job.open_gate(REJOIN_AT)
        assert job.wait_group(0, timeout=300) == [0, 0] and job.wait_group(1, 1, timeout=300) == [0, 0], (
            job.stderr_tails()
        )
        survivor = [job.result(0, 0, s) for s in range(2)]
        healed = [job.result(1, 1, s) for s in range(2)]
    next_commit = min(e["end"] for r in survivor for e in r["log"] if e["committed"] and e["step"] == KILL_BEFORE)
    heal = max(
        h["log"][0]["begin_s"] - next(e["begin_s"] for e in s["log"] if e["step"] == REJOIN_AT)
        for h, s in zip(healed, survivor)
    )
    shard_bytes = max(
        sum(t.numel() * t.element_size() for t in r["params"].values())
        + sum(t.numel() * t.element_size() for st in r["optimizer"].values() for t in st.values())
        for r in healed
    )
    return {"kill_to_commit_s": next_commit - killed, "heal_s": heal, "shard_gb": shard_bytes / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[65536, 1048576, 4194304])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heartbeat-ms", type=int, default=1000)
    args = ap.parse_args()
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"heartbeat timeout {args.heartbeat_ms} ms"
    )
    print("| hidden | state per shard rank (GB) | kill -> survivors' next commit (s) | heal (s) | heal per GB (s/GB) |")
    print("|---|---|---|---|---|")
    for hidden in args.hidden:
        runs = [one_run(hidden, args.heartbeat_ms) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {hidden} | {med['shard_gb']:.3f} | {med['kill_to_commit_s']:.2f} | {med['heal_s']:.3f} | "
            f"{med['heal_s'] / med['shard_gb']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
