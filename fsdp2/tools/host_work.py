"""Count the host work of a training step: exact, load-independent numbers instead of timings.

    from fsdp2.tools.host_work import count_host_work

    work = count_host_work(lambda: train_step(model, opt, batch))
    work.ops, work.python_calls, work.calls_in(FSDP_CODE), work.calls_in(DTENSOR_CODE)

``ops`` are the ATen ops a dispatch mode sees (views and copies included, each a kernel launch or
a dispatch on a GPU); ``python_calls`` every Python function call, from cProfile, by file. The
step runs twice, once per counter, so it must be repeatable (a training step is). Neither count
depends on the CPU's kernels, its thread count or the load: they are what benchmarks and the
regression guards in tests/test_host_work.py compare. A compiled step (torch.compile) is counted
with ``count_ops=False``: dynamo refuses to run under a dispatch mode, so only its Python calls
are counted (``ops`` is None).
"""

from __future__ import annotations

import cProfile
import pstats
from dataclasses import dataclass
from typing import Callable

from torch.utils._python_dispatch import TorchDispatchMode

# Files whose path contains one of these (and none of the ``excluded``) are that code's.
FSDP_CODE = (("/fsdp2/", "/_fully_shard/"), ("/fsdp2/models/",))  # fsdp2's or PyTorch FSDP2's, not our test models
DTENSOR_CODE = (("/torch/distributed/tensor/",), ())


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@dataclass
class HostWork:
    ops: int | None
    calls_by_file: dict[str, int]

    @property
    def python_calls(self) -> int:
        return sum(self.calls_by_file.values())

    def calls_in(self, code: tuple[tuple[str, ...], tuple[str, ...]]) -> int:
        """Python calls into functions defined in ``code`` (FSDP_CODE, DTENSOR_CODE)."""
        included, excluded = code
        return sum(
            n for file, n in self.calls_by_file.items()
            if any(w in file for w in included) and not any(w in file for w in excluded)
        )


def count_host_work(step: Callable[[], object], count_ops: bool = True) -> HostWork:
    """Run ``step`` twice: once counting dispatched ops, once counting Python calls (without
    ``count_ops``: once, counting Python calls only)."""
    counter = _OpCounter()
    if count_ops:
        with counter:
            step()
    profile = cProfile.Profile()
    profile.enable()
    try:
        step()
    finally:
        profile.disable()
    calls_by_file: dict[str, int] = {}
    for (file, _, _), (_, calls, *_) in pstats.Stats(profile).stats.items():  # (primitive, all calls, ...)
        calls_by_file[file] = calls_by_file.get(file, 0) + calls
    return HostWork(counter.ops if count_ops else None, calls_by_file)
