"""Step time of one forward + backward, replaying fsdp2's schedule on a compute stream and two
communication streams.

The recorded step (fsdp2.tools.meta_step.StepTrace) gives the order of fsdp2's hooks and the
FLOPs between them; each span of FLOPs takes ``FLOPs / rate`` on the compute stream (plus its
share of the tensor-parallel all-reduces, which run inline on the compute stream). Around it
the collectives follow fsdp2's rules (fsdp2/runtime/hooks.py, param_group.py, streams.py,
schedule.py):

- forward: a group's all-gather is issued on the all-gather stream without waiting for compute
  (inside the root's forward gathers run ahead), but at most ``schedule.GATHERS_AHEAD_OF_COMPUTE``
  group ahead of the copy-outs: block i+1 gathers while block i computes. Compute waits for
  the group's all-gather before it starts; the root's first gather waits for the previous step;
- backward: when the gradient reaches a group, it is gathered if needed (``reshard_after_forward``:
  blocks freed their parameters) and the previous group in forward order is prefetched
  (``schedule.implicit_backward_prefetch``), issued after the compute queued so far;
- once a group's gradients are ready its reduce-scatter (then, with replicas, its all-reduce) is
  issued on the reduce-scatter stream after the compute so far; with more than
  ``schedule.DEFAULT_MAX_REDUCES_IN_FLIGHT`` reductions in flight compute waits for the oldest;
  the end of backward waits for all of them;
- DDP (no fsdp2 groups): no gathers; each block's gradients are all-reduced as they are ready
  (DDP's buckets, at block granularity), never stalling compute until the end of backward.

A collective of ``B`` bytes over ``g`` ranks takes ``latency + factor * B / bandwidth`` of its link
(all-gather, reduce-scatter: ``(g - 1) / g``; all-reduce: ``2 (g - 1) / g``). Collectives on the
same link run one after another (they share its bandwidth), on different links concurrently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp2.runtime import schedule
from fsdp2.tools.meta_step import Event, StepTrace


@dataclass(frozen=True)
class Collective:
    seconds: float
    link: str


@dataclass(frozen=True)
class GroupComm:
    """One group's collectives per micro-step (None: it has none of that kind)."""

    gather: Collective | None = None  # each all-gather (forward, and backward if it freed)
    reduce: Collective | None = None  # reduce-scatter of its gradients
    all_reduce: Collective | None = None  # HSDP: across replicas after the reduce-scatter; DDP: the gradients
    frees_after_forward: bool = False


@dataclass
class MicroStep:
    """Seconds of one forward + backward."""

    total: float
    compute: float  # FLOPs / rate
    tensor_parallel: float  # TP all-reduces, inline with compute
    link_busy: dict[str, float] = field(default_factory=dict)  # seconds each link carried collectives

    @property
    def exposed_comm(self) -> float:
        """Waiting for fsdp2's (or DDP's) collectives: what did not hide behind compute."""
        return max(0.0, self.total - self.compute - self.tensor_parallel)


class _Streams:
    """Clocks: when each stream is next free, and when each link is."""

    def __init__(self) -> None:
        self.compute = 0.0
        self.all_gather = 0.0
        self.reduce = 0.0
        self.link_free: dict[str, float] = {}
        self.link_busy: dict[str, float] = {}

    def run(self, op: Collective, not_before: float) -> float:
        """Start ``op`` when its link and ``not_before`` allow; return its end."""
        start = max(not_before, self.link_free.get(op.link, 0.0))
        end = start + op.seconds
        self.link_free[op.link] = end
        self.link_busy[op.link] = self.link_busy.get(op.link, 0.0) + op.seconds
        return end


