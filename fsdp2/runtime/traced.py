"""The traced path: a group's all-gather and reduce-scatter as graph ops under ``torch.compile``.

``torch.compile(model, fullgraph=True)`` over fully_shard'ed modules traces the hooks (fsdp2's
``FSDPState`` sends them here while dynamo traces) instead of breaking the graph at each one.
Nothing here keeps eager state: each step's collectives are functional collectives in the graph
(fsdp2.runtime.traced_graph builds a bucket's), and autograd builds the backward. How it maps to
the eager path:

- gather (eager: ``GroupGather``): the group's padded shards, cast to ``param_dtype``, side by
  side in one flat row (the layout of ``GatherBucket``: parameter after parameter; one
  ``traced_ops.flat_cat``), ONE ``all_gather_into_tensor`` per group and dtype (its ``*_out``
  variant where torch traces it), and the unsharded parameters as the rows of its
  output (``ShardLayout.full_from_rank_rows``, eager's copy-out). The modules see them in place
  of the shards between the group's pre- and post-forward hooks.
- reduce (eager: ``GroupReduce``): the all-gather's backward. Autograd hands it the gradient of
  the gathered row, which is eager's reduce-scatter input (same layout, padding zeroed); it is
  cast to ``reduce_dtype``, reduce-scattered, all-reduced across replicas under HSDP and divided
  with eager's reduce ops and divisions (``GroupReduce.plan``), then cast to the shard's dtype.
  The graph's inputs are the shards as plain tensors (``ShardedParam.traced_leaf``, sharing the
  DTensor's storage), so no DTensor is wrapped or unwrapped per step. They take no gradient: the
  bucket's reduced flat shard goes to one leaf per bucket (its grad sink), whose hook writes every
  parameter's DTensor ``.grad`` in one call (added to one already there, as eager), so the
  compiled backward returns one tensor per bucket, not a view per parameter.
- reshard after forward (eager: free, gather again in backward): the gather runs inside a
  selective activation-checkpoint region whose ops are all MUST_RECOMPUTE, so the gathered
  parameters are not saved for backward: backward gathers again. Partitioners that rematerialise
  (inductor's, ``aot_eager_decomp_partition``) honour it; aot_eager's default partitioner saves
  views of the gathered parameters taken outside the region (a ``.t()`` in ``F.linear``).
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
import weakref
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fsdp2 import compat
from fsdp2.errors import FSDPUsageError
from fsdp2.runtime import collectives, schedule, traced_graph as graph, traced_ops
from fsdp2.runtime.codecs import QuantizedCodec
from fsdp2.runtime.extensions import SubclassCodec
from fsdp2.runtime.param_group import GroupState
from fsdp2.runtime.sharded_param import accumulate_sharded_grads

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from fsdp2.runtime.param_group import ParamGroup
    from fsdp2.runtime.sharded_param import ShardedParam


@dataclass
class _Bucket:
    """Parameters gathered in one collective: one per group unless dtypes differ."""

    key: tuple
    params: list["ShardedParam"]
    param_dtype: torch.dtype
    reduction: graph.Reduction
    encoded: bool  # travels encoded: a subclass's hooks or the quantized all-gather (_gather_encoded)

    @property
    def gathered_numel(self) -> int:
        return self.reduction.world * sum(p.layout.padded_shard_numel for p in self.params)

    @property
    def sink_numel(self) -> int:
        """The reduced flat shard, then the tail of :func:`_reduce_gathered_grad`."""
        return self.gathered_numel // self.reduction.world + len(self.params) + 1


class _GradHandOff:
    """A bucket's reduced flat shard (``padded_shard_numel`` per parameter, parameter after
    parameter) to its parameters' DTensor ``.grad``, as eager's post-backward writes them: one
    call per bucket (autograd's hook on its grad sink), with no Python call per parameter in the
    common case (no padding on this rank, first gradients, none frozen) beyond constructing each
    gradient DTensor: the checks run as plain loops, which make no calls."""

    def __init__(self, key: tuple, params: tuple["ShardedParam", ...], group: "TracedGroup"):
        self.key = key  # the bucket's, for its partial sums
        self.params = params
        self.group = group  # its sums of backwards without sync are added in now
        self.widths = [p.layout.padded_shard_numel for p in params]
        # No padding on this rank: the reduced flat shard is the local shards back to back.
        self.packed = all(p.layout.local_rows == p.layout.chunk and not p.offload for p in params)
        self.shapes = [torch.empty(p.layout.local_shape, dtype=p.orig_dtype, device="meta") for p in params]
        # Which parameters the backwards without gradient sync since the last synced one reached.
        self.used_before: list[float] | None = None
        self.tail = len(params) + 1  # see _reduce_gathered_grad
        self.take_params()

    def take_params(self) -> None:
        """Note the parameters' DTensors: at construction and whenever fsdp2 re-reads them (the only
        time ``ShardedParam.sharded_param`` changes)."""
        self.dtensors: list[DTensor] = [p.sharded_param for p in self.params]

    def __call__(self, sink: torch.Tensor) -> None:
        delivered, sink.grad = sink.grad, None
        tail = self.tail
        try:
            *used, synced = delivered[-tail:].tolist()
        except compat.DataDependentOutputException:  # a run without data (FakeTensorMode): no tail to read
            used, synced = [1.0] * len(self.params), self.group.group.requires_gradient_sync
        if self.used_before is not None:
            used = [now or before for now, before in zip(used, self.used_before)]
        if not synced:  # a backward without gradient sync: the group's accumulator took its gradients
            self.used_before = used
            return
        if synced == 2:  # HSDP without the all-reduce: keep the sum for the next one (it adds it in)
            self.used_before = used
            self.group.partials[self.key] = delivered[:-tail]
            return
        self.used_before = None
        if self.group.partials:  # this backward's all-reduce added them in
            self.group.partials.pop(self.key, None)
        if self.group.group.reduce.include_unused:  # set_reduce_scatter_unused_params(True): zeros
            used = [1.0] * len(used)
        reduced = delivered  # the tail is past every parameter's slot: nothing below reads it
        if self.group.group.reduce.all_reduce_hook is not None:  # guarded in the trace: the graph agrees
            reduced = self._finish_after_hook(delivered[:-tail])  # the hook sees eager's bucket
        elif delivered.dtype is not self.shapes[0].dtype:  # HSDP delivers the reduce dtype: see sink_dtype
            reduced = delivered[:-tail].to(self.shapes[0].dtype)
        dtensors = self.dtensors
        fresh = self.packed
        for p, dtensor, reached in zip(self.params, dtensors, used):
            if compat.local_tensor_of(dtensor) is not p.traced_source:
                raise _swapped_shard_error(p)
            if dtensor.grad is not None or not dtensor.requires_grad or not reached:
                fresh = False
        if self.group.accumulated:
            self.group.drop_accumulated()
        if fresh:
            compat.assign_dtensor_grads(dtensors, compat.unflatten_dense_tensors(reduced, self.shapes))
            return
        slots = torch.split_with_sizes(reduced[: sum(self.widths)], self.widths)
        # As eager: a parameter no backward reached (unused in forward) gets no gradient, nor one
        # frozen after fully_shard (the graph does not see it).
        trainable = [i for i, d in enumerate(dtensors) if d.requires_grad and used[i]]
        # CPU offload: the copy to the host waits (no eager root syncs after a compiled backward).
        accumulate_sharded_grads([self.params[i] for i in trainable], [slots[i] for i in trainable], False)

    def _finish_after_hook(self, reduced: torch.Tensor) -> torch.Tensor:
        """What the graph left undivided in ``reduce_dtype`` (``graph.Reduction.hooked``): eager's
        finish (the hook, then the division), then the shards' dtype (one for the bucket)."""
        reduce = self.group.group.reduce
        reduce.finish_reduced(reduced, reduce.plan(reduced.dtype))
        grad_dtype = self.shapes[0].dtype
        return reduced if reduced.dtype == grad_dtype else reduced.to(grad_dtype)


