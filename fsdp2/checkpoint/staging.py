"""Host memory that an async save snapshots shards into: allocated once, reused by every save.

``save(..., async_save=True)`` must return quickly while training goes on changing the
parameters, so it copies this rank's shards to host memory and a background thread writes
from there. Allocating that memory is the slow part (pinning ~12 GiB takes seconds), so one
buffer per process is kept and re-carved for each save; it only grows.

On CUDA the buffer is pinned and the device-to-host copies run on a side stream, queued
behind the work already issued (the optimizer step that produced the parameters). The caller's
stream then waits for the copies on the device, so the next step's kernels cannot modify a
parameter before it is copied, while the CPU returns at once; the writer thread waits for the
copies (:meth:`SnapshotStaging.wait_copied`) before hashing and writing. On CPU the copy is a
plain ``copy_`` on the calling thread: the snapshot is complete when ``save`` returns.

States: IDLE (free) -> HELD (``stage``: a save's snapshot lives here) -> IDLE (``release``,
when that save's file is written). A second ``stage`` while HELD is refused: the previous
save is still writing from these bytes.
"""

from __future__ import annotations

import threading
from enum import Enum, auto
from typing import Sequence

import torch

from .errors import CheckpointError

_ALIGN = 64  # bytes; every dtype's alignment, and a cache line


class StagingState(Enum):
    IDLE = auto()
    HELD = auto()


class SnapshotStaging:
    """One reusable host buffer holding a rank's shard snapshot for an async save."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None  # flat uint8
        self._pinned = False
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: list[torch.cuda.Event] = []
        self._lock = threading.Lock()
        self.state = StagingState.IDLE
        self.allocations = 0  # how many times the buffer was (re)allocated

    @property
    def buffer(self) -> torch.Tensor | None:
        return self._buffer

    def stage(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of ``tensors`` (views of the buffer), taken now.

        Device copies may still be in flight on return: the writer calls :meth:`wait_copied`.
        """
        with self._lock:
            if self.state is StagingState.HELD:
                raise CheckpointError(
                    "an earlier async save is still writing from the snapshot buffer; call its "
                    "wait() before starting another save"
                )
            self.state = StagingState.HELD
        try:
            return self._copy(tensors)
        except BaseException:
            self.release()
            raise

    def wait_copied(self) -> None:
        """Block until the device-to-host copies of the last :meth:`stage` are done."""
        for event in self._pending:
            event.synchronize()
        self._pending = []

    def release(self) -> None:
        """The snapshot is no longer needed (its file is written, or the save failed)."""
        with self._lock:
            self.state = StagingState.IDLE

    # ------------------------------------------------------------------------------------

    def _carve(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        offsets, need = [], 0
        for t in tensors:
            offsets.append(need)
            need += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        pinned = torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors)
        if self._buffer is None or self._buffer.numel() < need or (pinned and not self._pinned):
            self._buffer = None  # drop the old one before allocating its successor
            self._buffer = torch.empty(max(need, 1), dtype=torch.uint8, pin_memory=pinned)
            self._pinned = pinned
            self.allocations += 1
        views = []
        for t, off in zip(tensors, offsets):
            raw = self._buffer[off : off + t.numel() * t.element_size()]
            views.append(raw.view(t.dtype).view(t.shape))
        return views

    def _copy(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        views = self._carve(tensors)
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for view, t in zip(views, tensors):
            if t.device.type == "cuda":
                by_device.setdefault(t.device, []).append((view, t))
            else:
                view.copy_(t.detach())
        for device, pairs in by_device.items():
            compute = torch.cuda.current_stream(device)
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device)
            side.wait_stream(compute)  # after the work that produced the values
            with torch.cuda.stream(side):
                for view, t in pairs:
                    view.copy_(t.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
            compute.wait_event(done)  # later kernels (the next optimizer step) wait on the device
            self._pending.append(done)
        return views


_process_staging = SnapshotStaging()


def process_staging() -> SnapshotStaging:
    """The staging buffer of this process (one per rank), shared by all its async saves."""
    return _process_staging
