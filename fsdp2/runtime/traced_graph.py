"""How one bucket's gather and reduction appear in a compiled graph: the functional collectives
and the autograd Functions the traced path (fsdp2.runtime.traced) builds a group's step from.

- :class:`GatherReduce`: forward all-gathers a bucket's flat shards; backward reduces the
  gradient of the gathered row as eager's post-backward would (:func:`_reduce_gathered_grad`,
  with eager's reduce plan in a :class:`Reduction`) and hands it to the bucket's grad sink.
- :class:`ReduceOnly`: the same backward, for buckets gathered outside autograd (tensor
  subclasses' own hooks; ``reshard_after_forward=k``'s two-stage gather).
- :class:`GradientFrom` / :class:`MarkUsed`: one unsharded parameter as the modules see it, its
  gradient routed to the bucket's row, and a mark that backward reached it.

Nothing here holds state between steps: the traced path passes in what a step needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdp2 import compat
from fsdp2.runtime import traced_ops

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
    params: int  # in the bucket: the sink's tail holds which forward used (see _reduce_gathered_grad)
    # set_custom_all_gather / set_custom_reduce_scatter: the user's objects' keys (traced_ops.register_comm)
    custom_all_gather: str | None
    custom_reduce_scatter: str | None
    counted: bool  # traced inside count_comm: the graph records its collectives (traced_ops.record_comm)
    # set_all_reduce_hook: the graph hands the reduced shard over undivided, in reduce_dtype; the
    # hand-off (eager, outside the graph) calls the hook on it, then divides and casts, as eager.
    hooked: bool
    # set_requires_all_reduce(False) under HSDP: the reduce-scattered sum goes to the hand-off, kept
    # for the next backward's all-reduce (eager: GroupReduce's partial sums); nothing reaches .grad.
    all_reduce: bool = True
    # The bytes backward gathers again (recomputing a gather of reshard_after_forward), which
    # backward records for count_comm: a recomputed region's own record op is not recomputed.
    regathered_bytes: int = 0

    @property
    def sink_dtype(self) -> torch.dtype:
        """The dtype the bucket's reduced flat shard reaches its grad sink in: the reduce dtype where
        the hand-off finishes it (the all-reduce hook) or may keep it (HSDP's partial sums)."""
        return self.reduce_dtype if self.hooked or self.replicate_group is not None else self.grad_dtype


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


def all_gather(
    send: torch.Tensor, world: int, group: str, out_op: bool, counted: bool, custom: str | None
) -> torch.Tensor:
    if counted:  # count_comm's record of it, as eager's: the output buffer
        traced_ops.record_comm("all_gather", world * send.numel() * send.element_size())
    if custom is not None:  # set_custom_all_gather
        return traced_ops.custom_all_gather(send, world, group, custom)
    if not out_op:
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


def _reduce_gathered_grad(ctx, grad: torch.Tensor, used: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward of a bucket's gather: ``(the grad sink's gradient, the accumulator's)``.

    The sink's gradient is the reduced flat shard (zeros without gradient sync, when the
    unreduced gradient goes to the accumulator instead), then a tail: per parameter whether this
    backward reached it (``used``: 1 where :class:`GradientFrom`'s backward ran, i.e. forward
    used the parameter), then 1 if the gradients were synced (2 if they are an HSDP partial sum to
    keep, ``Reduction.all_reduce``). Eager reduces and writes only parameters some backward reached
    (a gradient exists); the hand-off reads the tail to match.
    """
    r: Reduction = ctx.reduction
    if r.counted and r.regathered_bytes:
        traced_ops.record_comm("all_gather", r.regathered_bytes)
    grad = grad.to(r.reduce_dtype).contiguous()
    if not ctx.sync:
        tail = torch.cat([used.to(r.sink_dtype), used.new_zeros(1, dtype=r.sink_dtype)])
        return torch.cat([tail.new_zeros(grad.numel() // r.world), tail]), grad
    accumulated, partial = ctx.saved_tensors
    if accumulated is not None:
        grad = accumulated + grad  # eager: the microbatches' sum, then this backward's gradient
    for divisor in r.divide_before:
        grad = grad / divisor  # fp16 would overflow summing before dividing
    reduced = _reduce_scatter(
        grad, r.reduce_scatter_op, r.world, r.shard_group, r.out_collectives, r.counted, r.custom_reduce_scatter
    )
    if r.replicate_group is not None:
        if partial is not None:
            reduced = reduced + partial  # eager: the kept partial sums join this all-reduce
        if not r.all_reduce:
            return torch.cat([reduced, used.to(reduced.dtype), reduced.new_full((1,), 2)]), None
        if r.counted:
            traced_ops.record_comm("all_reduce", reduced.numel() * reduced.element_size())
        reduced = _c10d.wait_tensor(_c10d.all_reduce(reduced, r.all_reduce_op, r.replicate_group))
    if not r.hooked:  # else the hand-off divides and casts after the hook (see Reduction.hooked)
        if r.divide_after != 1:
            reduced = reduced / r.divide_after
        reduced = reduced.to(r.sink_dtype)
    return torch.cat([reduced, used.to(reduced.dtype), reduced.new_ones(1)]), None


class GatherReduce(torch.autograd.Function):
    """Forward: all-gather a bucket's flat padded shards in ``param_dtype``. Backward: reduce the
    gradient of the gathered row as eager's post-backward reduces a group's gradients, and hand
    the reduced flat shard to ``grad_sink`` (a leaf; ``flat_shards`` takes no gradient); without
    gradient sync, hand it unreduced to ``accumulator`` (a leaf: autograd sums it over
    microbatches), and add what it holds (``accumulated``) into the next synced reduction."""

    @staticmethod
    def forward(
        ctx, grad_sink, flat_shards, accumulator, accumulated, partial, param_dtype, reduction: Reduction, sync: bool
    ):
        ctx.reduction, ctx.sync = reduction, sync
        ctx.save_for_backward(accumulated, partial)
        gathered = all_gather(
            flat_shards.to(param_dtype),
            reduction.world,
            reduction.shard_group,
            reduction.out_collectives,
            reduction.counted,
            reduction.custom_all_gather,
        )
        return gathered, gathered.new_zeros(reduction.params)  # the second: see GradientFrom

    @staticmethod
    def backward(ctx, grad: torch.Tensor, used: torch.Tensor):
        to_sink, to_accumulator = _reduce_gathered_grad(ctx, grad, used)
        return to_sink, None, to_accumulator, None, None, None, None, None


class ReduceOnly(torch.autograd.Function):
    """The backward half of :class:`GatherReduce`, for a bucket of parameters gathered through
    their tensor subclass's own hooks (its float8 bytes travel outside autograd). Forward returns
    an uninitialised row of the gathered size in ``param_dtype`` that no op reads (a compiler
    drops it): the unsharded parameters' gradients reach this backward through it
    (:class:`GradientFrom`), and it reduces them as :class:`GatherReduce` does."""

    @staticmethod
    def forward(
        ctx, grad_sink, like, accumulator, accumulated, partial, numel, param_dtype, reduction: Reduction, sync: bool
    ):
        ctx.reduction, ctx.sync = reduction, sync
        ctx.save_for_backward(accumulated, partial)
        return like.new_empty(numel, dtype=param_dtype), like.new_zeros(reduction.params, dtype=param_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor, used: torch.Tensor):
        to_sink, to_accumulator = _reduce_gathered_grad(ctx, grad, used)
        return to_sink, None, to_accumulator, None, None, None, None, None, None


class GradientFrom(torch.autograd.Function):
    """One unsharded parameter as the modules see it: ``unsharded`` (a view of the gathered row,
    or a tensor a subclass's post-all-gather hook built outside autograd, e.g. torchao's float8
    weight), its gradient (``param_dtype``, the parameter's shape) going to ``carrier`` (its part
    of the gathered row, or of a :class:`ReduceOnly` row), and a 1 to ``used``, its slot in the
    bucket's usage row, only if backward reaches it (forward used the parameter)."""

    @staticmethod
    def forward(ctx, carrier, unsharded, used):
        ctx.used = (used.dtype, used.device)  # not from ``grad``: it may be a subclass (float8's)
        return unsharded.view_as(unsharded)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.used
        return grad, None, torch.ones((), dtype=dtype, device=device)


class MarkUsed(torch.autograd.Function):
    """One unsharded parameter, a view of the gathered row, as the modules see it: its gradient
    flows to the row as a view's would, and a 1 to ``used`` (as :class:`GradientFrom`)."""

    @staticmethod
    def forward(ctx, unsharded, used):
        return unsharded.view_as(unsharded)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_ones(())


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` flattened side by side: one op, not torch.cat (see traced_ops); one tensor is
    its own flat view (a custom op's output may not alias its input)."""
    return tensors[0].reshape(-1) if len(tensors) == 1 else traced_ops.flat_cat(tensors)


def takes_grad(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _recompute_everything(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def recompute_in_backward():
    return create_selective_checkpoint_contexts(_recompute_everything)