def _swapped_shard_error(p: "ShardedParam") -> FSDPUsageError:
    """``p``'s DTensor holds a local shard other than the one its graph input (``traced_leaf``) was
    made from: swapped in from outside fsdp2 (``_apply`` on a submodule that is not fully_shard'ed
    swaps DTensor parameters), so the step gathered the old values. Eager reads the new ones;
    writing gradients of the old would train them silently."""
    return FSDPUsageError(
        f"torch.compile over fully_shard({p.owner}): the local shard of parameter {p.fqn} was replaced from "
        "outside fsdp2 (torch.utils.swap_tensors, or _apply/to() on a submodule that is not fully_shard'ed) "
        "after this step was compiled, so it computed with the old values; no gradient was written. Convert "
        "the fully_shard'ed module itself (module.to(...)), or have fsdp2 re-read its parameters with "
        "model.load_state_dict(model.state_dict())."
    )


def _encoded(p: "ShardedParam") -> bool:
    """Whether ``p`` travels encoded (see :meth:`TracedGroup._gather_encoded`)."""
    return isinstance(p.codec, (SubclassCodec, QuantizedCodec))


def _encode(p: "ShardedParam", shard: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], Any]:
    """What ``p``'s codec all-gathers for this rank's ``shard``, and what decoding needs of it."""
    if isinstance(p.codec, QuantizedCodec):
        (column,) = p.codec.columns()  # its slot in eager's buffer: uint8, the wire bytes
        slot = torch.empty(column.numel, dtype=column.dtype, device=p.device)  # CPU offload: quantized on the device
        p.codec.quantize(shard, slot)
        return (slot,), None
    # CPU offload: the hooks see the shard on the device, as eager's (and PyTorch's).
    return p.codec.pre_all_gather(shard.to(p.device) if p.offload else shard)


