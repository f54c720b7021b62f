"""How one bucket's gather and reduction appear in a compiled graph: the functional collectives,
the bucket's gradient port and its reduction, which the traced path (fsdp2.runtime.traced)
builds a group's step from.

- :func:`all_gather`: a bucket's flat shards gathered, outside autograd.
- :func:`port`: where the bucket's gradients meet in one trace (``fsdp2::grad_port``): a row of
  the gathered size and a mark per parameter. Every unsharded parameter the modules see is a
  :class:`GradientFrom`, whose gradient goes to its block of the row and a 1 to its mark; a
  bucket gathered again in the same trace (a module called twice) routes to the same port, so
  autograd sums every use before the port's backward runs, once per backward, as eager sums
  them in the unsharded parameter's ``.grad``.
- The port's backward (:func:`_reduce_port_grad`, its autograd formula) is the bucket's
  reduction, with eager's reduce plan in a :class:`BucketReduction`. Compilers run it when they trace
  the backward, on which marks backward reaches: the parameters it did not reach (unused in
  forward) are known then, as trace-time constants, and need nothing at run time. The reduced
  gradient goes to the sink of the step's :class:`Mode` when backward reached every parameter,
  else to ``fsdp2::deliver`` with the indices it reached (fsdp2.runtime.traced_grads takes both).

Nothing here holds state between steps: the traced path passes in what a step needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdp2 import compat
from fsdp2.runtime import collectives, traced_ops
from fsdp2.runtime.group_step import Mode, ReduceSpec, spec_named

_c10d = compat.functional_collectives


@dataclass(frozen=True)
class BucketReduction:
    """How a bucket's gradient is reduced in one graph: its ``BucketStep``'s spec (eager's step,
    as ``GroupReduce`` runs it) and what the trace adds: ``mode``; ``counted`` (traced inside
    count_comm: the graph records its collectives, traced_ops.record_comm); ``takes_unsynced`` /
    ``takes_partial`` (sums kept by earlier backwards, without sync or without the HSDP all-reduce,
    are added in, once per backward, traced_ops.take_pending, as eager adds them in its next
    reduction); ``include_unused`` (set_reduce_scatter_unused_params(True): unreached parameters
    get zeros). With ``spec.hooked`` (set_all_reduce_hook) the graph hands the reduced shard over
    undivided, in the reduce dtype; the hand-off (eager, outside the graph) calls the hook on it,
    then divides and casts, as eager."""

    spec: ReduceSpec
    mode: Mode = Mode.SYNCED
    counted: bool = False
    takes_unsynced: bool = False
    takes_partial: bool = False
    include_unused: bool = False


@dataclass(frozen=True)
class GatherSettings:
    """How a group's all-gathers appear in a graph: ``out_collective`` (collectives.out_variants_usable),
    ``counted`` (traced inside count_comm), ``custom`` (set_custom_all_gather's key)."""

    out_collective: bool
    counted: bool
    custom: str | None


def _record(kind: str, sent: torch.Tensor, world: int = 1) -> None:
    """count_comm's record of one collective, counted as eager counts it (``collectives.comm_bytes``)."""
    traced_ops.record_comm(kind, collectives.comm_bytes(kind, sent, world))


def all_gather(send: torch.Tensor, world: int, group: str, settings: GatherSettings) -> torch.Tensor:
    if settings.counted:
        _record("all_gather", send, world)
    if settings.custom is not None:  # set_custom_all_gather
        return traced_ops.custom_all_gather(send, world, group, settings.custom)
    dtype = send.dtype
    wire = collectives.gathered_as(dtype)  # float8 and others travel as bytes, as eager's
    if wire is not dtype:
        send = send.view(wire)
    if not settings.out_collective:
        gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(send, world, group))
    else:
        gathered = send.new_empty(world * send.numel())
        _c10d.all_gather_into_tensor_out(send, world, group, out=gathered)
        gathered = _c10d.wait_tensor(gathered)
    return gathered if wire is dtype else gathered.view(dtype)


