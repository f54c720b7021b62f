"""The stream protocol of fsdp2.runtime.streams, checked on CPU with recording stand-in streams.

CI has no GPU, so the CUDA path (collectives on side streams ordered by events) cannot run here.
These tests swap in ``RecordingStream``s that take that path (``async_op=False`` collectives
queued "on" a side stream, reductions finished at issue time) and log every wait, event and
stream switch. From the log they check the rules the real streams rely on:

- every all-gather and reduce-scatter is issued while its side stream is current;
- an all-gather output is dropped only after the compute stream waited for the all-gather and
  the all-gather stream then waited for the compute event after its copy-out (so the allocator
  cannot hand its memory to the next all-gather while the copy-out may still read it);
- reduce-scatter buffers are dropped only after the compute stream waited for the reduction;
- within the root's forward the all-gather stream waits for compute once (at the root), so
  all-gathers may run ahead of compute; at most two all-gather outputs are alive at once;
and that training through this path matches the unsharded reference.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import torch
from torch.distributed.device_mesh import init_device_mesh

from fsdp2.runtime import collectives, schedule
from fsdp2.models.gpt import GPT
from fsdp2.runtime.streams import CommStreams, GatherBuffers, SideStream
from tests.support.models import CFG
from tests.support.parity import gpt_pair, shard_gpt, train_parity


class StreamLog:
    def __init__(self):
        self.entries: list[tuple] = []
        self._next_event = 0
        self.current = "compute"
        self.live_gather_outputs = 0
        self.max_live_gather_outputs = 0
        self.violations: list[str] = []  # finalizers cannot raise into the test

    def add(self, *entry) -> int:
        self.entries.append(entry)
        return len(self.entries) - 1

    def new_event(self) -> int:
        self._next_event += 1
        return self._next_event


class RecordingStream(SideStream):
    """Takes the with-streams path of fsdp2 and logs what a real stream would be asked to do."""

    def __init__(self, name: str, log: StreamLog):
        self.device = torch.device("cpu")
        self.name = name
        self.log = log
        self.stream = object()  # not None: fsdp2 takes the side-stream path

    def wait_for_compute(self) -> None:
        self.log.add("wait_compute", self.name)

    def wait_event(self, event) -> None:
        if event is not None:
            self.log.add("wait_event", self.name, event)

    @contextlib.contextmanager
    def active(self):
        previous, self.log.current = self.log.current, self.name
        try:
            yield
        finally:
            self.log.current = previous

    def record(self):
        event = self.log.new_event()
        self.log.add("record", self.name, event)
        return event

    def compute_waits_for(self, event) -> None:
        self.log.add("compute_waits", self.name, event)

    def compute_event(self):
        event = self.log.new_event()
        self.log.add("record", "compute", event)
        return event


def _recording_streams(log: StreamLog) -> CommStreams:
    streams = CommStreams.__new__(CommStreams)
    streams.all_gather = RecordingStream("all_gather", log)
    streams.reduce_scatter = RecordingStream("reduce_scatter", log)
    streams.gather_buffers = GatherBuffers(streams.all_gather)
    return streams


@contextlib.contextmanager
def _recorded(log: StreamLog):
    """fsdp2 groups created inside use recording streams; collectives log issue and free."""
    streams = _recording_streams(log)
    log.streams = streams
    originals = CommStreams.for_device, collectives.all_gather, collectives.reduce_scatter

    def all_gather(output, input, group, async_op):
        assert log.current == "all_gather", "all-gather issued off the all-gather stream"
        index = log.add("all_gather", id(output))
        log.live_gather_outputs += 1
        log.max_live_gather_outputs = max(log.max_live_gather_outputs, log.live_gather_outputs)
        weakref.finalize(output, _gather_output_freed, log, index)
        return originals[1](output, input, group, async_op)

    def reduce_scatter(output, input, group, async_op, op):
        assert log.current == "reduce_scatter", "reduce-scatter issued off the reduce-scatter stream"
        index = log.add("reduce_scatter", id(output))
        for buffer in (output, input):
            # fsdp2 passes views; the buffer is their base (which views keep alive).
            weakref.finalize(buffer if buffer._base is None else buffer._base, _reduce_buffer_freed, log, index)
        return originals[2](output, input, group, async_op, op)

    CommStreams.for_device = staticmethod(lambda device: streams)
    collectives.all_gather, collectives.reduce_scatter = all_gather, reduce_scatter
    try:
        yield
    finally:
        CommStreams.for_device, collectives.all_gather, collectives.reduce_scatter = originals


def _first_after(log: StreamLog, index: int, kind: str, stream: str) -> int | None:
    for entry in log.entries[index:]:
        if entry[0] == kind and entry[1] == stream:
            return entry[2]
    return None


def _has(log: StreamLog, start: int, entry: tuple) -> int | None:
    for i in range(start, len(log.entries)):
        if log.entries[i] == entry:
            return i
    return None


def _gather_output_freed(log: StreamLog, issued_at: int) -> None:
    log.live_gather_outputs -= 1
    gathered = _first_after(log, issued_at, "record", "all_gather")
    waited = _has(log, issued_at, ("compute_waits", "all_gather", gathered))
    copied_out = None if waited is None else _first_after(log, waited, "record", "compute")
    later_waits = (
        [] if waited is None else [e[2] for e in log.entries[waited:] if e[:2] == ("wait_event", "all_gather")]
    )
    if copied_out is None or not any(event >= copied_out for event in later_waits):
        log.violations.append(
            f"all-gather output {issued_at} freed before the all-gather stream waited for its copy-out"
        )
    log.add("freed_gather_output", issued_at)


def _reduce_buffer_freed(log: StreamLog, issued_at: int) -> None:
    reduced = _first_after(log, issued_at, "record", "reduce_scatter")
    if _has(log, issued_at, ("compute_waits", "reduce_scatter", reduced)) is None:
        log.violations.append(f"reduce-scatter buffer {issued_at} freed before compute waited for the reduction")
    log.add("freed_reduce_buffer", issued_at)


# -- rank functions ------------------------------------------------------------------------------


def _protocol(rank, ws):
    log = StreamLog()
    with _recorded(log):
        model, ref = gpt_pair()  # 2 blocks + root, 3 all-gathers per forward
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x = torch.randint(0, 67, (2, 16))
        for _ in range(3):
            start = log.add("test", "forward")
            loss = model.loss(x, x)
            end = log.add("test", "backward")
            forward = log.entries[start:end]
            compute_waits = [e for e in forward if e == ("wait_compute", "all_gather")]
            gathers = [e for e in forward if e[0] == "all_gather"]
            assert len(compute_waits) == 1 and len(gathers) == 3, forward
            loss.backward()
            opt.step()
            opt.zero_grad()
        del model, loss, opt
        gc.collect()
        log.streams.gather_buffers.release_before_allocating()  # what the next all-gather would do
    assert not log.violations, log.violations
    freed = [e for e in log.entries if e[0] == "freed_gather_output"]
    issued = [e for e in log.entries if e[0] == "all_gather"]
    # The newest gather output is still held for reuse by the next all-gather; all others freed.
    assert len(freed) == len(issued), (len(freed), len(issued))
    assert any(e[0] == "freed_reduce_buffer" for e in log.entries)
    assert log.max_live_gather_outputs <= schedule.GATHERS_AHEAD_OF_COMPUTE + 1, log.max_live_gather_outputs
    return log.max_live_gather_outputs


def _parity_on_streams(rank, ws, hybrid):
    log = StreamLog()
    with _recorded(log):
        if hybrid:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            ref = GPT(CFG)
            model = shard_gpt(copy.deepcopy(ref), mesh=mesh)
            train_parity(rank, ws, model, ref)
        else:
            model, ref = gpt_pair()
            train_parity(rank, ws, model, ref)
        del model
        gc.collect()
    assert not log.violations, log.violations
    assert any(e[0] == "reduce_scatter" for e in log.entries)


def test_stream_protocol(worlds):
    assert all(live <= schedule.GATHERS_AHEAD_OF_COMPUTE + 1 for live in worlds.run(2, _protocol))


def test_training_on_streams_matches_unsharded(worlds):
    worlds.run(2, _parity_on_streams, False)


def test_hsdp_on_streams_matches_unsharded(worlds):
    worlds.run(4, _parity_on_streams, True)


def _one_rank(rank, ws, shortcut):
    from fsdp2.tools.comm_stats import count_comm
    from fsdp2.runtime import schedule

    log = StreamLog()
    with _recorded(log), count_comm() as stats:
        with contextlib.nullcontext() if shortcut else schedule.always_communicate():
            model, ref = gpt_pair()
        train_parity(rank, ws, model, ref)
        del model
        gc.collect()
    assert not log.violations, log.violations
    return stats.bytes["all_gather"], stats.bytes["reduce_scatter"]


def test_one_rank_shard_group_skips_collectives(worlds):
    """World size 1: no collective by default; forced through the full stream path, same results."""
    assert worlds.run(1, _one_rank, True) == [(0, 0)]
    gathered, reduced = worlds.run(1, _one_rank, False)[0]
    assert gathered > 0 and reduced > 0