def _decode(
    p: "ShardedParam", shard: torch.Tensor, wire: tuple[torch.Tensor, ...], context: Any, blocks: list[torch.Tensor]
) -> torch.Tensor:
    """``p`` unsharded from the gathered ``blocks`` (``world x bytes``, one per wire tensor)."""
    if isinstance(p.codec, QuantizedCodec):
        return p.layout.full_from_rank_rows(p.codec.dequantized_rows(blocks[0]))
    outputs = tuple(block.contiguous().view(t.dtype).view(-1, *t.shape[1:]) for block, t in zip(blocks, wire))
    return p.codec.post_all_gather(shard, outputs, context)


class TracedGroup:
    """The traced path of one ParamGroup: its gather as graph ops, and which modules see it.

    ``held`` (the gathered parameters while the group's forward runs) and ``prefetched`` live
    only within one trace: the root's post-forward clears them before the trace ends.
    """

    # Slots, not an instance dict: dynamo replays a trace's attribute writes on a slotted object
    # with plain STORE_ATTRs after the graph runs, and a dict-backed object's through a Python
    # call per attribute (``held``, ``prefetched``, ... are written in every trace).
    __slots__ = (
        "group",
        "modules",
        "next",
        "prefetched",
        "held",
        "modules_left",
        "accumulators",
        "accumulated",
        "partials",
        "grad_sinks",
        "_hand_offs",
        "param_replaced",
        "custom_comm_keys",
        "_held_dicts",
        "__weakref__",
    )

    def __init__(self, group: "ParamGroup", modules: tuple[nn.Module, ...]):
        self.group = group
        self.modules = modules
        self.next: TracedGroup | None = None  # the next group in module order (implicit prefetch)
        self.prefetched: list[torch.Tensor] | None = None
        self.held: list[torch.Tensor] | None = None
        self.modules_left = 0
        self.accumulators: dict[tuple, torch.Tensor] = {}  # per bucket, see prepare_accumulation
        self.accumulated: dict[tuple, torch.Tensor] = {}  # their gradients, once there are any
        # Per bucket: HSDP's reduce-scattered sums kept by set_requires_all_reduce(False) backwards.
        self.partials: dict[tuple, torch.Tensor] = {}
        self.grad_sinks: dict[tuple, torch.Tensor] = {}  # per bucket, see prepare_grad_sinks
        self._hand_offs: dict[tuple, _GradHandOff] = {}  # their hooks
        self.custom_comm_keys: dict[str, str] = {}  # see use_custom_comm
        self.prepare_grad_sinks()
        # Set (eagerly, by _registrations) when a parameter other than ours is registered in one of
        # the group's slots; a trace reads it (one guard), and only then compares each parameter.
        self.param_replaced = False
        self._held_dicts: list[tuple[nn.Module, dict]] = []  # see hold
        group.on_params_refreshed = self.params_refreshed
        _registrations.watch(self)

    def use_custom_comm(self, kind: str, comm: object) -> None:
        """``set_custom_all_gather`` (``kind`` "all_gather") / ``set_custom_reduce_scatter``
        ("reduce_scatter"): the graph calls ``comm`` through ``traced_ops`` (read in the trace:
        setting another retraces)."""
        self.custom_comm_keys = {**self.custom_comm_keys, kind: traced_ops.register_comm(comm)}

    def params_refreshed(self) -> None:
        """fsdp2 re-read the parameters (ShardedParam.refresh): replacements are taken over, and
        dtypes may have changed (new buckets)."""
        self.param_replaced = False
        self.prepare_grad_sinks()

    # -- the gather ---------------------------------------------------------------------------

    def gather(self, after_forward: schedule.AfterForward) -> list[torch.Tensor]:
        """Every parameter of the group unsharded, in ``group.params`` order (one collective per
        bucket; two with ``reshard_after_forward=k``, see :meth:`_gather_keeping_rows`)."""
        if self.prefetched is not None:
            gathered, self.prefetched = self.prefetched, None
            return gathered
        params = self.group.params
        if not params:
            return []
        buckets = self._buckets()
        # Passed in (not read inside): the checkpoint region's inputs are its arguments.
        sinks = [self.grad_sinks.get(bucket.key) for bucket in buckets]
        tensors = [*sinks, *(p.traced_leaf for p in params)]
        if after_forward is schedule.AfterForward.FREE:
            gather = functools.partial(self._gather, buckets, after_forward=after_forward)
            return list(checkpoint(gather, *tensors, use_reentrant=False, context_fn=graph.recompute_in_backward))
        return self._gather(buckets, *tensors, after_forward=after_forward)

    def _gather(
        self, buckets: list[_Bucket], *tensors: torch.Tensor | None, after_forward: schedule.AfterForward
    ) -> list[torch.Tensor]:
        """``tensors``: each bucket's grad sink, then every parameter's shard. ``after_forward``:
        FREE runs in a region backward recomputes; KEEP_SUBGROUP_SHARD see :meth:`_gather_keeping_rows`."""
        keep_rows = after_forward is schedule.AfterForward.KEEP_SUBGROUP_SHARD
        regathers = after_forward is not schedule.AfterForward.KEEP
        sinks, shards = tensors[: len(buckets)], tensors[len(buckets) :]
        by_param: dict[int, torch.Tensor] = {}
        index = {id(p): i for i, p in enumerate(self.group.params)}
        sync = self.group.requires_gradient_sync
        for bucket, sink in zip(buckets, sinks):
            stale_sink = sink is None or sink.numel() != bucket.sink_numel or sink.dtype != bucket.reduction.sink_dtype
            if graph.takes_grad(bucket.reduction.grad_dtype) and stale_sink:
                # Its gradient would be dropped: the sinks follow the buckets through refresh_params.
                raise FSDPUsageError(
                    f"torch.compile over fully_shard({self.group.name}): its parameters changed dtype or shape "
                    "without fsdp2 re-reading them; convert the model with module.to()/load_state_dict, not in place."
                )
            accumulator = self.accumulators.get(bucket.key)
            if not sync and (accumulator is None or accumulator.numel() != bucket.gathered_numel):
                raise FSDPUsageError(
                    f"torch.compile over fully_shard({self.group.name}): its parameters changed dtype or shape "
                    "since set_requires_gradient_sync(False); call it again after the change."
                )
            accumulated = self.accumulated.get(bucket.key)
            partial = self.partials.get(bucket.key)  # read in the trace: keeping one retraces
            bucket_shards = [shards[index[id(p)]] for p in bucket.params]
            if bucket.encoded:  # with reshard_after_forward=k too: what it gathered is kept
                regathers_encoded = after_forward is schedule.AfterForward.FREE
                gathered = self._gather_encoded(
                    bucket, bucket_shards, sink, accumulator, accumulated, partial, regathers_encoded
                )
                by_param.update(gathered)
                continue
            reduction = bucket.reduction
            if regathers and reduction.counted:
                nbytes = bucket.gathered_numel * bucket.param_dtype.itemsize
                reduction = dataclasses.replace(reduction, regathered_bytes=nbytes)
            # One op, not torch.cat: see traced_ops.
            flat = graph.flat([p.layout.padded_slot(shard) for p, shard in zip(bucket.params, bucket_shards)])
            if bucket.params[0].offload:  # CPU offload: the shards live on the host (the group's all do)
                flat = flat.to(self.group.dp.device)
            if keep_rows:
                carrier, used = graph.ReduceOnly.apply(
                    sink,
                    flat,
                    accumulator,
                    accumulated,
                    partial,
                    bucket.gathered_numel,
                    bucket.param_dtype,
                    reduction,
                    sync,
                )
                unsharded = self._gather_keeping_rows(bucket, flat, carrier, used)
            else:
                gathered, used = graph.GatherReduce.apply(
                    sink, flat, accumulator, accumulated, partial, bucket.param_dtype, reduction, sync
                )
                unsharded = self._unsharded_params(bucket, gathered, gathered, used)
            by_param.update(zip(map(id, bucket.params), unsharded))
        return [by_param[id(p)] for p in self.group.params]

    @staticmethod
    def _unsharded_params(
        bucket: _Bucket, gathered: torch.Tensor, carrier: torch.Tensor, used: torch.Tensor
    ) -> list[torch.Tensor]:
        """The bucket's parameters, unsharded, from its gathered flat row (eager's copy-out), their
        gradients to ``carrier`` (the same row, or a :class:`graph.ReduceOnly` one), each use to ``used``."""
        world = bucket.reduction.world
        widths = [p.layout.padded_shard_numel for p in bucket.params]
        blocks = torch.split_with_sizes(gathered.view(world, -1), widths, dim=1)
        same = carrier is gathered
        carriers = blocks if same else torch.split_with_sizes(carrier.view(world, -1), widths, dim=1)
        unsharded = []
        for i, (p, block, carried) in enumerate(zip(bucket.params, blocks, carriers)):
            value = p.layout.full_from_rank_rows(block)
            if same:
                full = graph.MarkUsed.apply(value, used[i])
            else:
                full = graph.GradientFrom.apply(p.layout.full_from_rank_rows(carried), value, used[i])
            # TP modules compute on DTensors (eager: ShardedParam wraps the same way); from_local's
            # backward turns a pending-sum gradient into these placements, as eager's local_grad.
            unsharded.append(full if p.tensor_parallel is None else p.tensor_parallel.wrap(full))
        return unsharded

    def _gather_keeping_rows(
        self, bucket: _Bucket, flat: torch.Tensor, carrier: torch.Tensor, used: torch.Tensor
    ) -> list[torch.Tensor]:
        """``reshard_after_forward=k`` (eager: keep this rank's 1/k of the gathered rows, re-gather
        over its k-rank subgroup in backward) as two gathers that together move the bytes of one:
        over the ranks at this rank's subgroup position (``Subgroup.across``), which yields exactly
        the rows eager keeps and is saved for backward; then over the subgroup, in a region that
        backward recomputes from the kept rows. Both outside autograd: the gradient reaches
        ``carrier`` (a :class:`graph.ReduceOnly` row), which reduces over all ranks as any bucket's."""
        r, subgroup = bucket.reduction, self.group.reshard_after_forward.subgroup
        across = subgroup.across.group_name
        custom = r.custom_all_gather
        kept = graph.all_gather(flat.to(bucket.param_dtype), r.world // subgroup.size, across, False, r.counted, custom)

        def unshard(carrier: torch.Tensor, used: torch.Tensor, kept: torch.Tensor) -> list[torch.Tensor]:
            gathered = graph.all_gather(kept, subgroup.size, subgroup.group.group_name, False, r.counted, custom)
            # Member j kept shard ranks j, j + k, ...: back to shard rank order (eager's rank_rows).
            rows = gathered.view(subgroup.size, r.world // subgroup.size, -1).transpose(0, 1).reshape(-1)
            return self._unsharded_params(bucket, rows, carrier, used)

        return list(
            checkpoint(unshard, carrier, used, kept, use_reentrant=False, context_fn=graph.recompute_in_backward)
        )

    def _gather_encoded(
        self, bucket: _Bucket, shards: list[torch.Tensor], sink, accumulator, accumulated, partial, regathers: bool
    ) -> dict[int, torch.Tensor]:
        """A bucket whose parameters travel encoded (eager: their codecs): a tensor subclass's own
        hooks (``SubclassCodec``: the pre-all-gather inputs, then the post-all-gather hook) or
        fsdp2's quantized all-gather (``QuantizedCodec``: quantized slot, then dequantized rows).
        Every wire tensor of the bucket, as bytes, side by side in ONE all-gather (gloo has no
        float8 collectives; eager's buffer is bytes too). The unsharded parameters are made
        differentiable into a :class:`graph.ReduceOnly` row, which reduces as any bucket's (the
        gradient passes the encoding straight through, as eager's).

        Subclass hooks run on ``traced_leaf``, the shard's ``detach()``: torchao's drops the scale
        ``precompute_float8_dynamic_scale_for_fsdp`` set (and a subclass input carrying it fails
        torchao's ``__tensor_flatten__`` under the compiler), so its hook computes the scale in the
        step, all-reducing the amax over the shard mesh: the same value, for weights that only
        FSDP shards (``check_traceable`` refuses tensor-parallel ones)."""
        r = bucket.reduction
        encoded = [_encode(p, shard) for p, shard in zip(bucket.params, shards)]
        inputs = [t for wire, _ in encoded for t in wire]
        if not inputs:
            return {}
        flat = graph.flat([t.reshape(-1).view(torch.uint8) for t in inputs])
        gathered = graph.all_gather(flat, r.world, r.shard_group, r.out_collectives, r.counted, r.custom_all_gather)
        rows = gathered.view(r.world, -1)
        blocks = iter(torch.split_with_sizes(rows, [t.numel() * t.element_size() for t in inputs], dim=1))
        if regathers and r.counted:
            r = dataclasses.replace(r, regathered_bytes=r.world * flat.numel())
        sync = self.group.requires_gradient_sync
        carrier, used = graph.ReduceOnly.apply(
            sink, flat, accumulator, accumulated, partial, bucket.gathered_numel, bucket.param_dtype, r, sync
        )
        carriers = torch.split_with_sizes(
            carrier.view(r.world, -1), [p.layout.padded_shard_numel for p in bucket.params], dim=1
        )
        by_param = {}
        for i, (p, shard, (wire, context), carried) in enumerate(zip(bucket.params, shards, encoded, carriers)):
            unsharded = _decode(p, shard, wire, context, [next(blocks) for _ in wire])
            full = graph.GradientFrom.apply(p.layout.full_from_rank_rows(carried), unsharded, used[i])
            by_param[id(p)] = full if p.tensor_parallel is None else p.tensor_parallel.wrap(full)
        return by_param

    def _buckets(self) -> list[_Bucket]:
        group, dp = self.group, self.group.dp
        reduce = group.reduce
        shard_group = reduce.reduce_scatter_group or dp.shard_group
        replicate = dp.replicate_group.group_name if dp.is_hybrid else None
        # Read in every trace (dynamo guards on it): entering count_comm retraces into a counting graph.
        counted = bool(collectives.active_counters)
        by_key: dict[tuple, list] = {}
        for p in group.params:
            by_key.setdefault((_encoded(p), p.param_dtype, p.reduce_dtype, p.orig_dtype), []).append(p)
        buckets = []
        for key, params in by_key.items():
            encoded, param_dtype, reduce_dtype, orig_dtype = key
            plan = reduce.plan(reduce_dtype)
            reduction = graph.Reduction(
                dp.shard_size,
                shard_group.group_name,
                replicate,
                reduce_dtype,
                orig_dtype,
                plan.divide_before,
                plan.divide_after,
                plan.reduce_scatter_op.functional_name,
                plan.all_reduce_op.functional_name,
                graph.takes_out_collectives(shard_group),
                len(params),
                self.custom_comm_keys.get("all_gather"),
                self.custom_comm_keys.get("reduce_scatter"),
                counted,
                reduce.all_reduce_hook is not None,
                all_reduce=reduce.requires_all_reduce or replicate is None,
            )
            buckets.append(_Bucket(key, params, param_dtype, reduction, encoded))
        return buckets

    # -- the gradient hand-off ----------------------------------------------------------------

    def prepare_grad_sinks(self) -> None:
        """Eager (at fully_shard and whenever the parameters are re-read): per bucket a leaf that
        autograd hands the reduced flat shard, with a :class:`_GradHandOff` as its hook. One
        element of storage: only its gradient is ever read. A bucket whose parameters and size are
        unchanged keeps its sink: re-reading parameters also happens inside functorch transforms
        (``torch.func.jvp`` over the module), where no new leaf may be made."""
        sinks, hand_offs = {}, {}
        for bucket in self._buckets():
            dtype = bucket.reduction.sink_dtype
            if not graph.takes_grad(dtype):
                continue
            params = tuple(bucket.params)
            numel = bucket.sink_numel
            sink, hand_off = self.grad_sinks.get(bucket.key), self._hand_offs.get(bucket.key)
            if (
                sink is None
                or hand_off is None
                or hand_off.params != params
                or sink.numel() != numel
                or sink.dtype != dtype
            ):
                hand_off = _GradHandOff(bucket.key, params, self)
                sink = torch.empty_strided((numel,), (0,), dtype=dtype, device=self.group.dp.device).requires_grad_()
                sink.register_post_accumulate_grad_hook(hand_off)
            else:
                hand_off.take_params()
            sinks[bucket.key], hand_offs[bucket.key] = sink, hand_off
        self.grad_sinks, self._hand_offs = sinks, hand_offs

    # -- gradient accumulation without sync ------------------------------------------------------

    def prepare_accumulation(self) -> None:
        """Eager, from ``set_requires_gradient_sync(False)``: per bucket a leaf whose ``.grad``
        autograd sums the unreduced gradients in (eager: the unsharded parameters' ``.grad``).
        One element of storage: only its gradient is ever read."""
        for bucket in self._buckets():
            accumulator = self.accumulators.get(bucket.key)
            if accumulator is None or accumulator.numel() != bucket.gathered_numel:
                dtype = bucket.reduction.reduce_dtype
                leaf = torch.empty_strided((bucket.gathered_numel,), (0,), dtype=dtype, device=self.group.dp.device)
                self.accumulators[bucket.key] = leaf.requires_grad_()
                # The sum as a plain attribute: dynamo cannot hand a ``.grad`` read to a Function.
                leaf.register_post_accumulate_grad_hook(functools.partial(self._note_accumulated, bucket.key))

    def _note_accumulated(self, key: tuple, leaf: torch.Tensor) -> None:
        self.accumulated[key] = leaf.grad

    def drop_accumulated(self) -> None:
        if self.accumulated:
            self.accumulated.clear()
            for accumulator in self.accumulators.values():
                accumulator.grad = None

    # -- what the modules see -----------------------------------------------------------------

    def hold(self, unsharded: list[torch.Tensor]) -> None:
        """The modules see the gathered parameters: each module's ``_parameters`` dict is swapped
        for a new one (``release`` puts the original object back), so the trace never reads the
        DTensor parameters, and dynamo installs no guard (a Python DTensor spec check) on them."""
        self.held = unsharded
        by_module: dict[nn.Module, dict[str, torch.Tensor]] = {}
        for p, tensor in zip(self.group.params, unsharded):
            for slot in p.slots:
                by_module.setdefault(slot.module, {})[slot.name] = tensor
        for module, gathered in by_module.items():
            original = compat.held_parameter_registry(module)
            # Only the parameters fsdp2 does not manage (ignored ones) are read from the original.
            compat.set_parameter_registry(
                module, {name: gathered[name] if name in gathered else original[name] for name in original}
            )
            self._held_dicts.append((module, original))

    def release(self) -> None:
        self.held = None
        self.modules_left = 0
        for module, original in self._held_dicts:
            compat.set_parameter_registry(module, original)
        self._held_dicts = []

    # -- the group's forward in a trace -------------------------------------------------------

    def pre_forward(self, forward_prefetch: list["TracedGroup"]) -> None:
        """Before one of the group's modules runs: gather the group (unless held), then prefetch."""
        if self.held is not None:
            return
        is_root = _trace.root is None
        if is_root:
            _trace.root = self  # the first group of this forward keeps its parameters (eager's root)
        check_traceable(self)
        self.hold(self.gather(self.after_forward(is_root)))
        self.modules_left = len(self.modules)
        _trace.touched.append(self)
        targets = forward_prefetch or ([self.next] if self.next is not None else [])
        for other in targets:
            if other.held is None and other.prefetched is None:
                check_traceable(other)
                other.prefetched = other.gather(other.after_forward(is_root=False))
                _trace.touched.append(other)

    def post_forward(self) -> None:
        """After one of the group's modules: the last one releases the group (the root: all)."""
        if self.held is None:
            return
        self.modules_left -= 1
        if self.modules_left > 0:
            return
        self.release()
        if _trace.root is self:
            # Nothing gathered outlives the trace: a prefetch no module used is dropped, a group
            # some of whose modules never ran is released.
            for other in _trace.touched:
                other.prefetched = None
                if other.held is not None:
                    other.release()
            _trace.touched.clear()
            _trace.root = None

    def after_forward(self, is_root: bool) -> schedule.AfterForward:
        """What backward finds of this forward's gather (eager: what the group keeps after forward)."""
        if not torch.is_grad_enabled():
            return schedule.AfterForward.KEEP  # no backward: nothing is saved anyway
        setting, shard_size = self.group.reshard_after_forward.setting, self.group.dp.shard_size
        return schedule.after_forward(setting, is_root=is_root, shard_size=shard_size)


class _TraceScope:
    """The forward being traced: its first group (the root) and the groups gathered in it."""

    __slots__ = ("root", "touched")  # see TracedGroup's

    def __init__(self) -> None:
        self.root: TracedGroup | None = None
        self.touched: list[TracedGroup] = []


_trace = _TraceScope()


class _ParamRegistrations:
    """Notices a parameter registered (``module.weight = nn.Parameter(...)``,
    ``load_state_dict(assign=True)``) in a slot of a fully_shard'ed parameter, through nn.Module's
    global registration hook (installed once, on the first fully_shard). The compiled step does
    not read the DTensor parameters (see ``TracedGroup.hold``), so without this it would keep
    training the old shard; instead the group's ``param_replaced`` flips, the guard on it fails,
    and the retrace refuses the replacement by name (``check_traceable``)."""

    def __init__(self) -> None:
        # module -> {slot name: (its ShardedParam, its TracedGroup)}, both weakly: they refer to
        # the module, which would otherwise never be freed.
        self._slots: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[weakref.ref, weakref.ref]]] = (
            weakref.WeakKeyDictionary()
        )
        self._handle = None

    def watch(self, traced: TracedGroup) -> None:
        for p in traced.group.params:
            for slot in p.slots:
                self._slots.setdefault(slot.module, {})[slot.name] = (weakref.ref(p), weakref.ref(traced))
        if self._handle is None:
            self._handle = nn.modules.module.register_module_parameter_registration_hook(self._registered)

    def _registered(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        watched = self._slots.get(module)
        if watched is None or name not in watched:
            return
        sharded, traced = (ref() for ref in watched[name])
        if sharded is not None and traced is not None and param is not sharded.sharded_param:
            traced.param_replaced = True


_registrations = _ParamRegistrations()


def link_forward_order(groups: list[TracedGroup]) -> None:
    """Each group's implicit prefetch target: the next one in module (pre-)order."""
    for first, second in zip(groups, groups[1:]):
        first.next = second
    if groups:
        groups[-1].next = None


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
    elif any(group.reduce.plan(p.reduce_dtype).reduce_scatter_op.functional_name is None for p in group.params):
        problem = (
            "set_gradient_divide_factor on NCCL (its PREMUL_SUM reduce op has no functional collective; "
            "set_force_sum_reduction_for_comms(True) divides in a separate op)"
        )
    replaced = []
    if traced.param_replaced:  # read in every trace: dynamo guards on it, so a replacement retraces
        replaced = [p.fqn for p in group.params if p.slots[0].current() is not p.sharded_param]
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


# How to avoid mixing executors within one accumulation (each keeps its own unsynced gradients).
ONE_EXECUTOR_PER_ACCUMULATION = (
    "Run every microbatch of one accumulation through the same module: all through the compiled one, or all eager."
)


def check_no_eager_state(traced: TracedGroup) -> None:
    """Refuse a compiled step that would ignore what an eager call left in the group: the traced
    path gathers from the shards and hands gradients straight to ``.grad``, so eager's gathered
    parameters and its gradients kept without sync would silently not take part. Each read here
    is guarded: the eager call that changes it makes the next compiled call retrace into this."""
    group = traced.group
    where = f"torch.compile over fully_shard({group.name})"
    if group.reduce.holds_partial_sums:
        raise FSDPUsageError(
            f"{where}: an eager HSDP backward with set_requires_all_reduce(False) kept partial sums that this "
            f"compiled step would not add to its all-reduce. {ONE_EXECUTOR_PER_ACCUMULATION}"
        )
    if group.holds_unsynced_grads:
        raise FSDPUsageError(
            f"{where}: an eager backward without gradient sync (set_requires_gradient_sync(False)) left "
            f"gradients that this compiled step would not add to its reduction. {ONE_EXECUTOR_PER_ACCUMULATION}"
        )
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
