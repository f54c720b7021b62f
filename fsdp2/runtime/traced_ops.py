"""Operators fsdp2 adds for the traced path (``fsdp2.runtime.traced``), as ``torch.ops.fsdp2.*``.

Each runs eagerly as written here when the compiled graph runs; compilers see one opaque op.

- ``flat_cat(tensors)``: the tensors flattened side by side (a bucket's all-gather row) in one ATen
  ``cat`` call, where inductor lowers ``torch.cat`` on the CPU as one aliasing view per input, a
  Python call each per step. Two or more tensors (ATen returns a view of one, which a custom op's
  output may not be).
- ``record_comm(kind, nbytes)``: one collective in ``count_comm``'s counters, as an ordered effect
  (it stays in the graph, in program order); emitted only in a step traced inside ``count_comm``.
- ``custom_all_gather`` / ``custom_reduce_scatter``: the user's collective of
  ``set_custom_all_gather`` / ``set_custom_reduce_scatter``, by its key
  (``collectives.user_all_gather``).
- ``grad_port`` (defined by fsdp2.runtime.traced_graph), and the run-time hand-offs of a compiled
  backward to objects registered with :func:`register_route`: ``take_kept_sums`` (sums kept for an
  accumulation added in once), ``deliver`` (a bucket's gradient when backward reached only some of
  its parameters; fsdp2.runtime.grad_sinks) and ``end_backward`` (the root call's end of a compiled
  backward; fsdp2.runtime.hooks.FSDPState.compiled_backward_runs).

None has an autograd formula but the port's: the all-gather's gradient goes to the port, never to
the shards (plain tensors that take no gradient).
"""

from __future__ import annotations

import weakref

import torch

from fsdp2 import compat
from fsdp2.runtime import collectives

_lib = torch.library.Library("fsdp2", "FRAGMENT")


def define(schema: str, impl, fake=None):
    """Define ``fsdp2::<schema>`` with ``impl`` as its kernel and ``fake`` (default ``impl``) as
    its shape function; returns the op."""
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fsdp2::{name}", fake or impl, lib=_lib)
    return getattr(torch.ops.fsdp2, name).default


flat_cat = define(
    "flat_cat(Tensor[] tensors) -> Tensor",
    compat.flatten_dense_tensors,
    lambda tensors: tensors[0].new_empty(sum(t.numel() for t in tensors)),
)
record_comm = define("record_comm(str kind, int nbytes) -> ()", collectives.record, lambda kind, nbytes: None)
# False on a torch that cannot keep it in a graph: count_comm around a compiled step is refused there.
records_comm = compat.register_ordered_effect(record_comm)


custom_all_gather = define(
    "custom_all_gather(Tensor send, int world, str group, str comm) -> Tensor",
    collectives.user_all_gather,
    lambda send, world, group, comm: send.new_empty(world * send.numel()),
)
custom_reduce_scatter = define(
    "custom_reduce_scatter(Tensor grad, int world, str op, str group, str comm) -> Tensor",
    collectives.user_reduce_scatter,
    lambda grad, world, op, group, comm: grad.new_empty(grad.numel() // world),
)


# -- a compiled backward's run-time hand-offs ---------------------------------------------------

# The objects a compiled backward hands gradients to, by the key its graph names them with
# (weakly: their group owns them).
_routes: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()


def register_route(route: object) -> str:
    """Make ``route`` reachable from graphs; returns its key."""
    key = f"{type(route).__qualname__}@{id(route):x}"
    _routes[key] = route
    return key


def _end_backward(grad: torch.Tensor, state: str) -> torch.Tensor:
    route = _routes[state]
    route.compiled_backward_runs()
    return route.end_anchor.new_empty(0)


take_kept_sums = define(
    "take_kept_sums(Tensor grad, str bucket, int kind) -> Tensor",
    lambda grad, bucket, kind: _routes[bucket].take(grad, kind),
    lambda grad, bucket, kind: torch.empty_like(grad),
)
# Its result is the anchor's gradient (grad_sinks): empty, only so the op stays in the graph.
deliver = define(
    "deliver(Tensor grad, str bucket, int mode, int[] reached) -> Tensor",
    lambda grad, bucket, mode, reached: _routes[bucket].deliver(grad, mode, reached),
    lambda grad, bucket, mode, reached: grad.new_empty(0, dtype=torch.float32),
)
# ``grad``: the output gradient, only so the op belongs to the backward (with no input a
# partitioner may run it in forward).
end_backward = define(
    "end_backward(Tensor grad, str state) -> Tensor",
    _end_backward,
    lambda grad, state: grad.new_empty(0, dtype=torch.float32),
)
