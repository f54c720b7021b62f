"""A bucket's gather and reduction as graph ops, which fsdp2.runtime.traced builds a group's step from.

Every unsharded parameter the modules see is a :class:`GradientFrom`: its gradient goes to its
block of its bucket's gradient port (``fsdp2::grad_port``, one per bucket and trace: a row of the
gathered size and a mark per parameter), so autograd sums every use before the port's backward
runs, once per backward, as eager sums them in the unsharded parameter's ``.grad``. The port's
backward (:func:`_reduce_port_grad`) is the bucket's reduction, its ``BucketStep`` as eager runs
it (:func:`reduce`); which marks backward reached (the parameters forward used) is a trace-time
constant. The result goes to the sink of the backward's :class:`Mode` when backward reached every
parameter, else to ``fsdp2::deliver`` with the indices it reached (fsdp2.runtime.grad_sinks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdp2 import compat
from fsdp2.runtime import collectives, traced_ops
from fsdp2.runtime.group_step import GatherStep, Mode, ReduceSpec, spec_named

_c10d = compat.functional_collectives


@dataclass(frozen=True)
class BucketReduction:
    """A bucket's reduction in one graph: its ``BucketStep``'s spec and what the trace adds: the
    backward's ``mode``; ``counted`` (inside count_comm); ``takes_unsynced`` / ``takes_partial``
    (sums kept by earlier backwards are added in once, ``traced_ops.take_kept_sums``, as eager adds
    them in its next reduction); ``include_unused`` (set_reduce_scatter_unused_params). With
    ``spec.hooked`` the graph hands the shard over undivided: the user's hook and the division run
    at the hand-off, as eager runs them."""

    spec: ReduceSpec
    mode: Mode = Mode.SYNCED
    counted: bool = False
    takes_unsynced: bool = False
    takes_partial: bool = False
    include_unused: bool = False

    _FLAGS = ("counted", "takes_unsynced", "takes_partial", "include_unused")

    @property
    def key(self) -> str:
        """What a graph names it by: the step's key (a digest of the step, ``ReduceSpec.key``), the
        mode and the flags set, e.g. ``step-1f0c...:SYNCED+takes_unsynced``: a graph's text says
        everything its backward does, and a compiler's cache keyed by it never confuses two."""
        return ":".join((self.spec.key, "+".join([self.mode.name] + [f for f in self._FLAGS if getattr(self, f)])))

    @classmethod
    def named(cls, key: str) -> "BucketReduction":
        step, flags = key.split(":")
        mode, *set_flags = flags.split("+")
        return cls(spec_named(step), Mode[mode], **{flag: True for flag in set_flags})


def _record(kind: str, sent: torch.Tensor, world: int = 1) -> None:
    """count_comm's record of one collective, counted as eager counts it (``collectives.comm_bytes``)."""
    traced_ops.record_comm(kind, collectives.comm_bytes(kind, sent, world))


def all_gather(send: torch.Tensor, world: int, group: str, *, step: GatherStep, counted: bool) -> torch.Tensor:
    """``send`` gathered over ``world`` ranks of ``group`` (the group's, or a subgroup's, by
    name) with the collective of the group's ``step``; ``counted``: traced inside count_comm."""
    if counted:
        _record("all_gather", send, world)
    if step.custom_key is not None:  # set_custom_all_gather
        return traced_ops.custom_all_gather(send, world, group, step.custom_key)
    dtype = send.dtype
    wire = collectives.gathered_as(dtype)  # float8 and others travel as bytes, as eager's
    if wire is not dtype:
        send = send.view(wire)
    if not step.out_collectives:
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
        grad = traced_ops.take_kept_sums(
            grad.to(torch.promote_types(grad.dtype, spec.reduce_dtype)), bucket, Mode.UNSYNCED
        )
    grad = grad.to(spec.reduce_dtype).contiguous()
    if r.mode is Mode.UNSYNCED:
        return grad
    for divisor in plan.divide_before:
        grad = grad / divisor  # fp16 would overflow summing before dividing
    reduced = spec.after_reduce_scatter(_reduce_scatter(grad, spec, r.counted), r.mode, _InGraph, (r, bucket))
    if spec.hooked or r.mode is Mode.PARTIAL:  # the hand-off (or the next all-reduce) finishes it
        return reduced
    return reduced.to(spec.handed_over_dtype(r.mode))


class _InGraph:
    """The pieces of ``ReduceSpec.after_reduce_scatter`` as graph ops (``at``: the reduction and
    its bucket's key)."""

    @staticmethod
    def keep_partial(at, reduced: torch.Tensor) -> torch.Tensor:
        return reduced  # to the PARTIAL sink, which adds it to the partial sums

    @staticmethod
    def add_partial(at, reduced: torch.Tensor) -> torch.Tensor:
        r, bucket = at
        return traced_ops.take_kept_sums(reduced, bucket, Mode.PARTIAL) if r.takes_partial else reduced

    @staticmethod
    def all_reduce(at, reduced: torch.Tensor) -> torch.Tensor:
        r, _ = at
        if r.counted:
            _record("all_reduce", reduced)
        op = r.spec.plan.all_reduce_op.functional_name
        return _c10d.wait_tensor(_c10d.all_reduce(reduced, op, r.spec.replicate_group))

    @staticmethod
    def hook_and_divide(at, reduced: torch.Tensor) -> torch.Tensor:
        r, _ = at
        # Hooked: the hand-off calls the user's hook, then divides, eagerly, as eager (BucketReduction).
        return reduced if r.spec.hooked else reduced / r.spec.plan.divide_after


# -- the gradient port ----------------------------------------------------------------------------

traced_ops.define(
    "grad_port(Tensor sink, Tensor anchor, str bucket, int numel, ScalarType dtype, int params, str reduction) "
    "-> (Tensor, Tensor[])",
    lambda sink, anchor, bucket, numel, dtype, params, reduction: (
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
    ``fsdp2::deliver``'s (empty) result otherwise, which keeps that op in the graph."""
    return torch.ops.fsdp2.grad_port.default(sink, anchor, bucket, numel, dtype, params, r.key)


def _setup_port(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)  # a mark backward never reached stays None
    ctx.bucket = inputs[2]
    ctx.reduction = BucketReduction.named(inputs[6])
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


def _recompute_everything(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # A collective's count is recorded once, in forward (RecordRegather records the recomputed
    # gather in backward); an effectful op may not be recomputed anyway (torch 2.15 refuses it).
    if op is traced_ops.record_comm:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


def recompute_in_backward():
    return create_selective_checkpoint_contexts(_recompute_everything)
