"""A fault-tolerant HSDP job on this machine for tests and benchmarks: a torchft lighthouse in
this process and replica groups of tests/ft/ft_worker.py subprocesses (loopback only, stores bound
here, bounded waits, every process killed on exit even when a check failed)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

WORKER = Path(__file__).resolve().with_name("ft_worker.py")
ROOT = WORKER.parents[2]


class FTJob:
    """``launch`` replica groups, ``open_gate`` to let the live ones on, ``result`` to read what
    each rank wrote. Use as a context manager: leaving it kills whatever still runs."""

    def __init__(self, workdir: Path, *, heartbeat_timeout_ms: int = 1000, join_timeout_ms: int = 20000):
        os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at info
        from torchft._torchft import LighthouseServer

        self.gates = workdir / "gates"
        self.out = workdir / "out"
        self.gates.mkdir(parents=True)
        self.out.mkdir(parents=True)
        self.lighthouse = LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=1,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=20,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        # Its address() names the host; the workers reach it on loopback, where it listens.
        self.lighthouse_address = "http://127.0.0.1:" + self.lighthouse.address().rsplit(":", 1)[1]
        self.groups: dict[tuple[int, int], list[subprocess.Popen]] = {}
        self.stores: list = []

    def launch(self, replica: int, incarnation: int = 0, *, ranks: int = 2, worker_args: list[str] = ()) -> None:
        # The group's store is bound here, on a port the kernel picks, and its ranks connect to it
        # as clients (as under torchrun's agent): a port picked free and bound later by a worker
        # can be taken in between by a group launched beside it.
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.stores.append(store)
        procs = []
        for rank in range(ranks):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(ranks),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(store.port),
                TORCHELASTIC_USE_AGENT_STORE="True",
                TORCHFT_LIGHTHOUSE=self.lighthouse_address,
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                RUST_LOG="error",
            )
            args = [
                sys.executable,
                str(WORKER),
                "--replica",
                str(replica),
                "--incarnation",
                str(incarnation),
                "--out",
                str(self.out),
                "--gates",
                str(self.gates),
                *worker_args,
            ]
            log = open(self.out / f"stderr_r{replica}i{incarnation}s{rank}.txt", "w")
            procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        self.groups[(replica, incarnation)] = procs

    def wait_files(self, pattern: str, count: int, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while len(list(self.gates.glob(pattern))) < count:
            self._raise_if_crashed()
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout}s for {count} x {pattern}: {self.stderr_tails()}")
            time.sleep(0.02)

    def wait_lighthouse(self, *, participants: int, heartbeating: int, timeout: float = 240.0) -> None:
        """Until the lighthouse has quorum requests from ``participants`` groups and heartbeats
        from ``heartbeat`` groups (its status page): a gate opened after this cannot let a live
        group form a quorum without a joiner that is still starting."""
        url = self.lighthouse_address + "/status"
        pattern = re.compile(r"\[\d+/(\d+) participants healthy\]\[(\d+) heartbeating\]")
        deadline = time.monotonic() + timeout
        status = ""
        while time.monotonic() < deadline:
            with urllib.request.urlopen(url, timeout=5) as response:
                status = response.read().decode()
            self._raise_if_crashed()
            found = pattern.search(status)
            if found and int(found[1]) >= participants and int(found[2]) >= heartbeating:
                return
            time.sleep(0.05)
        raise TimeoutError(
            f"lighthouse never had {participants} requests and {heartbeating} heartbeats: {status}\n"
            f"{self.stderr_tails()}"
        )

    def _raise_if_crashed(self) -> None:
        """Fail now, not at a timeout, when a worker died of something else than an injected
        SIGKILL (-9) or a reported error (3)."""
        for (replica, incarnation), procs in self.groups.items():
            for p in procs:
                if p.poll() not in (None, 0, -9, 3):
                    raise RuntimeError(
                        f"replica {replica}/{incarnation} exited with {p.returncode}: {self.stderr_tails()}"
                    )

    def open_gate(self, step: int) -> None:
        (self.gates / f"go_{step}").touch()

    def wait_group(self, replica: int, incarnation: int = 0, timeout: float = 300.0) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.groups[(replica, incarnation)]:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise TimeoutError(
                    f"replica {replica}/{incarnation} still runs after {timeout}s: {self.stderr_tails()}"
                )
        return codes

    def result(self, replica: int, incarnation: int, shard_rank: int) -> dict:
        tag = f"r{replica}i{incarnation}s{shard_rank}"
        state = torch.load(self.out / f"state_{tag}.pt")
        state["log"] = json.loads((self.out / f"log_{tag}.json").read_text())
        after_close = self.out / f"after_close_{tag}.json"  # ft_worker.py --after-close
        state["after_close"] = json.loads(after_close.read_text()) if after_close.exists() else None
        return state

    def error(self, replica: int, incarnation: int, shard_rank: int) -> str | None:
        path = self.out / f"error_r{replica}i{incarnation}s{shard_rank}.txt"
        return path.read_text() if path.exists() else None

    def stderr_tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.out.glob("stderr_*.txt")))

    def __enter__(self) -> "FTJob":
        return self

    def __exit__(self, *exc) -> None:
        for procs in self.groups.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for procs in self.groups.values():
            for p in procs:
                p.wait()
        self.lighthouse.shutdown()
        self.stores.clear()
