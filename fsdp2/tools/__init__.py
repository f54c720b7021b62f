"""Tools around the runtime: measure a step, estimate its memory, simulate a large world.

    from fsdp2.tools import count_comm, count_host_work, estimate_memory, PeakMemory

- ``count_comm`` / ``CommStats``: bytes and calls fsdp2 hands to its collectives, per kind;
- ``estimate_memory`` / ``MemoryEstimate`` / ``GroupEstimate``: a rank's memory under fully_shard
  from shapes alone (with a sample input, the step's peak from a meta dry run);
  ``local_bytes`` / ``optimizer_state_bytes``: bytes of this rank's tensors and of an optimizer's state;
- ``PeakMemory``: the exact allocator peak over a block of code (CUDA and CPU);
- ``count_host_work`` / ``HostWork`` / ``FSDP_CODE`` / ``DTENSOR_CODE``: ops and Python calls of a step;
- ``init_noop_process_group`` / ``NoopProcessGroup`` / ``noop_calls``: rank 0 of N in one process,
  collectives that do nothing.

Each name is imported from its module at first use, so importing ``fsdp2.tools`` (or its byte
progress bars, which checkpoints use) does not load the estimator's dry run or the profilers.
"""

from __future__ import annotations

import importlib

# module -> the public names it defines.
_EXPORTS = {
    "fsdp2.tools.comm_stats": ("CommStats", "count_comm"),
    "fsdp2.tools.estimate": (
        "GroupEstimate",
        "MemoryEstimate",
        "estimate_memory",
        "local_bytes",
        "optimizer_state_bytes",
    ),
    "fsdp2.tools.memory_meter": ("PeakMemory",),
    "fsdp2.tools.host_work": ("DTENSOR_CODE", "FSDP_CODE", "HostWork", "count_host_work"),
    "fsdp2.tools.noop_pg": ("NoopProcessGroup", "init_noop_process_group", "noop_calls"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