def _reduce_scatter(grad: torch.Tensor, spec: ReduceSpec, counted: bool) -> torch.Tensor:
    if counted:
        _record("reduce_scatter", grad)
    op, world, group = spec.plan.reduce_scatter_op.functional_name, spec.world, spec.shard_group
    if spec.custom_reduce_scatter is not None:  # set_custom_reduce_scatter
        return traced_ops.custom_reduce_scatter(grad, world, op, group, spec.custom_reduce_scatter)
    if not spec.out_collectives:
        return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(grad, op, world, group))
    reduced = grad.new_empty(grad.numel() // world)
    _c10d.reduce_scatter_tensor_out(grad, op, world, group, out=reduced)
    return _c10d.wait_tensor(reduced)


def reduce(grad: torch.Tensor, r: BucketReduction, bucket: str) -> torch.Tensor:
    """The gradient of a bucket's gathered row (eager's reduce-scatter input: same layout,
    padding zeroed) as ``r.mode`` keeps it: unreduced (UNSYNCED), reduce-scattered (PARTIAL), or
    reduced for ``.grad`` (SYNCED), with eager's casts, reduce ops, divisions and kept sums."""
    spec, plan = r.spec, r.spec.plan
    if r.takes_unsynced:
        # Eager: the microbatches' sum plus this backward's gradient, added in the wider of their
        # dtypes and rounded to the reduce dtype once (``sum.add_(grad)``).
        grad = traced_ops.take_pending(
            grad.to(torch.promote_types(grad.dtype, spec.reduce_dtype)), bucket, Mode.UNSYNCED
        )
    grad = grad.to(spec.reduce_dtype).contiguous()
    if r.mode is Mode.UNSYNCED:
        return grad
    for divisor in plan.divide_before:
        grad = grad / divisor  # fp16 would overflow summing before dividing
    reduced = _reduce_scatter(grad, spec, r.counted)
    if r.mode is Mode.PARTIAL:
        return reduced
    if spec.replicate_group is not None:
        if r.takes_partial:  # eager: the kept partial sums join this all-reduce
            reduced = traced_ops.take_pending(reduced, bucket, Mode.PARTIAL)
        if r.counted:
            _record("all_reduce", reduced)
        op = plan.all_reduce_op.functional_name
        reduced = _c10d.wait_tensor(_c10d.all_reduce(reduced, op, spec.replicate_group))
    if not spec.hooked:  # else the hand-off divides and casts after the hook (see BucketReduction)
        if plan.divide_after != 1:
            reduced = reduced / plan.divide_after
        reduced = reduced.to(spec.handed_over_dtype(r.mode))
    return reduced


# -- the gradient port ----------------------------------------------------------------------------

traced_ops.define(
    "grad_port(Tensor sink, Tensor anchor, str bucket, int numel, ScalarType dtype, int params, str step, "
    "int mode, bool counted, bool takes_unsynced, bool takes_partial, bool include_unused) -> (Tensor, Tensor[])",
    lambda sink, anchor, bucket, numel, dtype, params, *reduction: (
        # Runs only where no compiler drops it (torch.compile's eager backend, or no compile).
        anchor.new_empty(numel, dtype=dtype),
        [anchor.new_empty(()) for _ in range(params)],
    ),
)


def port(
    sink: torch.Tensor, anchor: torch.Tensor, bucket: str, r: BucketReduction, numel: int, dtype, params: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The bucket's gradient port for one trace: ``(row, marks)`` (see the module docstring).
    ``sink`` takes the reduced gradient when backward reaches every parameter; ``anchor`` takes
    ``fsdp2::deliver``'s (empty) result otherwise, which keeps that op in the graph. The reduction
    travels as its step's key (a digest of what the step does, ``ReduceSpec.key``) and the trace's
    flags: a graph's text says everything its backward does, and a compiler's cache keyed by it
    never confuses two reductions."""
    return torch.ops.fsdp2.grad_port.default(
        sink,
        anchor,
        bucket,
        numel,
        dtype,
        params,
        r.spec.key,
        int(r.mode),
        r.counted,
        r.takes_unsynced,
        r.takes_partial,
        r.include_unused,
    )


def _setup_port(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)  # a mark backward never reached stays None
    ctx.bucket = inputs[2]
    step, mode, counted, takes_unsynced, takes_partial, include_unused = inputs[6:]
    ctx.reduction = BucketReduction(
        spec_named(step), Mode(mode), counted, takes_unsynced, takes_partial, include_unused
    )
    ctx.no_grads = (None,) * len(inputs)  # a gradient only for the sink or the anchor


def _reduce_port_grad(ctx, grad: torch.Tensor | None, marks: list[torch.Tensor | None]):
    """The port's backward: the bucket's reduction, to the sink or to ``fsdp2::deliver``."""
    r: BucketReduction = ctx.reduction
    none = ctx.no_grads
    if grad is None:  # backward reached none of the bucket's parameters
        return none
    reduced = reduce(grad, r, ctx.bucket)
    reached = [i for i, mark in enumerate(marks) if mark is not None]
    if r.include_unused or len(reached) == len(marks):
        return (reduced, *none[1:])
    return (None, traced_ops.deliver(reduced, ctx.bucket, r.mode, reached), *none[2:])


torch.library.register_autograd("fsdp2::grad_port", _reduce_port_grad, setup_context=_setup_port)


class GradientFrom(torch.autograd.Function):
    """One unsharded parameter as the modules see it: ``unsharded`` (a view of the gathered row,
    or a tensor a codec built from it, e.g. torchao's float8 weight), its gradient (``param_dtype``,
    the parameter's shape) going to ``carrier`` (its block of the bucket's port row), and a 1 to
    ``mark``, its mark, only if backward reaches it (forward used the parameter)."""

    @staticmethod
    def forward(ctx, carrier, unsharded, mark):
        ctx.mark = (mark.dtype, mark.device)  # not from ``grad``: it may be a subclass (float8's)
        return unsharded.view_as(unsharded)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.mark
        return grad, None, torch.ones((), dtype=dtype, device=device)


class EndOfBackward(torch.autograd.Function):
    """Identity on a root call's output whose backward tells the root call (``fsdp2::end_backward``,
    its result the ``anchor``'s gradient, which keeps the op in the graph) that a compiled backward
    runs: the root then ends it as eager's end of backward does, for the groups the graph did not
    reduce (fsdp2.runtime.hooks.FSDPState.compiled_backward_runs)."""

    @staticmethod
    def forward(ctx, anchor, output, state: str):
        ctx.state = state
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        return traced_ops.end_backward(grad, ctx.state), grad, None


class RecordRegather(torch.autograd.Function):
    """Identity on a port row at one gather that backward recomputes (``reshard_after_forward``),
    in a trace inside ``count_comm``: its backward records that all-gather, since a recomputed
    region's own record op is not recomputed."""

    @staticmethod
    def forward(ctx, row, nbytes: int):
        ctx.nbytes = nbytes
        return row.view_as(row)

    @staticmethod
    def backward(ctx, grad):
        traced_ops.record_comm("all_gather", ctx.nbytes)
        return grad, None


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` flattened side by side: one op, not torch.cat (see traced_ops); one tensor is
    its own flat view (a custom op's output may not alias its input)."""
    return tensors[0].reshape(-1) if len(tensors) == 1 else traced_ops.flat_cat(tensors)


def takes_grad(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _recompute_everything(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # A collective's count is recorded once, in forward (RecordRegather records the recomputed
    # gather in backward); an effectful op may not be recomputed anyway (torch 2.15 refuses it).
    if op is traced_ops.record_comm:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


def recompute_in_backward():
    return create_selective_checkpoint_contexts(_recompute_everything)
