"""The traced path: each group's step as graph ops while dynamo traces ``torch.compile(model,
fullgraph=True)`` over fully_shard'ed modules (fsdp2's ``FSDPState`` sends its hooks here).

A group's step is its ``GroupStep`` (fsdp2.runtime.group_step), the one eager runs. A call's
forward gathers each group with ONE all-gather of a row laid out as eager's ``GatherBucket`` (the
codecs' ``encode``, then ``decode`` of the gathered rows) and shows the modules the unsharded
parameters in place of the shards (:class:`TracedCall`, ``_parameters`` swapped); each reduce
bucket's gradient port (fsdp2.runtime.traced_graph) sums every use of its parameters and its
backward emits the bucket's ``BucketStep``, handed to the group's gradient store through its sinks
(fsdp2.runtime.grad_sinks). Reshard after forward: the gather runs in a selective
activation-checkpoint region that backward recomputes (``k``: over the ranks at this rank's
subgroup position, then over the subgroup). A module called twice in one forward is served as
eager serves it. docs/compile.md tells the whole mapping. What the traced path cannot do as eager
does is refused at trace time (fsdp2.runtime.compile_limits); dynamo guards on what is read here,
so a changed setting retraces.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fsdp2.layout.shard_layout import rank_rows_from_subgroups
from fsdp2.runtime import collectives, schedule, traced_graph as graph
from fsdp2.runtime.compile_limits import check_traceable
from fsdp2.runtime.grad_sinks import takes_grad
from fsdp2.runtime.group_step import Mode
from fsdp2.runtime.param_slots import RegistrySwap

if TYPE_CHECKING:
    from fsdp2.runtime.param_group import ParamGroup


@dataclass
class _InTrace:
    """What one group gathered in the forward being traced (forgotten when the trace ends)."""

    # Per reduce dtype: its gradient port (row, marks): every gather of the bucket in this trace routes to it.
    ports: dict[torch.dtype, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)
    # What a call that keeps its parameters after forward gathered: a later call uses it (eager:
    # the group is still unsharded).
    held_after_forward: list[torch.Tensor] | None = None
    # reshard_after_forward=k: this rank's subgroup rows of the gathered row, saved for backward's
    # re-gather over the subgroup, and the encoding that made them.
    subgroup_rows: tuple[torch.Tensor, tuple] | None = None


class TracedGroup:
    """One ParamGroup's step emitted into the graph being traced. ``in_trace`` lives only within
    one trace: the root's post-forward clears it before it ends."""

    # Slots, not an instance dict: dynamo replays a trace's attribute writes on a slotted object
    # with plain STORE_ATTRs after the graph runs, a dict-backed object's through a Python call each.
    __slots__ = ("group", "in_trace", "__weakref__")

    def __init__(self, group: "ParamGroup"):
        self.group = group
        self.in_trace: _InTrace | None = None

    def gather(self, after_forward: schedule.AfterForward) -> list[torch.Tensor]:
        """Every parameter of the group unsharded, in ``group.params`` order: ONE all-gather of the
        group's row (two with ``reshard_after_forward=k``, see :meth:`_gather_keeping_rows`)."""
        group = self.group
        if not group.params:
            return []
        in_trace = self.enter_trace()
        if in_trace.held_after_forward is not None:  # gathered earlier in this forward, and held
            return in_trace.held_after_forward
        # Read in every trace (dynamo guards on it): entering count_comm retraces into a counting graph.
        counted = bool(collectives.active_counters)
        with_grad = torch.is_grad_enabled()
        ports = self._ports(in_trace, counted) if with_grad else []
        # Passed in (not read inside): a checkpoint region's inputs are its arguments.
        port_tensors = [t for _, (row, marks) in ports for t in (row, *marks)]
        shards = [p.traced_leaf for p in group.params]
        route = functools.partial(self._routed_params, ports, counted=counted)
        gather = functools.partial(graph.all_gather, step=group.step.gather, counted=counted)
        if after_forward is schedule.AfterForward.KEEP_SUBGROUP_SHARD:
            gathered = self._gather_keeping_rows(shards, route, port_tensors, gather)
        elif after_forward is schedule.AfterForward.FREE:
            run = functools.partial(self._gather_and_route, route, gather=gather, regathers=True)
            region = checkpoint(
                run, *port_tensors, *shards, use_reentrant=False, context_fn=graph.recompute_in_backward
            )
            gathered = list(region)
        else:
            gathered = self._gather_and_route(route, *port_tensors, *shards, gather=gather, regathers=False)
        if after_forward is schedule.AfterForward.KEEP and with_grad:
            in_trace.held_after_forward = gathered
        return gathered

    def enter_trace(self) -> _InTrace:
        """This group's record of the forward being traced (made by its first gather; its call is
        in ``_trace.touched`` then, which clears it at the end)."""
        if self.in_trace is None:
            self.in_trace = _InTrace()
        return self.in_trace

    def after_forward(self, is_root: bool) -> schedule.AfterForward:
        """What backward finds of this forward's gather (eager: what the group keeps after forward)."""
        if not torch.is_grad_enabled():
            return schedule.AfterForward.KEEP  # no backward: nothing is saved anyway
        step = self.group.step
        if step.include_unused:
            # A graph's backward gathers again only what this rank's forward used, which may differ
            # across ranks here: the group stays gathered to its backward, the same collectives on
            # every rank.
            return schedule.AfterForward.KEEP
        return step.after_forward_for(is_root)

    # -- the gradient ports --------------------------------------------------------------------------

    def _ports(self, in_trace: _InTrace, counted: bool) -> list:
        """Per reduce step of the group (its ``GroupStep``'s) that takes gradients: the step and its
        port in this trace (made by the bucket's first gather), where every use's gradient is summed
        before the reduction (``BucketStep.summed_dtype``)."""
        group = self.group
        step, reduce = group.step, group.reduce
        # Sums kept for this accumulation, by eager or compiled microbatches (guarded too): a synced graph takes them.
        unsynced_sums, partial_sums = reduce.holds_unsynced_sums, reduce.holds_partial_sums
        # set_reduce_scatter_unused_params(True): which parameters a rank's forward used may differ
        # across ranks, and a graph's backward reduces only what it reached, so the graph hands such a
        # group's gradient on unreduced (as without sync) and the end of the backward reduces it on
        # every rank alike (FSDPState.compiled_backward_runs), as eager's end of backward does.
        mode = Mode.UNSYNCED if step.include_unused else step.mode
        synced, starts_sum = step.mode is not Mode.UNSYNCED, step.mode is Mode.UNSYNCED and not unsynced_sums
        ports = []
        for bucket_step in step.reduce_steps:
            if not takes_grad(bucket_step.grad_dtype):
                continue
            port = in_trace.ports.get(bucket_step.reduce_dtype)
            if port is None:
                reduction = graph.BucketReduction(
                    bucket_step.spec,
                    counted=counted,
                    mode=mode,
                    takes_unsynced=mode is not Mode.UNSYNCED and unsynced_sums,
                    takes_partial=mode is Mode.SYNCED and partial_sums,
                    include_unused=step.include_unused,
                )
                sinks, dtype = group.sinks.of(bucket_step), bucket_step.summed_dtype(synced, starts_sum)
                numel, params = bucket_step.world * bucket_step.bucket.numel_per_rank, len(bucket_step.bucket.params)
                port = graph.port(sinks.sink(mode), sinks.anchor, sinks.key, reduction, numel, dtype, params)
                in_trace.ports[bucket_step.reduce_dtype] = port
            ports.append((bucket_step, port))
        return ports

    def _routed_params(self, ports: list, values, port_tensors, regathered: int, counted: bool) -> list:
        """``values`` (the unsharded parameters, ``group.params`` order) as the modules see them:
        each one's gradient to its block of its bucket's port row and a mark (``ports`` again, from
        ``port_tensors``: a region's inputs), TP parameters as DTensors. ``regathered``: the bytes
        backward gathers again (recorded inside ``count_comm``)."""
        tensors = iter(port_tensors)
        params = self.group.params
        index = {id(p): i for i, p in enumerate(params)}
        routed = list(values)
        counted = regathered and counted
        for bucket_step, (_, marks) in ports:
            row, marks = next(tensors), [next(tensors) for _ in marks]
            if counted:  # recorded by the backward of the first port (a recomputed region's own record is not)
                row, counted = graph.RecordRegather.apply(row, regathered), False
            carriers = bucket_step.bucket.columns(row.view(bucket_step.world, -1))
            for (p, carried), mark in zip(carriers, marks):
                i = index[id(p)]
                routed[i] = graph.GradientFrom.apply(p.layout.full_from_rank_rows(carried), routed[i], mark)
        # TP modules compute on DTensors (eager: ShardedParam wraps the same way); from_local's
        # backward turns a pending-sum gradient into these placements, as eager's local_grad.
        return [full if p.tensor_parallel is None else p.tensor_parallel.wrap(full) for p, full in zip(params, routed)]

    # -- one all-gather of the group's row -----------------------------------------------------------

    def _gather_and_route(self, route, *tensors: torch.Tensor, gather, regathers: bool) -> list[torch.Tensor]:
        """``tensors``: each port's row and marks (see ``gather``), then every parameter's shard:
        encode, ONE all-gather, decode, route the gradients (in a region backward recomputes when
        ``regathers``)."""
        n = len(self.group.params)
        port_tensors, shards = tensors[: len(tensors) - n], list(tensors[len(tensors) - n :])
        group = self.group
        encoded, bucket, pieces = group.gather.encode_row(shards)
        dp, flat = group.dp, graph.flat(pieces)
        rows = gather(flat, dp.shard_size, dp.shard_group.group_name).view(dp.shard_size, -1)
        values = group.gather.decode_rows(encoded, bucket, rows, shards)
        regathered = collectives.comm_bytes("all_gather", flat, dp.shard_size) if regathers else 0
        return route(values, port_tensors, regathered)

    def _gather_keeping_rows(self, shards: list[torch.Tensor], route, port_tensors: list, gather) -> list[torch.Tensor]:
        """``reshard_after_forward=k`` (eager: keep this rank's 1/k of the gathered rows, re-gather
        over its k-rank subgroup in backward) as two gathers that together move the bytes of one:
        over the ranks at this rank's subgroup position (``Subgroup.across``), which yields exactly
        the rows eager keeps and is saved for backward; then over the subgroup, in a region that
        backward recomputes from the subgroup rows. A second call in the same forward re-gathers over
        the subgroup from the same subgroup rows, as eager does."""
        subgroup, world = self.group.reshard_after_forward.subgroup, self.group.dp.shard_size
        in_trace = self.in_trace
        if in_trace.subgroup_rows is None:
            encoded, bucket, pieces = self.group.gather.encode_row(shards)
            rows = gather(graph.flat(pieces), world // subgroup.size, subgroup.across.group_name)
            in_trace.subgroup_rows = (rows, (encoded, bucket))
        rows, layout = in_trace.subgroup_rows

        def unshard(rows: torch.Tensor, *port_tensors: torch.Tensor) -> list[torch.Tensor]:
            gathered = gather(rows, subgroup.size, subgroup.group.group_name)
            rank_rows = rank_rows_from_subgroups(gathered, subgroup.size, world)
            values = self.group.gather.decode_rows(*layout, rank_rows, shards)
            return route(values, list(port_tensors), collectives.comm_bytes("all_gather", rows, subgroup.size))

        return list(
            checkpoint(unshard, rows, *port_tensors, use_reentrant=False, context_fn=graph.recompute_in_backward)
        )


class TracedCall:
    """The traced path of one fully_shard call: its modules, its groups (one per mesh its
    parameters are sharded on), and what the modules see while its forward runs in a trace.

    ``held`` (per group, the gathered parameters while the call's forward runs), ``prefetched`` and
    ``ran`` live only within one trace: the root's post-forward clears them before it ends.
    """

    __slots__ = ("modules", "groups", "next", "prefetched", "held", "modules_left", "ran", "_registries", "__weakref__")

    def __init__(self, modules: tuple[nn.Module, ...], groups: list[TracedGroup]):
        self.modules = modules
        self.groups = groups
        self.next: TracedCall | None = None  # the next call in module order (implicit prefetch)
        self.prefetched: list[list[torch.Tensor]] | None = None
        self.held: list[list[torch.Tensor]] | None = None
        self.modules_left = 0
        self.ran = False  # one of its modules ran in this trace (not only prefetched)
        # The modules' parameter registries, swapped for the gathered parameters while the call runs.
        self._registries = RegistrySwap([p.slots for traced in groups for p in traced.group.params])

    def pre_forward(self, forward_prefetch: list["TracedCall"]) -> None:
        """Before one of the call's modules runs: gather its groups (unless held), then prefetch."""
        if self.held is not None:
            return
        is_root = _trace.root is None
        if is_root:
            _trace.root = self  # the first call of this forward keeps its parameters (eager's root)
        self._enter_trace()
        again, self.ran = self.ran, True  # run again in this forward (eager: its forward starts anew)
        for traced in self.groups:
            if traced.group.reduce.include_unused:
                # As eager's hold of the gathered parameters: dynamo replays the store after each
                # run of the graph, so the end of its backward reduces the group's unused zeros.
                traced.group.reduce.gathered_before = True
        self.hold(self.gather(is_root))
        self.modules_left = len(self.modules)
        # Module order says what comes next only the first time round.
        targets = forward_prefetch or ([self.next] if self.next is not None and not again else [])
        for other in targets:
            if other.held is None and other.prefetched is None:
                other._enter_trace()
                other.prefetched = other.gather(is_root=False)

    def post_forward(self) -> bool:
        """After one of the call's modules: the last one releases the call (the root: all, and
        True: the traced forward ends here)."""
        if self.held is None:
            return False
        self.modules_left -= 1
        if self.modules_left > 0:
            return False
        self.release()
        if _trace.root is self:
            # Nothing gathered outlives the trace: a prefetch no module used is dropped, a call
            # some of whose modules never ran is released.
            for other in _trace.touched:
                other.prefetched = None
                other.ran = False
                for traced in other.groups:
                    traced.in_trace = None
                if other.held is not None:
                    other.release()
            _trace.touched.clear()
            _trace.root = None
            return True
        return False

    def _enter_trace(self) -> None:
        if self not in _trace.touched:  # cleared when the trace's root call ends its forward
            _trace.touched.append(self)

    def gather(self, is_root: bool) -> list[list[torch.Tensor]]:
        """Each group's parameters, unsharded (prefetched ones as they were gathered)."""
        if self.prefetched is not None:
            gathered, self.prefetched = self.prefetched, None
            return gathered
        for traced in self.groups:
            check_traceable(traced.group)
        return [traced.gather(traced.after_forward(is_root)) for traced in self.groups]

    def hold(self, gathered: list[list[torch.Tensor]]) -> None:
        """The modules see the gathered parameters (``release`` puts the shards back)."""
        self.held = gathered
        self._registries.swap_in([tensor for unsharded in gathered for tensor in unsharded])

    def release(self) -> None:
        self.held = None
        self.modules_left = 0
        self._registries.restore()


class _TraceScope:
    """The forward being traced: its first call (the root) and the calls gathered in it."""

    __slots__ = ("root", "touched")  # see TracedGroup's

    def __init__(self) -> None:
        self.root: TracedCall | None = None
        self.touched: list[TracedCall] = []


_trace = _TraceScope()


def link_forward_order(calls: list[TracedCall]) -> None:
    """Each call's implicit prefetch target: the next one in module (pre-)order."""
    for first, second in zip(calls, calls[1:]):
        first.next = second
    if calls:
        calls[-1].next = None
