"""Thin wrappers over the c10d tensor collectives we use.

torch 2.13 renames ``all_gather_into_tensor``/``reduce_scatter_tensor`` to ``*_single`` and
deprecates the old names; torch 2.11 only has the old ones. Resolve once, call the right one.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from fsdp2 import compat

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Byte counters currently recording (see fsdp2.tools.comm_stats); empty means no bookkeeping at all.
active_counters: list = []


def comm_bytes(kind: str, sent: torch.Tensor, world: int = 1) -> int:
    """The bytes count_comm counts for one collective of ``kind`` that sends ``sent`` from this
    rank over ``world`` ranks, in eager and compiled steps alike: an all-gather's output (every
    rank's ``sent``), a reduce-scatter's input, an all-reduce's or all-to-all's tensor."""
    nbytes = sent.numel() * sent.element_size()
    return world * nbytes if kind == "all_gather" else nbytes


def _record(kind: str, sent: torch.Tensor, world: int = 1) -> None:
    record(kind, comm_bytes(kind, sent, world))


def record(kind: str, nbytes: int) -> None:
    """Count one collective of ``kind`` moving ``nbytes`` in every active counter (also called by
    a compiled step's graph, through ``fsdp2.runtime.traced_ops.record_comm``)."""
    for counter in active_counters:
        counter.record(kind, nbytes)


# Dtypes every backend all-gathers natively; others (float8, unsigned ints beyond uint8, bool,
# complex) travel as their bytes, which is exact for a gather (gloo rejects float8, for one).
_NATIVE_GATHER_DTYPES = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
}


def gathered_as(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels as in an all-gather: itself, or its bytes (eager
    and compiled gathers alike)."""
    return dtype if dtype in _NATIVE_GATHER_DTYPES else torch.uint8


def all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
    """``output`` (``group_size * input.numel()``) receives every rank's ``input`` in rank order."""
    if active_counters:
        _record("all_gather", input, output.numel() // max(input.numel(), 1))
    if output.dtype not in _NATIVE_GATHER_DTYPES:  # gathered_as, inlined: no call per gather
        output, input = output.view(torch.uint8), input.view(torch.uint8)
    return _all_gather(output, input, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, async_op: bool, op: dist.ReduceOp):
    """Reduce ``input`` across ranks with ``op`` and keep this rank's ``output.numel()`` slice of the result."""
    if active_counters:
        _record("reduce_scatter", input)
    return _reduce_scatter(output, input, op=op, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group, async_op: bool, op: dist.ReduceOp):
    if active_counters:
        _record("all_reduce", tensor)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


# Backends known to take ReduceOp.PREMUL_SUM (gloo raises on it).
_PREMUL_SUM_BACKENDS = {"nccl"}


def supports_premul_sum(group) -> bool:
    try:
        backend = dist.get_backend(group)
    except ValueError:  # a group c10d's registry does not hold: assume it sums only
        return False
    return backend in _PREMUL_SUM_BACKENDS


def all_to_all(
    output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int], group, async_op: bool
):
    """Rank ``j`` receives this rank's ``input_splits[j]`` elements; we receive ``output_splits[i]`` from rank ``i``.

    Both buffers are 1-D and ordered by rank.
    """
    if active_counters:
        _record("all_to_all", input)
    return dist.all_to_all_single(output, input, output_splits, input_splits, group=group, async_op=async_op)


# -- what a compiled graph may call -----------------------------------------------------------------

# The compiled code calls each collective op through the dispatcher on every step. torch 2.13
# registers the functional collectives' autograd in Python (Python calls per op call, even without
# grad); their ``*_out`` variants have none, and inductor runs them in place into a buffer it
# allocates. ``wait_tensor`` has no such variant.
_OUT_VARIANTS_TRACEABLE = compat.out_collectives_traceable()


def out_variants_usable(group: dist.ProcessGroup) -> bool:
    """Whether a compiled graph may run ``group``'s all-gather and reduce-scatter as the
    functional collectives' ``*_out`` ops: not for a process group implemented in Python (a
    subclass, e.g. ``fsdp2.tools.noop_pg``), whose overridden methods the ``*_out`` ops go past to
    its C++ backend. Asked eagerly (a trace cannot ask a group its class)."""
    return _OUT_VARIANTS_TRACEABLE and type(group) is dist.ProcessGroup


# A user's collective objects (set_custom_all_gather / set_custom_reduce_scatter), by the key a
# compiled graph names them with; weakly: the module owns them.
_user_comms: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()


def register_user_comm(comm: object) -> str:
    """``comm``'s key, under which a compiled graph calls it (:func:`user_comm`)."""
    key = f"{type(comm).__qualname__}@{id(comm):x}"
    _user_comms[key] = comm
    return key


def user_all_gather(send: torch.Tensor, world: int, group: str, key: str) -> torch.Tensor:
    """The user's all-gather named ``key`` over the process group named ``group``, called as eager
    calls it (this rank's slot of its own buffer in place), to completion: a compiled graph's."""
    user, pg, numel = _user_comms[key], compat.process_group_named(group), send.numel()
    gathered = user.allocate((world * numel,), dtype=send.dtype, device=send.device)
    own = gathered.narrow(0, dist.get_rank(pg) * numel, numel)
    own.copy_(send.reshape(-1))
    work = user(gathered, own, pg, async_op=False)
    if work is not None:
        work.wait()
    return gathered


def user_reduce_scatter(grad: torch.Tensor, world: int, op: str, group: str, key: str) -> torch.Tensor:
    """The user's reduce-scatter named ``key`` (as :func:`user_all_gather`), reducing with c10d's
    ``op`` (a functional collective's name of it)."""
    user, pg = _user_comms[key], compat.process_group_named(group)
    reduced = user.allocate((grad.numel() // world,), dtype=grad.dtype, device=grad.device)
    work = user(reduced, grad.reshape(-1), pg, op=getattr(dist.ReduceOp, op.upper()), async_op=False)
    if work is not None:
        work.wait()
    return reduced