def simulate(
    trace: StepTrace,
    groups: list[GroupComm],
    *,
    flops_per_second: float,
    tp_forward_seconds: float = 0.0,
    tp_backward_seconds: float = 0.0,
    reduce_window: int | None = schedule.DEFAULT_MAX_REDUCES_IN_FLIGHT,
) -> MicroStep:
    """Replay ``trace`` with ``groups``' collectives; ``reduce_window=None``: compute never waits
    for reductions before the end of backward (DDP)."""
    if len(groups) != trace.n_groups:
        raise ValueError(f"simulate: the trace has {trace.n_groups} groups, got {len(groups)}")
    hooks = trace.hook_events()
    forward_flops = sum(f for _, _, f in _through_backward_start(hooks))
    backward_flops = trace.flops - forward_flops
    s = _Streams()
    gathered: set[int] = set()
    gathering: dict[int, float] = {}  # group -> end of its issued all-gather
    copy_outs: list[float] = []  # compute times of the copy-outs (the all-gather stream's buffer rule)
    forward_order: list[int] = []
    reductions: list[float] = []
    in_backward = False
    run_ahead = False
    flop_seconds = tp_seconds = 0.0

    def spend(flops: int) -> None:
        """Compute ``flops``, with their share of the phase's TP all-reduces (inline on the compute stream)."""
        nonlocal flop_seconds, tp_seconds
        seconds = flops / flops_per_second
        share = (
            tp_backward_seconds * flops / backward_flops
            if in_backward and backward_flops
            else (tp_forward_seconds * flops / forward_flops if not in_backward and forward_flops else 0.0)
        )
        flop_seconds += seconds
        tp_seconds += share
        s.compute += seconds + share

    def issue_gather(i: int, wait_for_compute: bool) -> None:
        op = groups[i].gather
        if op is None or i in gathered or i in gathering:
            return
        ahead = schedule.GATHERS_AHEAD_OF_COMPUTE
        buffer_free = copy_outs[-ahead] if len(copy_outs) >= ahead else 0.0
        ready = max(s.all_gather, buffer_free, s.compute if wait_for_compute else 0.0)
        s.all_gather = gathering[i] = s.run(op, ready)

    def unshard(i: int, wait_for_compute: bool) -> None:
        if i in gathered:
            return
        issue_gather(i, wait_for_compute)
        if i in gathering:
            s.compute = max(s.compute, gathering.pop(i))
            copy_outs.append(s.compute)
        gathered.add(i)

    for kind, i, flops in hooks:
        spend(flops)
        if kind is Event.PRE_FORWARD:
            unshard(i, wait_for_compute=not run_ahead)
            run_ahead = True  # after the root's first gather, the rest of forward runs ahead
        elif kind is Event.POST_FORWARD:
            if groups[i].frees_after_forward:
                gathered.discard(i)
            forward_order.append(i)
        elif kind is Event.BACKWARD:
            in_backward, run_ahead = True, False
        elif kind is Event.PRE_BACKWARD:
            unshard(i, wait_for_compute=True)
            for j in schedule.implicit_backward_prefetch(forward_order, i):
                issue_gather(j, wait_for_compute=True)
        elif kind is Event.REDUCE:
            end = s.compute
            if groups[i].reduce is not None:
                end = s.run(groups[i].reduce, max(s.reduce, s.compute))
            if groups[i].all_reduce is not None:
                end = s.run(groups[i].all_reduce, max(s.reduce, end))
            if end > s.compute:
                s.reduce = end
                reductions.append(end)
                while reduce_window is not None and len(reductions) > reduce_window:
                    s.compute = max(s.compute, reductions.pop(0))
        elif kind in (Event.REDUCE_ISSUED, Event.RESHARD):
            gathered.discard(i)
        elif kind is Event.FINISH:
            s.compute = max([s.compute] + reductions)
            reductions.clear()
    spend(trace.tail_flops)
    return MicroStep(total=s.compute, compute=flop_seconds, tensor_parallel=tp_seconds, link_busy=s.link_busy)


def _through_backward_start(hooks):
    """Hook events up to BACKWARD, which carries the FLOPs of the loss after the last group."""
    for event in hooks:
        yield event
        if event[0] is Event.BACKWARD:
            return


def ring_seconds(
    nbytes: float, group_size: int, bandwidth: float, latency: float, *, all_reduce: bool = False
) -> float:
    """A ring collective of an ``nbytes`` buffer over ``group_size`` ranks."""
    if group_size <= 1 or nbytes <= 0:
        return 0.0
    factor = (2 if all_reduce else 1) * (group_size - 1) / group_size
    return latency + factor * nbytes / bandwidth
