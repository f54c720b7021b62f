"""A pool of long-lived gloo worlds, shared by every multi-process test.

Starting a process, importing torch and forming a process group costs seconds on
a 2-core machine, so each world size gets one set of rank processes that stays up
for the whole pytest session. A test sends a function (by import path) to every
rank of a world and gets back each rank's return value.

Rules for functions run on a world:
- they are module-level functions in an importable module (``tests.*``);
- they take ``(rank, world_size, *args)`` and return something picklable;
- every rank must run the same collectives (as in any SPMD program).

If any rank raises or dies, the harness waits only a few seconds more for the other ranks'
answers (they may be stuck in a collective or a point-to-point receive that will never
complete), then fails the call; the world is then torn down (its stuck ranks killed) and a fresh
one is started for the next test. A call no rank answers fails after its timeout.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import multiprocessing.connection
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

# gloo gives up on a stuck collective after this long; the harness waits a bit longer.
COLLECTIVE_TIMEOUT_S = 90
DEFAULT_CALL_TIMEOUT_S = 240
# Once a rank failed, how long the others get to answer (their own errors, often the same one)
# before the call fails without them.
AFTER_FAILURE_WAIT_S = 3
# Spawning ranks that each import torch: slow, not stuck, on a loaded 2-core machine (a 4-rank
# world once took over 90 s to start there while benchmarks ran beside the tests).
WORLD_START_TIMEOUT_S = 300


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


def _resolve(module_name: str, qualname: str) -> Callable:
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _rank_main(rank: int, world_size: int, port: int, conn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    warnings.filterwarnings("ignore", message=".*is deprecated. Please use.*")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    conn.send(("ready", None))
    while True:
        task = conn.recv()
        if task is None:
            break
        module_name, qualname, args, kwargs = task
        try:
            torch.manual_seed(0)
            result = _resolve(module_name, qualname)(rank, world_size, *args, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - report everything to the test
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


@dataclass
class World:
    """``size`` rank processes joined in one gloo process group."""

    size: int

    def __post_init__(self) -> None:
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        # The world's store lives here, on a port the kernel picks, so no other process can take
        # the port between choosing it and binding it.
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = self._store.port
        self._conns = []
        self._procs = []
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, self.size, port, child), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        for rank, conn in enumerate(self._conns):
            if not conn.poll(WORLD_START_TIMEOUT_S):
                self.close()
                raise RuntimeError(
                    f"rank {rank} of a {self.size}-rank test world did not start in {WORLD_START_TIMEOUT_S} s"
                )
            conn.recv()

    def run(self, fn: Callable, *args, timeout: float = DEFAULT_CALL_TIMEOUT_S, **kwargs) -> list:
        task = (fn.__module__, fn.__qualname__, args, kwargs)
        for conn in self._conns:
            conn.send(task)
        answers = self._collect(timeout)
        results, failures = [], []
        first_failure = next((rank for rank, (status, _) in sorted(answers.items()) if status != "ok"), None)
        for rank in range(self.size):
            status, value = answers.get(rank, (None, None))
            results.append(value if status == "ok" else None)
            if status == "error":
                failures.append(f"rank {rank}:\n{value}")
            elif status == "died":
                failures.append(f"rank {rank}: process died (exit code {value})")
            elif status is None and first_failure is not None:
                failures.append(f"rank {rank}: no answer {AFTER_FAILURE_WAIT_S}s after rank {first_failure} failed")
            elif status is None:
                failures.append(f"rank {rank}: no answer within {timeout}s (hung collective?)")
        if failures:
            raise RankFailure(f"{fn.__qualname__} failed on a {self.size}-rank world\n" + "\n".join(failures))
        return results

    def _collect(self, timeout: float) -> dict[int, tuple[str, Any]]:
        """Each rank's ``(status, value)`` as it arrives: until all answered, the timeout passed,
        or ``AFTER_FAILURE_WAIT_S`` after the first failure (a rank raised or died)."""
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        answers: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in mp.connection.wait(list(waiting), timeout=remaining):
                rank = waiting.pop(conn)
                try:
                    answers[rank] = conn.recv()
                except (EOFError, ConnectionError):
                    self._procs[rank].join(timeout=5)  # reap it so the exit code is known
                    answers[rank] = ("died", self._procs[rank].exitcode)
                if answers[rank][0] != "ok":
                    deadline = min(deadline, time.monotonic() + AFTER_FAILURE_WAIT_S)
        return answers

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self, abandon: bool = False) -> None:
        """Stop the ranks; ``abandon``: kill them at once (some may be stuck in a collective)."""
        if not abandon:
            for conn in self._conns:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            for proc in self._procs:
                proc.join(timeout=5)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


class WorldPool:
    """Hands out one live World per size; replaces a world after any failure."""

    def __init__(self) -> None:
        self._worlds: dict[int, World] = {}

    def run(self, world_size: int, fn: Callable, *args, **kwargs) -> list:
        world = self._worlds.get(world_size)
        if world is None or not world.alive:
            world = self._worlds[world_size] = World(world_size)
        try:
            return world.run(fn, *args, **kwargs)
        except BaseException:
            # Other ranks may sit in a collective that will never complete: start over.
            self._worlds.pop(world_size, None)
            world.close(abandon=True)
            raise

    def discard(self, world_size: int) -> None:
        """Stop the world of ``world_size`` ranks (some may be stuck); the next run starts a fresh one."""
        world = self._worlds.pop(world_size, None)
        if world is not None:
            world.close(abandon=True)

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()
