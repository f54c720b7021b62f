"""Where collectives run relative to compute: side streams on accelerators, async work on CPU.

On an accelerator with streams (CUDA), all-gathers and reduce-scatters run on streams of their
own so they overlap compute. They are ordered against the compute stream with events only, never
``record_stream``, and by one rule that keeps the caching allocator's reuse safe and the memory
deterministic: **a buffer is freed on the stream that allocated it, and only after that stream has
waited for every other stream that used it**. Concretely:

- all-gather outputs are allocated on the all-gather stream and consumed (copied out) on the compute
  stream; they are dropped only once the all-gather stream has waited for the copy-out's event, just
  before its next allocation (``GatherBuffers``). So only gathers consumed since the last
  all-gather are held, and the all-gather stream runs at most one group ahead of the copy-outs;
- reduce-scatter inputs and outputs are allocated on the compute stream, used on the reduce-scatter
  stream, and dropped after the compute stream waited for the reduce-scatter's event.

On CPU there are no streams: collectives are issued with ``async_op=True`` (gloo runs them on its
own threads) and their work handles are waited on; ``SideStream`` then does nothing.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch


def _has_streams(device: torch.device) -> bool:
    return device.type not in ("cpu", "meta") and hasattr(torch.get_device_module(device), "Stream")


@dataclass
class Completion:
    """Collectives issued on a side stream, and the work that needs their results.

    Made by ``SideStream.launch()``. ``wait()`` makes their results usable on the caller's
    stream: on an accelerator the compute stream waits for the side stream's event; on CPU the
    work handles are waited on and the follow-up work runs then.
    """

    side: "SideStream"
    works: list[Any] = field(default_factory=list)  # async c10d work handles (no streams)
    followups: list[Callable[[], None]] = field(default_factory=list)  # run at wait() (no streams)
    event: Any = None  # recorded on the side stream after everything launched (streams)

    def collective(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Issue ``fn(*args, **kwargs, async_op=...)``, a c10d collective, ordered as this side requires."""
        work = fn(*args, **kwargs, async_op=self.side.async_op)
        if self.side.async_op:
            self.works.append(work)

    def then(self, fn: Callable[[], None]) -> None:
        """``fn`` needs the collectives' results: queue it on the side stream behind them, or
        (no streams) run it in ``wait()`` once the work handles completed."""
        if self.side.async_op:
            self.followups.append(fn)
        else:
            fn()

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()
        for fn in self.followups:
            fn()
        self.followups.clear()
        if self.event is not None:
            self.side.compute_waits_for(self.event)
            self.event = None


class SideStream:
    """One kind of communication's stream (accelerators), or the caller's own thread (CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._module = torch.get_device_module(device) if _has_streams(device) else None
        # High priority: a collective waiting behind compute kernels delays every rank.
        self.stream = self._module.Stream(device=device, priority=-1) if self._module else None

    @property
    def async_op(self) -> bool:
        """What to pass to c10d: with a stream the collective is ordered by the stream instead."""
        return self.stream is None

    def _compute(self) -> Any:
        """The compute stream: whatever is current on the caller's side."""
        return self._module.current_stream(self.device)

    def wait_for_compute(self) -> None:
        """Everything queued on the compute stream so far happens before what we queue next."""
        if self.stream is not None:
            self.stream.wait_stream(self._compute())

    def wait_event(self, event: Any) -> None:
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this the current stream (no-op without streams)."""
        if self.stream is None:
            yield
            return
        with self._module.stream(self.stream):
            yield

    @contextlib.contextmanager
    def launch(self, wait_for_compute: bool = True) -> Iterator[Completion]:
        """Issue collectives on this stream: ``with side.launch() as completion: completion.collective(...)``.

        ``wait_for_compute`` first orders them after everything queued on the compute stream (the
        inputs were written there); ``False`` lets them run ahead, only safe when nothing queued
        since the last such wait writes their inputs.
        """
        if wait_for_compute:
            self.wait_for_compute()
        completion = Completion(self)
        with self.active():
            yield completion
            completion.event = self.record()

    def record(self) -> Any:
        """An event after everything queued on this stream so far (None without streams)."""
        return self.stream.record_event() if self.stream is not None else None

    def compute_waits_for(self, event: Any) -> None:
        self._compute().wait_event(event)

    def compute_event(self) -> Any:
        """An event after everything queued on the compute stream so far (None without streams)."""
        return self._compute().record_event() if self.stream is not None else None

    def host_waits_for_compute(self) -> None:
        """Block the host until the compute stream is done (no-op without streams)."""
        if self.stream is not None:
            self._compute().synchronize()


class GatherBuffers:
    """Holds the newest consumed all-gather outputs until the all-gather stream may reuse them."""

    def __init__(self, stream: SideStream):
        self._stream = stream
        self._held: list[torch.Tensor] = []
        self._consumed: Any = None  # compute-stream event after the held buffers' copy-out

    def consumed(self, buffers: list[torch.Tensor], event: Any) -> None:
        """``buffers`` were copied out on the compute stream before ``event``."""
        if event is None:
            return  # no streams: the copy-out already happened, let them go now
        # Events on one stream complete in order, so waiting for the newest covers older ones.
        self._held.extend(buffers)
        self._consumed = event

    def release_before_allocating(self) -> None:
        """Call on the all-gather stream before allocating: order its reuse after the copy-outs."""
        if self._consumed is not None:
            self._stream.wait_event(self._consumed)
            self._consumed = None
        self._held = []


class CommStreams:
    """The side streams of one device, shared by every fully_shard group on it."""

    def __init__(self, device: torch.device):
        self.all_gather = SideStream(device)
        self.reduce_scatter = SideStream(device)
        self.gather_buffers = GatherBuffers(self.all_gather)

    def host_waits_for_compute(self) -> None:
        """Block the host until the compute stream is done (e.g. before a CPU optimizer step)."""
        self.all_gather.host_waits_for_compute()

    @staticmethod
    @functools.cache
    def for_device(device: torch.device) -> "CommStreams":
        return CommStreams(device)
