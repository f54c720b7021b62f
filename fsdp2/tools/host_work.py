"""Count the host work of a training step: exact, load-independent numbers instead of timings.

    from fsdp2.tools.host_work import count_host_work

    work = count_host_work(lambda: train_step(model, opt, batch))
    work.ops, work.python_calls, work.calls_in(FSDP_CODE), work.calls_in(DTENSOR_CODE)

``ops`` are the ATen ops a dispatch mode sees (views and copies included, each a kernel launch or
a dispatch on a GPU); ``bytes_written`` the bytes those ops write (data movement and compute
outputs alike, by op name in ``bytes_by_op``; views, allocations and the process group's own
collectives write none here); ``python_calls`` every Python function call, from cProfile, by file. The
step runs twice, once per counter, so it must be repeatable (a training step is). Neither count
depends on the CPU's kernels, its thread count or the load: they are what benchmarks and the
regression guards in tests/runtime/test_host_work.py compare. A compiled step (torch.compile) is counted
with ``count_ops=False``: dynamo refuses to run under a dispatch mode, so only its Python calls
are counted (``ops`` is None).
"""

from __future__ import annotations

import cProfile
import pstats
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from fsdp2 import compat
from fsdp2.compat import TorchDispatchMode

# Files whose path contains one of these (and none of the ``excluded``) are that code's.
FSDP_CODE = (("/fsdp2/", "/_fully_shard/"), ("/fsdp2/models/",))  # fsdp2's or PyTorch FSDP2's, not our test models
DTENSOR_CODE = (("/torch/distributed/tensor/",), ())


# Ops that give a tensor memory or metadata without writing its elements.
_WRITE_NOTHING = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_"}
)


def _nbytes(value) -> int:
    if isinstance(value, DTensor):
        value = compat.local_tensor(value)  # this rank's bytes (the mode sees DTensor ops, not their local ones)
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


# The process group's own work (what a collective writes), not its caller's.
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


def _op_name(func) -> str:
    """``copy_`` for ATen ops, ``fsdp::chunk_cat`` for others."""
    name = compat.op_name(func)
    return name if func.namespace == "aten" else f"{func.namespace}::{name}"


def _bytes_written(func, args, kwargs, out) -> int:
    """What ``func`` wrote: its mutated arguments (in-place and ``out=`` ops), else its fresh outputs."""
    schema, name = compat.op_schema(func), compat.op_name(func)
    if func.namespace in _COLLECTIVE_NAMESPACES or (func.namespace == "aten" and name in _WRITE_NOTHING):
        return 0
    if func.namespace == "fsdp" and name == "all_gather_copy_in":
        # PyTorch FSDP2's copy-in writes its own slot, returned first; the all-gather output it
        # also returns is only allocated (or passed in: an alias its schema does not declare).
        return _nbytes(out[0])
    written = 0
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written += _nbytes(args[i] if i < len(args) else kwargs.get(arg.name))
    if written or any(r.alias_info is not None for r in schema.returns):
        return written  # an in-place op, or a view: nothing fresh
    return _nbytes(out)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes_by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        written = _bytes_written(func, args, kwargs, out)
        if written:
            name = _op_name(func)
            self.bytes_by_op[name] = self.bytes_by_op.get(name, 0) + written
        return out


@dataclass
class HostWork:
    ops: int | None
    calls_by_file: dict[str, int]
    bytes_by_op: dict[str, int] = field(default_factory=dict)  # empty where ops were not counted

    @property
    def bytes_written(self) -> int:
        return sum(self.bytes_by_op.values())

    @property
    def python_calls(self) -> int:
        return sum(self.calls_by_file.values())

    def calls_in(self, code: tuple[tuple[str, ...], tuple[str, ...]]) -> int:
        """Python calls into functions defined in ``code`` (FSDP_CODE, DTENSOR_CODE)."""
        included, excluded = code
        return sum(
            n
            for file, n in self.calls_by_file.items()
            if any(w in file for w in included) and not any(w in file for w in excluded)
        )


def count_host_work(step: Callable[[], object], count_ops: bool = True) -> HostWork:
    """Run ``step`` twice: once counting dispatched ops and their bytes, once counting Python calls
    (without ``count_ops``, for compiled steps the op counter cannot run under: once, Python calls only)."""
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
    if not count_ops:
        return HostWork(None, calls_by_file)
    return HostWork(counter.ops, calls_by_file, counter.bytes_by_op)
