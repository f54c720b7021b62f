"""Operators fsdp2 adds for the traced path (``fsdp2.runtime.traced``), as ``torch.ops.fsdp2.*``.

``record_comm(kind, nbytes)``: counts one collective in ``fsdp2.tools.comm_stats.count_comm``'s
counters when the compiled step runs (an ordered effect: kept in the graph, in program order,
forward and backward). The traced path emits it only in a step traced inside ``count_comm``.

``custom_all_gather(send, world, group, comm)`` / ``custom_reduce_scatter(grad, world, op, group, comm)``:
a user's collective (``set_custom_all_gather`` / ``set_custom_reduce_scatter``: an object with
``allocate`` and ``__call__``, PyTorch FSDP2's protocol) called as eager calls it, from the graph,
as one opaque op; ``comm`` is its key (``collectives.register_user_comm``), ``group`` a process
group name.

``flat_cat(tensors)``: the tensors flattened and concatenated, as ``torch.cat([t.reshape(-1) ...])``,
but one opaque op to the compiler. It packs a bucket's shards into the all-gather input. Two or
more tensors: of one, ATen's kernel returns a view, which a custom op's output may not be (the
traced path reshapes a single tensor instead). Inductor lowers ``torch.cat`` on the CPU as one
aliasing view of the output per input, each a Python call in the compiled code on every step
(and again for the re-gather in backward); an op it does not know runs as one call to ATen's
``cat``, which copies all inputs in one kernel on any device.

It has no autograd formula: the traced path routes the all-gather's gradient to its bucket's
gradient port, never to the shards (plain tensors that take no gradient).

``grad_port`` (defined with :func:`define` by fsdp2.runtime.traced_graph, whose reduction it
carries): where one bucket's gradients meet in a compiled step.

``end_backward(grad, state)``: a compiled backward has begun under the root call ``state`` (a key from
:func:`register_route`, of fsdp2.runtime.hooks.FSDPState): it queues the eager end of that
backward, which reduces what the graph did not (fsdp2.runtime.traced_graph.EndOfBackward).

``take_pending(grad, bucket, kind)`` / ``deliver(grad, bucket, mode, reached)``: a compiled backward
reading and writing a bucket's gradient state at run time: the sums kept by backwards without
gradient sync (or, under HSDP, without the all-reduce) added in once, and a bucket's gradient
handed over when backward reached only some of its parameters. ``bucket`` is the key of an object
registered with :func:`register_route` (fsdp2.runtime.traced_grads.BucketGrads).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed

from fsdp2 import compat
from fsdp2.runtime import collectives

_lib = torch.library.Library("fsdp2", "FRAGMENT")
_lib.define("flat_cat(Tensor[] tensors) -> Tensor")
_lib.impl("flat_cat", compat.flatten_dense_tensors, "CompositeExplicitAutograd")


@torch.library.register_fake("fsdp2::flat_cat", lib=_lib)
def _flat_cat_fake(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0].new_empty(sum(t.numel() for t in tensors))


flat_cat = torch.ops.fsdp2.flat_cat.default


_lib.define("record_comm(str kind, int nbytes) -> ()")
_lib.impl("record_comm", collectives.record, "CompositeExplicitAutograd")


@torch.library.register_fake("fsdp2::record_comm", lib=_lib)
def _record_comm_fake(kind: str, nbytes: int) -> None:
    return None


# False on a torch that cannot keep it in a graph: count_comm around a compiled step is refused there.
records_comm = compat.register_ordered_effect(torch.ops.fsdp2.record_comm.default)
record_comm = torch.ops.fsdp2.record_comm.default


def _custom_all_gather(send: torch.Tensor, world: int, group: str, comm: str) -> torch.Tensor:
    user, pg, numel = collectives.user_comm(comm), compat.process_group_named(group), send.numel()
    gathered = user.allocate((world * numel,), dtype=send.dtype, device=send.device)
    own = gathered.narrow(0, torch.distributed.get_rank(pg) * numel, numel)
    own.copy_(send.reshape(-1))
    work = user(gathered, own, pg, async_op=False)  # eager's call: this rank's slot is in place
    if work is not None:
        work.wait()
    return gathered


def _custom_reduce_scatter(grad: torch.Tensor, world: int, op: str, group: str, comm: str) -> torch.Tensor:
    user, pg = collectives.user_comm(comm), compat.process_group_named(group)
    reduced = user.allocate((grad.numel() // world,), dtype=grad.dtype, device=grad.device)
    work = user(reduced, grad.reshape(-1), pg, op=getattr(torch.distributed.ReduceOp, op.upper()), async_op=False)
    if work is not None:
        work.wait()
    return reduced


_lib.define("custom_all_gather(Tensor send, int world, str group, str comm) -> Tensor")
_lib.impl("custom_all_gather", _custom_all_gather, "CompositeExplicitAutograd")
_lib.define("custom_reduce_scatter(Tensor grad, int world, str op, str group, str comm) -> Tensor")
_lib.impl("custom_reduce_scatter", _custom_reduce_scatter, "CompositeExplicitAutograd")


@torch.library.register_fake("fsdp2::custom_all_gather", lib=_lib)
def _custom_all_gather_fake(send: torch.Tensor, world: int, group: str, comm: str) -> torch.Tensor:
    return send.new_empty(world * send.numel())


@torch.library.register_fake("fsdp2::custom_reduce_scatter", lib=_lib)
def _custom_reduce_scatter_fake(grad: torch.Tensor, world: int, op: str, group: str, comm: str) -> torch.Tensor:
    return grad.new_empty(grad.numel() // world)


custom_all_gather = torch.ops.fsdp2.custom_all_gather.default
custom_reduce_scatter = torch.ops.fsdp2.custom_reduce_scatter.default


# -- a bucket's gradients -------------------------------------------------------------------------


def define(schema: str, impl) -> None:
    """Define ``fsdp2::<schema>`` with ``impl`` as its kernel and its fake (shape) function."""
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fsdp2::{name}", impl, lib=_lib)


# The objects a compiled backward hands gradients to, by the key its graph names them with
# (weakly: their group owns them).
_routes: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()


def register_route(route: object) -> str:
    """Make ``route`` (with ``take(grad, kind)`` and ``deliver(grad, mode, reached)``) reachable
    from graphs; returns its key."""
    key = f"{type(route).__qualname__}@{id(route):x}"
    _routes[key] = route
    return key


_lib.define("take_pending(Tensor grad, str bucket, int kind) -> Tensor")
_lib.impl("take_pending", lambda grad, bucket, kind: _routes[bucket].take(grad, kind), "CompositeExplicitAutograd")


@torch.library.register_fake("fsdp2::take_pending", lib=_lib)
def _take_pending_fake(grad: torch.Tensor, bucket: str, kind: int) -> torch.Tensor:
    return torch.empty_like(grad)


take_pending = torch.ops.fsdp2.take_pending.default

_lib.define("deliver(Tensor grad, str bucket, int mode, int[] reached) -> Tensor")
_lib.impl(
    "deliver",
    lambda grad, bucket, mode, reached: _routes[bucket].deliver(grad, mode, reached),
    "CompositeExplicitAutograd",
)


@torch.library.register_fake("fsdp2::deliver", lib=_lib)
def _deliver_fake(grad: torch.Tensor, bucket: str, mode: int, reached: list[int]) -> torch.Tensor:
    return grad.new_empty(0, dtype=torch.float32)  # the anchor's gradient: see traced_grads


deliver = torch.ops.fsdp2.deliver.default


def _end_backward(grad: torch.Tensor, state: str) -> torch.Tensor:
    route = _routes[state]
    route.compiled_backward_runs()
    return route.end_anchor.new_empty(0)


# ``grad``: the output gradient, only so the op belongs to the backward (with no input a
# partitioner may run it in forward).
_lib.define("end_backward(Tensor grad, str state) -> Tensor")
_lib.impl("end_backward", _end_backward, "CompositeExplicitAutograd")


@torch.library.register_fake("fsdp2::end_backward", lib=_lib)
def _end_backward_fake(grad: torch.Tensor, state: str) -> torch.Tensor:
    return grad.new_empty(0, dtype=torch.float32)


end_backward = torch.ops.fsdp2.end_backward.default
