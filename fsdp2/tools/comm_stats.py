"""Count the bytes fsdp2 hands to its collectives, per kind.

    from fsdp2.tools.comm_stats import count_comm

    with count_comm() as stats:
        model.loss(x, y).backward()
    stats.bytes["all_gather"], stats.calls["reduce_scatter"], stats.total_bytes

What is counted, per call on this rank:

- ``all_gather``: the *output* buffer (``group_size x numel_per_rank``, padding included);
- ``reduce_scatter``: the *input* buffer (``group_size x numel_per_rank``, padding included);
- ``all_reduce``: the tensor (HSDP's replicate-dim reduction of reduced gradient shards);
- ``all_to_all``: the *input* buffer, what this rank sends (its own slice included): summed over
  a group's ranks it is everything the exchange moves (``fsdp2.optim``'s whole-matrix exchanges).

These are buffer sizes, not bytes on the wire: a ring all-gather or reduce-scatter moves
``(group_size - 1) / group_size`` of the buffer through each rank's link. Only collectives
issued through :mod:`fsdp2.runtime.collectives` are seen (not DTensor ops such as ``full_tensor()``, nor
user calls to ``torch.distributed``), and those of a step compiled whole (``torch.compile(model)``
over fully_shard): a step traced inside a counter records its collectives from the graph
(``fsdp2.runtime.traced_ops.record_comm``). Counters nest; with none active the collectives do one
empty-list check and nothing else, and compiled graphs record nothing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

from fsdp2.runtime import collectives

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass(eq=False)  # identity: count_comm() removes exactly its own counter
class CommStats:
    """Bytes and number of calls per collective kind, recorded on this rank."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def record(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def __str__(self) -> str:
        parts = [f"{k} {self.bytes[k] / 2**20:.2f} MiB in {self.calls[k]} calls" for k in KINDS if self.calls[k]]
        return ", ".join(parts) or "no collectives"


@contextlib.contextmanager
def count_comm() -> Iterator[CommStats]:
    """Record fsdp2's collectives issued on this rank inside the ``with`` block."""
    stats = CommStats()
    collectives.active_counters.append(stats)
    try:
        yield stats
    finally:
        collectives.active_counters.remove(stats)
