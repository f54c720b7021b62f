"""Operators fsdp2 adds for the traced path (``fsdp2.runtime.traced``), as ``torch.ops.fsdp2.*``.

``record_comm(kind, nbytes)``: counts one collective in ``fsdp2.tools.comm_stats.count_comm``'s
counters when the compiled step runs (an ordered effect: kept in the graph, in program order,
forward and backward). The traced path emits it only in a step traced inside ``count_comm``.

``flat_cat(tensors)``: the tensors flattened and concatenated, as ``torch.cat([t.reshape(-1) ...])``,
but one opaque op to the compiler. It packs a bucket's shards into the all-gather input. Two or
more tensors: of one, ATen's kernel returns a view, which a custom op's output may not be (the
traced path reshapes a single tensor instead). Inductor lowers ``torch.cat`` on the CPU as one
aliasing view of the output per input, each a Python call in the compiled code on every step
(and again for the re-gather in backward); an op it does not know runs as one call to ATen's
``cat``, which copies all inputs in one kernel on any device.

It has no autograd formula: the traced path hands the all-gather's gradient to its grad sinks,
never to the shards (plain tensors that take no gradient).
"""

from __future__ import annotations

import torch

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
