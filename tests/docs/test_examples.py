"""The examples start as PyTorch users start jobs: under torchrun (env:// rendezvous) and by
themselves, with the same result."""

import json
import os
import subprocess
import sys
import pytest

pytestmark = pytest.mark.slow  # the examples under torchrun


def _losses(cmd: list[str], out: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        cmd + ["--steps", "3", "--layers", "2", "--report-every", "2", "--losses-out", out],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(open(out).read()), result.stdout


def test_train_gpt_under_torchrun_matches_spawned_ranks(tmp_path):
    spawned, printed = _losses(
        [sys.executable, "examples/train_gpt.py", "--nproc", "2"], str(tmp_path / "spawned.json")
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29531"]
    launched, _ = _losses(torchrun + ["examples/train_gpt.py"], str(tmp_path / "torchrun.json"))
    assert spawned == launched and len(spawned) == 3
    # --report-every 2: one throughput line at step 2 with every rank's memory, none at steps 1 and 3.
    reports = [line for line in printed.splitlines() if "tokens/s" in line]
    assert (
        len(reports) == 1
        and reports[0].startswith("step    2")
        and "rank 0: state" in reports[0]
        and "rank 1: state" in reports[0]
    ), printed
