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
  reduction, with eager's reduce plan in a :class:`Reduction`. Compilers run it when they trace
  the backward, on which marks backward reaches: the parameters it did not reach (unused in
  forward) are known then, as trace-time constants, and need nothing at run time. The reduced
  gradient goes to the sink of the step's :class:`Mode` when backward reached every parameter,
  else to ``fsdp2::deliver`` with the indices it reached (fsdp2.runtime.traced_grads takes both).

Nothing here holds state between steps: the traced path passes in what a step needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdp2 import compat
from fsdp2.runtime import traced_ops
from fsdp2.runtime.group_step import BucketStep, Mode

_c10d = compat.functional_collectives


@dataclass(frozen=True)
class Reduction:
    """How a bucket's gradient is reduced: what eager's ``GroupReduce`` would do with it."""

    world: int
    shard_group: str  # process group names: functional collectives take names
    replicate_group: str | None  # HSDP: all-reduce across replicas after the reduce-scatter
    reduce_dtype: torch.dtype
    grad_dtype: torch.dtype  # the shards' dtype
    divide_before: tuple[float, ...]
    divide_after: float
    reduce_scatter_op: str  # functional collectives' names: "sum", "avg"
    all_reduce_op: str
    out_collectives: bool  # see _OUT_COLLECTIVES
    # set_custom_reduce_scatter: the user's object's key (traced_ops.register_comm)
    custom_reduce_scatter: str | None
    counted: bool  # traced inside count_comm: the graph records its collectives (traced_ops.record_comm)
    # set_all_reduce_hook: the graph hands the reduced shard over undivided, in reduce_dtype; the
    # hand-off (eager, outside the graph) calls the hook on it, then divides and casts, as eager.
    hooked: bool
    mode: Mode = Mode.SYNCED
    # Sums kept by earlier backwards (without sync; HSDP without the all-reduce) are added in,
    # once per backward (traced_ops.take_pending), as eager adds them in its next reduction.
    takes_unsynced: bool = False
    takes_partial: bool = False
    include_unused: bool = False  # set_reduce_scatter_unused_params(True): unreached parameters get zeros

    @classmethod
    def of(cls, step: BucketStep, **trace_time) -> "Reduction":
        """``step`` (the bucket's reduction, as eager runs it) in a graph: the process groups by
        name, the reduce ops by their functional collectives' names; ``trace_time``: what the
        trace adds (counted, the custom reduce-scatter's key, mode, the kept sums it takes)."""
        plan = step.plan
        return cls(
            world=step.world,
            shard_group=step.shard_group.group_name,
            replicate_group=None if step.replicate_group is None else step.replicate_group.group_name,
            reduce_dtype=step.reduce_dtype,
            grad_dtype=step.grad_dtype,
            divide_before=plan.divide_before,
            divide_after=plan.divide_after,
            reduce_scatter_op=plan.reduce_scatter_op.functional_name,
            all_reduce_op=plan.all_reduce_op.functional_name,
            out_collectives=takes_out_collectives(step.shard_group),
            hooked=step.hooked,
            **trace_time,
        )

    @property
    def sink_dtype(self) -> torch.dtype:
        """The dtype the bucket's reduced flat shard reaches its sink in: the reduce dtype where the
        hand-off finishes it (the all-reduce hook) or keeps it (partial and unsynced sums)."""
        if self.mode is Mode.SYNCED and not self.hooked:
            return self.grad_dtype
        return self.reduce_dtype


# The compiled code calls each collective op through the dispatcher on every step. torch 2.13
# registers the functional collectives' autograd in Python (7 Python calls per op call, even
# without grad); their ``*_out`` variants have none, and inductor runs them in place into a buffer
# it allocates. ``wait_tensor`` has no such variant.
_OUT_COLLECTIVES = compat.out_collectives_traceable()


# By group name, noted eagerly (fully_shard, refresh_params): a trace cannot ask a group its class.
_groups_taking_out_collectives: dict[str, bool] = {}


def takes_out_collectives(group: dist.ProcessGroup) -> bool:
    """Whether the graph may run ``group``'s all-gather and reduce-scatter as ``*_out`` ops. Not
    for a process group implemented in Python (a subclass, e.g. ``fsdp2.tools.noop_pg``): the
    ``*_out`` ops go to its C++ backend directly, past the methods it overrides. A group not seen
    eagerly gets the functional ops (same results, a few more Python calls)."""
    if torch.compiler.is_compiling():
        return _groups_taking_out_collectives.get(group.group_name, False)
    takes = _OUT_COLLECTIVES and type(group) is dist.ProcessGroup
    _groups_taking_out_collectives[group.group_name] = takes
    return takes


@dataclass(frozen=True)
class GatherSettings:
    """How a group's all-gathers appear in a graph: ``out_collective`` (see takes_out_collectives),
    ``counted`` (traced inside count_comm), ``custom`` (set_custom_all_gather's key)."""

    out_collective: bool
    counted: bool
    custom: str | None


def all_gather(send: torch.Tensor, world: int, group: str, settings: GatherSettings) -> torch.Tensor:
    if settings.counted:  # count_comm's record of it, as eager's: the output buffer
        traced_ops.record_comm("all_gather", world * send.numel() * send.element_size())
    if settings.custom is not None:  # set_custom_all_gather
        return traced_ops.custom_all_gather(send, world, group, settings.custom)
    if not settings.out_collective:
        return _c10d.wait_tensor(_c10d.all_gather_into_tensor(send, world, group))
    gathered = send.new_empty(world * send.numel())
    _c10d.all_gather_into_tensor_out(send, world, group, out=gathered)
    return _c10d.wait_tensor(gathered)


