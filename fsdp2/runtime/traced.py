"""The traced path: a group's all-gather and reduce-scatter as graph ops under ``torch.compile``.

``torch.compile(model, fullgraph=True)`` over fully_shard'ed modules traces the hooks (fsdp2's
``FSDPState`` sends them here while dynamo traces) instead of breaking the graph at each one.
Each step's collectives are functional collectives in the graph (fsdp2.runtime.traced_graph builds
a bucket's), and autograd builds the backward. How it maps to the eager path:

- gather (eager: ``GroupGather``): the group's padded shards, encoded by their codecs (cast to
  ``param_dtype`` by the default one), side by side in one row laid out as eager's
  ``GatherBucket`` (one dtype, or bytes in aligned columns; one ``traced_ops.flat_cat``), ONE
  ``all_gather_into_tensor`` per group (its ``*_out`` variant where torch traces it), and the
  unsharded parameters decoded from the rows of its output (``ShardLayout.full_from_rank_rows``,
  eager's copy-out). The modules see them in place of the shards between the group's pre- and
  post-forward hooks.
- reduce (eager: ``GroupReduce``, on its ``FlatBucket`` per reduce dtype): each bucket's
  gradient port (``traced_graph.port``, one per bucket and trace) collects the gradients of
  every use of its parameters in the trace, and its backward reduces their sum once, as eager
  reduces the sum autograd accumulated in the unsharded parameters' ``.grad``: cast to
  ``reduce_dtype``, reduce-scattered, all-reduced across replicas
  under HSDP and divided with eager's reduce ops and divisions (``GroupReduce.plan``).
  fsdp2.runtime.traced_grads hands the result to the DTensors' ``.grad`` (or keeps it, without
  gradient sync). The graph's inputs are the shards as plain tensors
  (``ShardedParam.traced_leaf``, sharing the DTensor's storage), so no DTensor is wrapped or
  unwrapped per step; they take no gradient.
- reshard after forward (eager: free, gather again in backward): the gather runs inside a
  selective activation-checkpoint region whose ops are all MUST_RECOMPUTE, so the gathered
  parameters are not saved for backward: backward gathers again. Partitioners that rematerialise
  (inductor's, ``aot_eager_decomp_partition``) honour it; aot_eager's default partitioner saves
  views of the gathered parameters taken outside the region (a ``.t()`` in ``F.linear``).
- a module run again in the same forward (a chunked loss's head per chunk, a block applied
  twice): as eager, a group that keeps its parameters after forward serves the second call with
  what it gathered; one that reshards gathers again. Both uses reach the same port.
- prefetch (eager: the all-gather stream running ahead): a group's pre-forward also gathers the
  next group (``set_modules_to_forward_prefetch``'s, else the next fully_shard'ed module in
  module order), so that group's all-gather precedes this group's compute in the graph.

What the traced path cannot express raises :class:`FSDPUsageError` at trace time (see
:func:`check_traceable`; torch.compile reports it as the exception its trace observed, and
without ``fullgraph`` runs the hooks eagerly instead); it never computes other numerics.
Dynamo guards on the settings read here, so changing one between steps retraces.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fsdp2 import compat
from fsdp2.errors import FSDPUsageError
from fsdp2.runtime import collectives, schedule, traced_graph as graph, traced_ops
from fsdp2.layout.shard_layout import rank_rows_from_subgroups
from fsdp2.runtime.buckets import FlatBucket, GatherBucket
from fsdp2.runtime.codecs import Column
from fsdp2.runtime.extensions import SubclassCodec
from fsdp2.runtime.group_step import BucketStep, Mode
from fsdp2.runtime.param_group import GroupState
from fsdp2.runtime.traced_grads import BucketGrads

if TYPE_CHECKING:
    from fsdp2.runtime.param_group import ParamGroup
    from fsdp2.runtime.sharded_param import ShardedParam


@dataclass
class _Bucket:
    """One reduce bucket in a trace: its step (eager's ``BucketStep``, the same object eager
    reduces with), the reduction a graph emits for it, and its port row's dtype (the gradients
    the modules route to it add up there): the parameters' compute dtype, or the reduce dtype
    where they have several."""

    step: BucketStep
    row_dtype: torch.dtype
    reduction: graph.BucketReduction

    @property
    def key(self) -> torch.dtype:  # the reduce dtype
        return self.step.reduce_dtype

    @property
    def flat(self) -> FlatBucket:
        return self.step.bucket

    @property
    def params(self) -> list["ShardedParam"]:
        return self.step.bucket.params

    @property
    def gathered_numel(self) -> int:
        return self.step.world * self.step.bucket.numel_per_rank

    @property
    def takes_grad(self) -> bool:
        return graph.takes_grad(self.step.grad_dtype)


@dataclass
class _InTrace:
    """What one group gathered in the forward being traced (forgotten when the trace ends)."""

    # Per bucket: its gradient port (row, marks): every gather of the bucket in this trace routes to it.
    ports: dict[torch.dtype, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)
    # What a call that keeps its parameters after forward gathered: a later call uses it (eager:
    # the group is still unsharded).
    held_after_forward: list[torch.Tensor] | None = None
    # reshard_after_forward=k: this rank's rows of the gathered row, kept for re-gathering over
    # the subgroup, and what encoding the shards gave besides (the hooks' context).
    subgroup_rows: tuple[torch.Tensor, list] | None = None


class TracedGroup:
    """The traced path of one ParamGroup: its gather as graph ops and where its gradients go.

    ``in_trace`` lives only within one trace: the root's post-forward clears it before it ends.
    """

    # Slots, not an instance dict: dynamo replays a trace's attribute writes on a slotted object
    # with plain STORE_ATTRs after the graph runs, and a dict-backed object's through a Python
    # call per attribute (``in_trace`` is written in every trace).
    __slots__ = (
        "group",
        "in_trace",
        "grads",
        "__weakref__",
    )

    def __init__(self, group: "ParamGroup"):
        self.group = group
        self.in_trace: _InTrace | None = None
        self.grads: dict[tuple, BucketGrads] = {}  # per bucket, see prepare_buckets
        self.prepare_buckets()
        # fsdp2 re-read the parameters (ShardedParam.refresh): dtypes may have changed (new buckets).
        group.on_params_refreshed = self.prepare_buckets

    def discard_pending_grads(self) -> None:
        for grads in self.grads.values():
            grads.discard()

    # -- the gather ---------------------------------------------------------------------------

    def gather(self, after_forward: schedule.AfterForward) -> list[torch.Tensor]:
        """Every parameter of the group unsharded, in ``group.params`` order: ONE all-gather of the
        group's row (two with ``reshard_after_forward=k``, see :meth:`_gather_keeping_rows`)."""
        params = self.group.params
        if not params:
            return []
        in_trace = self.enter_trace()
        if in_trace.held_after_forward is not None:  # gathered earlier in this forward, and held
            return in_trace.held_after_forward
        buckets = self._buckets()
        with_grad = torch.is_grad_enabled()
        ports = [self._port(bucket, in_trace) if with_grad and bucket.takes_grad else None for bucket in buckets]
        # Passed in (not read inside): a checkpoint region's inputs are its arguments.
        port_tensors = [t for port in ports if port is not None for t in (port[0], *port[1])]
        shards = [p.traced_leaf for p in params]
        route = functools.partial(self._routed_params, buckets, ports, counted=bool(collectives.active_counters))
        # The group's all-gather settings, whatever it reduces (a group of frozen parameters reduces nothing).
        gather = self.group.gather
        settings = graph.GatherSettings(
            gather.out_collectives, bool(collectives.active_counters), gather.custom_all_gather_key
        )
        if after_forward is schedule.AfterForward.KEEP_SUBGROUP_SHARD:
            gathered = self._gather_keeping_rows(shards, route, port_tensors, settings)
        elif after_forward is schedule.AfterForward.FREE:
            run = functools.partial(self._gather_and_route, route, settings=settings, regathers=True)
            region = checkpoint(
                run, *port_tensors, *shards, use_reentrant=False, context_fn=graph.recompute_in_backward
            )
            gathered = list(region)
        else:
            gathered = self._gather_and_route(route, *port_tensors, *shards, settings=settings, regathers=False)
        if after_forward is schedule.AfterForward.KEEP and with_grad:
            in_trace.held_after_forward = gathered
        return gathered

    def enter_trace(self) -> _InTrace:
        """This group's record of the forward being traced (made by its first gather; its call is
        in ``_trace.touched`` then, which clears it at the end)."""
        if self.in_trace is None:
            self.in_trace = _InTrace()
        return self.in_trace

    def _port(self, bucket: _Bucket, in_trace: _InTrace) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The bucket's gradient port in this trace (made by its first gather)."""
        port = in_trace.ports.get(bucket.key)
        if port is not None:
            return port
        grads = self.grads.get(bucket.key)
        if grads is None or not grads.serves(bucket.step):
            # Its gradient would be dropped: the sinks follow the buckets through refresh_params.
            raise FSDPUsageError(
                f"torch.compile over fully_shard({self.group.name}): its parameters changed dtype or shape "
                "without fsdp2 re-reading them; convert the model with module.to()/load_state_dict, not in place."
            )
        r = bucket.reduction
        port = graph.port(
            grads.sink(r.mode), grads.anchor, grads.key, r, bucket.gathered_numel, bucket.row_dtype, len(bucket.params)
        )
        in_trace.ports[bucket.key] = port
        return port

    # -- one all-gather of the group's row ---------------------------------------------------------

    def _encoded(self, shards: list[torch.Tensor]):
        """Each parameter's wire tensors and context (its codec's ``encode``), the group's gather
        bucket for them (eager's ``GatherBucket``: one dtype, or bytes in aligned columns) and this
        rank's row of it."""
        params, gather = self.group.params, self.group.gather
        encoded = [p.codec.encode(shard) for p, shard in zip(params, shards)]
        if gather.layout_fixed:
            (bucket,) = gather.buckets
        else:  # a tensor subclass's hook decides its columns: as this trace's encoding gave them
            bucket = GatherBucket(params, [tuple(Column(t.dtype, t.numel()) for t in wire) for wire, _ in encoded])
        # One op, not torch.cat (see traced_ops); it flattens the pieces itself.
        flat = graph.flat(bucket.row_pieces([t for tensors, _ in encoded for t in tensors]))
        return encoded, bucket, flat

    @staticmethod
    def _decoded(encoded, bucket: GatherBucket, rows: torch.Tensor, shards) -> list[torch.Tensor]:
        """Each parameter unsharded from the gathered ``rows`` (``world x row``): its codec's
        ``decode`` of its columns, viewed as their dtypes (``GatherBucket.pieces``)."""
        return [
            p.codec.decode(shard, tensors, context, typed)
            for (p, typed), shard, (tensors, context) in zip(bucket.pieces(rows), shards, encoded)
        ]

    @staticmethod
    def _all_gather(flat: torch.Tensor, world: int, group: str, settings: graph.GatherSettings) -> torch.Tensor:
        return graph.all_gather(flat, world, group, settings)

    def _gather_and_route(
        self, route, *tensors: torch.Tensor, settings: graph.GatherSettings, regathers: bool
    ) -> list[torch.Tensor]:
        """``tensors``: each port's row and marks (see ``gather``), then every parameter's shard:
        encode, ONE all-gather, decode, route the gradients (in a region backward recomputes when
        ``regathers``)."""
        n = len(self.group.params)
        port_tensors, shards = tensors[: len(tensors) - n], list(tensors[len(tensors) - n :])
        encoded, bucket, flat = self._encoded(shards)
        dp = self.group.dp
        gathered = self._all_gather(flat, dp.shard_size, dp.shard_group.group_name, settings)
        rows = gathered.view(dp.shard_size, -1)
        values = self._decoded(encoded, bucket, rows, shards)
        regathered = collectives.comm_bytes("all_gather", flat, dp.shard_size) if regathers else 0
        return route(values, port_tensors, regathered)

    def _gather_keeping_rows(
        self, shards: list[torch.Tensor], route, port_tensors: list, settings: graph.GatherSettings
    ) -> list[torch.Tensor]:
        """``reshard_after_forward=k`` (eager: keep this rank's 1/k of the gathered rows, re-gather
        over its k-rank subgroup in backward) as two gathers that together move the bytes of one:
        over the ranks at this rank's subgroup position (``Subgroup.across``), which yields exactly
        the rows eager keeps and is saved for backward; then over the subgroup, in a region that
        backward recomputes from the kept rows. A second call in the same forward re-gathers over
        the subgroup from the same kept rows, as eager does."""
        subgroup, world = self.group.reshard_after_forward.subgroup, self.group.dp.shard_size
        in_trace = self.in_trace
        if in_trace.subgroup_rows is None:
            encoded, bucket, flat = self._encoded(shards)
            kept = self._all_gather(flat, world // subgroup.size, subgroup.across.group_name, settings)
            in_trace.subgroup_rows = (kept, (encoded, bucket))
        kept, layout = in_trace.subgroup_rows

        def unshard(kept: torch.Tensor, *port_tensors: torch.Tensor) -> list[torch.Tensor]:
            gathered = self._all_gather(kept, subgroup.size, subgroup.group.group_name, settings)
            rows = rank_rows_from_subgroups(gathered, subgroup.size, world)
            values = self._decoded(*layout, rows, shards)
            return route(values, list(port_tensors), collectives.comm_bytes("all_gather", kept, subgroup.size))

        return list(
            checkpoint(unshard, kept, *port_tensors, use_reentrant=False, context_fn=graph.recompute_in_backward)
        )

    # -- routing gradients to the ports ------------------------------------------------------------

    def _routed_params(
        self, buckets: list[_Bucket], ports: list, values, port_tensors, regathered: int, counted: bool
    ) -> list:
        """``values`` (the unsharded parameters, ``group.params`` order) as the modules see them:
        each one's gradient to its block of its bucket's port row and a mark (``ports`` again, from
        ``port_tensors``: a region's inputs), TP parameters as DTensors. ``regathered``: the bytes
        backward gathers again (recorded inside ``count_comm``)."""
        tensors = iter(port_tensors)
        index = {id(p): i for i, p in enumerate(self.group.params)}
        routed = list(values)
        counted = regathered and counted
        for bucket, port in zip(buckets, ports):
            if port is None:
                continue
            row, marks = next(tensors), [next(tensors) for _ in port[1]]
            if counted:  # recorded by the backward of the first port (a recomputed region's own record is not)
                row, counted = graph.RecordRegather.apply(row, regathered), False
            carriers = bucket.flat.columns(row.view(bucket.step.world, -1))
            for (p, carried), mark in zip(carriers, marks):
                i = index[id(p)]
                routed[i] = graph.GradientFrom.apply(p.layout.full_from_rank_rows(carried), routed[i], mark)
        # TP modules compute on DTensors (eager: ShardedParam wraps the same way); from_local's
        # backward turns a pending-sum gradient into these placements, as eager's local_grad.
        return [
            full if p.tensor_parallel is None else p.tensor_parallel.wrap(full)
            for p, full in zip(self.group.params, routed)
        ]

    def reduce_steps(self) -> list[BucketStep]:
        """Eager's reduce steps of the group's trainable parameters (a frozen parameter's gradient
        is neither computed nor reduced; the flags read are guarded)."""
        group = self.group
        return group.reduce.steps_of(tuple([p.trainable for p in group.params]))

    def _buckets(self) -> list[_Bucket]:
        """The group's reduce steps as this trace emits them."""
        group = self.group
        reduce = group.reduce
        # Read in every trace (dynamo guards on it): entering count_comm retraces into a counting graph.
        counted = bool(collectives.active_counters)
        # Sums kept for this accumulation, by eager or compiled microbatches (guarded too): a synced graph takes them.
        unsynced_sums, partial_sums = reduce.holds_unsynced_sums, reduce.holds_partial_sums
        mode = group.mode
        # set_reduce_scatter_unused_params(True): which parameters a rank's forward used may differ
        # across ranks, and a graph's backward reduces only what it reached, so the graph hands such a
        # group's gradient on unreduced (as without sync) and the end of the backward reduces it on
        # every rank alike (FSDPState.compiled_backward_runs), as eager's end of backward does.
        graph_mode = Mode.UNSYNCED if reduce.include_unused else mode
        # Every use's gradient is summed in the port row before the reduction, in the dtype eager
        # sums it in the unsharded parameter (ShardedParam.summed_in, under the settings' mode), or
        # the reduce dtype where the parameters have several.
        synced, starts_sum = mode is not Mode.UNSYNCED, mode is Mode.UNSYNCED and not unsynced_sums
        buckets = []
        for step in self.reduce_steps():
            reduction = graph.BucketReduction(
                step.spec,
                counted=counted,
                mode=graph_mode,
                takes_unsynced=graph_mode is not Mode.UNSYNCED and unsynced_sums,
                takes_partial=graph_mode is Mode.SYNCED and partial_sums,
                include_unused=reduce.include_unused,
            )
            dtypes = {p.summed_in(synced, starts_sum) or p.param_dtype for p in step.bucket.params}
            row_dtype = dtypes.pop() if len(dtypes) == 1 else step.reduce_dtype
            buckets.append(_Bucket(step, row_dtype, reduction))
        return buckets

    # -- where gradients go ---------------------------------------------------------------------

    def prepare_buckets(self) -> None:
        """Eager (at fully_shard and whenever the parameters or the reduction's hook change): per
        bucket its :class:`BucketGrads`. A bucket whose parameters, dtypes and hook are unchanged
        keeps its own: re-reading parameters also happens inside functorch transforms
        (``torch.func.jvp`` over the module), where no new leaf may be made; and the sums it keeps
        for the next synced backward stay."""
        grads = {}
        group = self.group
        frozen = tuple(p for p in group.params if not p.trainable)
        for step in self.reduce_steps():
            if not graph.takes_grad(step.grad_dtype):
                continue
            current = self.grads.get(step.reduce_dtype)
            if current is None or not current.serves(step):
                current = BucketGrads(step, group, frozen)
            else:
                current.take_params()
            grads[step.reduce_dtype] = current
        self.grads = grads

    def after_forward(self, is_root: bool) -> schedule.AfterForward:
        """What backward finds of this forward's gather (eager: what the group keeps after forward)."""
        if not torch.is_grad_enabled():
            return schedule.AfterForward.KEEP  # no backward: nothing is saved anyway
        if self.group.reduce.include_unused:
            # A graph's backward gathers again only what it needs, which depends on what this
            # rank's forward used; under set_reduce_scatter_unused_params(True) that may differ
            # across ranks, so the group stays gathered to its backward: the same collectives on
            # every rank.
            return schedule.AfterForward.KEEP
        return self.group.reshard_after_forward.action_for(is_root)


class TracedCall:
    """The traced path of one fully_shard call: its modules, its groups (one per mesh its
    parameters are sharded on), and what the modules see while its forward runs in a trace.

    ``held`` (per group, the gathered parameters while the call's forward runs), ``prefetched`` and
    ``ran`` live only within one trace: the root's post-forward clears them before it ends.
    """

    __slots__ = (
        "modules",
        "groups",
        "next",
        "prefetched",
        "held",
        "modules_left",
        "ran",
        "_held_dicts",
        "_holds",
        "__weakref__",
    )

    def __init__(self, modules: tuple[nn.Module, ...], groups: list[TracedGroup]):
        self.modules = modules
        self.groups = groups
        self.next: TracedCall | None = None  # the next call in module order (implicit prefetch)
        self.prefetched: list[list[torch.Tensor]] | None = None
        self.held: list[list[torch.Tensor]] | None = None
        self.modules_left = 0
        self.ran = False  # one of its modules ran in this trace (not only prefetched)
        self._held_dicts: list[tuple[nn.Module, dict]] = []  # see hold
        # Per module holding the call's parameters, decided once (a trace then reads no DTensor):
        # (module, {managed name: its index among the gathered parameters}, [(name, that index, or
        # None for a parameter fsdp2 does not manage)] in the module's order).
        self._holds: list[tuple[nn.Module, dict[str, int], list[tuple[str, int | None]]]] = []
        by_module: dict[nn.Module, dict[str, int]] = {}
        params = [p for traced in groups for p in traced.group.params]
        for i, p in enumerate(params):
            for slot in p.slots:
                by_module.setdefault(slot.module, {})[slot.name] = i
        for module, managed in by_module.items():
            names = list(compat.held_parameter_registry(module))
            self._holds.append((module, managed, [(name, managed.get(name)) for name in names]))

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
            check_traceable(traced)
        return [traced.gather(traced.after_forward(is_root)) for traced in self.groups]

    # -- what the modules see -----------------------------------------------------------------

    def hold(self, gathered: list[list[torch.Tensor]]) -> None:
        """The modules see the gathered parameters: each module's ``_parameters`` dict is swapped
        for a new one, once for all the call's groups (``release`` puts the original object back),
        so the trace never reads the DTensor parameters, and dynamo installs no guard (a Python
        DTensor spec check) on them."""
        self.held = gathered
        flat = [tensor for unsharded in gathered for tensor in unsharded]
        for module, managed, entries in self._holds:
            original = compat.held_parameter_registry(module)
            if len(original) != len(entries):  # a parameter registered on the module since fully_shard
                entries = [(name, managed.get(name)) for name in original]
            registry = {}
            for name, index in entries:  # in the module's order; None: a parameter fsdp2 does not manage
                registry[name] = original[name] if index is None else flat[index]
            compat.set_parameter_registry(module, registry)
            self._held_dicts.append((module, original))

    def release(self) -> None:
        self.held = None
        self.modules_left = 0
        for module, original in self._held_dicts:
            compat.set_parameter_registry(module, original)
        self._held_dicts = []


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


def check_traceable(traced: TracedGroup) -> None:
    """Refuse, naming the module and the way out, what the traced path cannot do as eager does."""
    group = traced.group
    where = f"torch.compile over fully_shard({group.name})"
    problem = None
    if collectives.active_counters and not traced_ops.records_comm:
        problem = "fsdp2.tools.comm_stats.count_comm() around a compiled step on this torch (no ordered effects)"
    elif any(p.tensor_parallel is not None and p.tensor_parallel.data_parallel_mesh_dims for p in group.params):
        problem = "parameters on the full SPMD mesh (dp_mesh_dims)"
    elif any(isinstance(p.codec, SubclassCodec) and p.tensor_parallel is not None for p in group.params):
        # The hooks run on a copy of the shard without torchao's precomputed scale (its detach
        # drops it), so they scale each TP shard by its own amax, where eager scales the whole weight.
        problem = "a tensor subclass's own all-gather (torchao's float8 all-gather) on tensor-parallel parameters"
    elif any(step.plan.reduce_scatter_op.functional_name is None for step in traced.reduce_steps()):
        problem = (
            "set_gradient_divide_factor on NCCL (its PREMUL_SUM reduce op has no functional collective; "
            "set_force_sum_reduction_for_comms(True) divides in a separate op)"
        )
    replaced = []
    if group.params_replaced:  # read in every trace: dynamo guards on it, so a replacement retraces
        replaced = [p.fqn for p in group.params if p.registered_replacement() is not None]
    if problem is None and replaced:
        # Eager fsdp2 takes such a parameter over at its first forward (ShardedParam.refresh).
        problem = (
            f"parameter {replaced[0]} replaced by assignment after fully_shard (load_state_dict takes it over; "
            "so does one eager forward)"
        )
    if problem is not None:
        raise FSDPUsageError(
            f"{where}: {problem} is not supported on the traced path (fullgraph). Remove it, or compile "
            "each block instead (block.compile()), which keeps fsdp2's hooks eager."
        )
    check_no_eager_state(traced)


def check_no_eager_state(traced: TracedGroup) -> None:
    """Refuse a compiled step that would ignore what an eager call left in the group: the traced
    path gathers from the shards, so eager's gathered parameters would silently not take part
    (sums kept for an accumulation do: see fsdp2.runtime.traced_grads). Each read here is guarded:
    the eager call that changes it makes the next compiled call retrace into this."""
    group = traced.group
    where = f"torch.compile over fully_shard({group.name})"
    # The setting before the state it leaves behind: an eager step with it leaves the group gathered.
    if not group.reshard_after_backward:
        raise FSDPUsageError(
            f"{where}: set_reshard_after_backward(False) keeps the gathered parameters for the next step, "
            "which eager and PyTorch's FSDP2 then compute with (not the optimizer's update); the compiled "
            "step gathers afresh. Compile with the default (True), or run these steps eagerly."
        )
    if group.state is not GroupState.SHARDED:
        raise FSDPUsageError(
            f"{where}: its parameters are gathered outside the compiled step (unshard()); the compiled step "
            "gathers its own and would leave these registered. Call reshard() on the module before the "
            "compiled step."
        )