def _reduce_scatter(
    grad: torch.Tensor, op: str, world: int, group: str, out_op: bool, counted: bool, custom: str | None
) -> torch.Tensor:
    if counted:  # the input buffer, as eager's
        traced_ops.record_comm("reduce_scatter", grad.numel() * grad.element_size())
    if custom is not None:  # set_custom_reduce_scatter
        return traced_ops.custom_reduce_scatter(grad, world, op, group, custom)
    if not out_op:
        return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(grad, op, world, group))
    reduced = grad.new_empty(grad.numel() // world)
    _c10d.reduce_scatter_tensor_out(grad, op, world, group, out=reduced)
    return _c10d.wait_tensor(reduced)


def reduce(grad: torch.Tensor, r: Reduction, bucket: str) -> torch.Tensor:
    """The gradient of a bucket's gathered row (eager's reduce-scatter input: same layout,
    padding zeroed) as ``r.mode`` keeps it: unreduced (UNSYNCED), reduce-scattered (PARTIAL), or
    reduced for ``.grad`` (SYNCED), with eager's casts, reduce ops, divisions and kept sums."""
    grad = grad.to(r.reduce_dtype).contiguous()
    if r.mode is Mode.UNSYNCED:
        return grad
    if r.takes_unsynced:  # eager: the microbatches' sum, then this backward's gradient
        grad = traced_ops.take_pending(grad, bucket, Mode.UNSYNCED)
    for divisor in r.divide_before:
        grad = grad / divisor  # fp16 would overflow summing before dividing
    reduced = _reduce_scatter(
        grad, r.reduce_scatter_op, r.world, r.shard_group, r.out_collectives, r.counted, r.custom_reduce_scatter
    )
    if r.mode is Mode.PARTIAL:
        return reduced
    if r.replicate_group is not None:
        if r.takes_partial:  # eager: the kept partial sums join this all-reduce
            reduced = traced_ops.take_pending(reduced, bucket, Mode.PARTIAL)
        if r.counted:
            traced_ops.record_comm("all_reduce", reduced.numel() * reduced.element_size())
        reduced = _c10d.wait_tensor(_c10d.all_reduce(reduced, r.all_reduce_op, r.replicate_group))
    if not r.hooked:  # else the hand-off divides and casts after the hook (see Reduction.hooked)
        if r.divide_after != 1:
            reduced = reduced / r.divide_after
        reduced = reduced.to(r.sink_dtype)
    return reduced


# -- the gradient port ----------------------------------------------------------------------------


# The port's arguments: the Reduction field by field, so that a graph's text says everything its
# backward does (a compiler's cache keyed by the graph never confuses two reductions).
_REDUCTION_SCHEMA = {
    "world": "int",
    "shard_group": "str",
    "replicate_group": "str?",
    "reduce_dtype": "ScalarType",
    "grad_dtype": "ScalarType",
    "divide_before": "float[]",
    "divide_after": "float",
    "reduce_scatter_op": "str",
    "all_reduce_op": "str",
    "out_collectives": "bool",
    "custom_reduce_scatter": "str?",
    "counted": "bool",
    "hooked": "bool",
    "mode": "int",
    "takes_unsynced": "bool",
    "takes_partial": "bool",
    "include_unused": "bool",
}
assert list(_REDUCTION_SCHEMA) == [f.name for f in dataclasses.fields(Reduction)]
_PORT_ARGS = 6  # sink, anchor, bucket, numel, dtype, params; then the reduction's fields

traced_ops.define(
    "grad_port(Tensor sink, Tensor anchor, str bucket, int numel, ScalarType dtype, int params, "
    + ", ".join(f"{kind} {name}" for name, kind in _REDUCTION_SCHEMA.items())
    + ") -> (Tensor, Tensor[])",
    lambda sink, anchor, bucket, numel, dtype, params, *reduction: (
        # Runs only where no compiler drops it (torch.compile's eager backend, or no compile).
        anchor.new_empty(numel, dtype=dtype),
        [anchor.new_empty(()) for _ in range(params)],
    ),
)


def port(
    sink: torch.Tensor, anchor: torch.Tensor, bucket: str, r: Reduction, numel: int, dtype, params: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The bucket's gradient port for one trace: ``(row, marks)`` (see the module docstring).
    ``sink`` takes the reduced gradient when backward reaches every parameter; ``anchor`` takes
    ``fsdp2::deliver``'s (empty) result otherwise, which keeps that op in the graph."""
    return torch.ops.fsdp2.grad_port.default(
        sink,
        anchor,
        bucket,
        numel,
        dtype,
        params,
        r.world,
        r.shard_group,
        r.replicate_group,
        r.reduce_dtype,
        r.grad_dtype,
        list(r.divide_before),
        r.divide_after,
        r.reduce_scatter_op,
        r.all_reduce_op,
        r.out_collectives,
        r.custom_reduce_scatter,
        r.counted,
        r.hooked,
        int(r.mode),
        r.takes_unsynced,
        r.takes_partial,
        r.include_unused,
    )


def _setup_port(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)  # a mark backward never reached stays None
    ctx.bucket = inputs[2]
    # No gradient for any input but the sink or the anchor (a list input takes a list of them).
    ctx.no_grads = tuple([None] * len(x) if isinstance(x, list) else None for x in inputs)
    fields = dict(zip(_REDUCTION_SCHEMA, inputs[_PORT_ARGS:]))
    fields["divide_before"] = tuple(fields["divide_before"])
    fields["mode"] = Mode(fields["mode"])
    ctx.reduction = Reduction(**fields)


def _reduce_port_grad(ctx, grad: torch.Tensor | None, marks: list[torch.Tensor | None]):
    """The port's backward: the bucket's reduction, to the sink or to ``fsdp2::deliver``."""
    r: Reduction = ctx.reduction
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
