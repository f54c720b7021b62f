"""A process group whose collectives do nothing: rank 0 of N simulated in one process, at no cost in N.

PyTorch's ``fake`` process group also simulates one rank, but its all-gathers copy the input into
every one of the N output chunks (so that DeviceMesh's init-time checks see consistent data): at
N = 1024 that is a thousand device copies per all-gather, which swamps what a benchmark means to
measure (the FSDP implementation's own cost). Here every collective returns a completed work at
once and touches no tensor: an all-gather's output keeps what it held (with an in-place
all-gather that is the caller's own input in its slot and stale memory elsewhere), a
reduce-scatter's output, an all-reduce's tensor and a broadcast's tensor are left as they were.
Values are therefore meaningless; shapes, memory and the caller's own work are what they would be
on rank 0 of N.

    from fsdp2.tools.noop_pg import init_noop_process_group
    pg = init_noop_process_group(1024)        # this process is rank 0 of 1024
    mesh = init_device_mesh("cpu", (1024,))   # any mesh shape; sub-groups are no-op groups too
    ...
    pg.calls                                  # Counter: collective kind -> calls (all groups: noop_calls())

Every collective of the Python c10d API and of the functional collectives DTensor uses is
answered here, on CPU and CUDA tensors alike. Anything that still reached the backend underneath
(the ``fake`` one, registered so that group names and backend queries work) raises, where torch
lets us ask for that, rather than silently copying.
"""

from __future__ import annotations

import collections
import weakref

import torch
import torch.distributed as dist
from torch.futures import Future

from fsdp2 import compat

BACKEND_NAME = "noop"

# Every ProcessGroup method a collective can arrive through, by the kind it is counted as. torch 2.13
# binds the single-tensor collectives as ``all_gather_single`` etc.; 2.11 as ``_allgather_base``
# etc.; the C++ functional collectives call the ``*_coalesced`` and ``alltoall_base`` virtuals.
_COLLECTIVES = {
    "all_gather": (
        "allgather",
        "allgather_coalesced",
        "_allgather_base",
        "all_gather_single",
        "allgather_into_tensor_coalesced",
        "all_gather_single_coalesced",
    ),
    "reduce_scatter": (
        "reduce_scatter",
        "_reduce_scatter_base",
        "reduce_scatter_single",
        "reduce_scatter_tensor_coalesced",
        "reduce_scatter_single_coalesced",
    ),
    "all_reduce": ("allreduce", "allreduce_coalesced"),
    "all_to_all": ("alltoall", "alltoall_base", "all_to_all_single"),
    "broadcast": ("broadcast",),
    "reduce": ("reduce",),
    "gather": ("gather",),
    "scatter": ("scatter",),
    "barrier": ("barrier", "monitored_barrier"),
    "send": ("send",),
    "recv": ("recv", "recv_anysource"),
}

_groups: "weakref.WeakSet[NoopProcessGroup]" = weakref.WeakSet()  # the live no-op groups, for noop_calls()


def _completed_work():
    future = Future()
    future.set_result(None)
    return compat.work_from_future(future)


class NoopProcessGroup(dist.ProcessGroup):
    """One group of the simulated world. ``calls`` counts its collectives by kind."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self.calls: collections.Counter[str] = collections.Counter()
        # c10d keeps the group's name, description and sequence numbers on a backend; give it the
        # fake one for that bookkeeping (its collectives are never reached: see _COLLECTIVES).
        backend = compat.fake_process_group_backend(rank, size)
        for device in ("cpu", "cuda"):
            compat.register_process_group_backend(
                self, torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, backend
            )
        # c10d asks a group for its default backend when it attaches its own hooks (torch 2.15's
        # flight recorder): that is the fake one above too.
        compat.set_default_process_group_backend(self, dist.ProcessGroup.BackendType.CUSTOM)
        _groups.add(self)

    def getBackendName(self) -> str:  # noqa: N802 - the c10d name
        return BACKEND_NAME

    def _start_coalescing(self, device) -> None:
        pass

    def _end_coalescing(self, device):
        return _completed_work()

    def __repr__(self) -> str:
        return f"NoopProcessGroup(rank={self.rank()}, size={self.size()})"


def _collective(kind: str):
    def collective(self, *args, **kwargs):
        self.calls[kind] += 1
        return _completed_work()

    collective.__doc__ = f"Counted as {kind!r}; touches no tensor, returns a completed work."
    return collective


for _kind, _names in _COLLECTIVES.items():
    for _name in _names:
        setattr(NoopProcessGroup, _name, _collective(_kind))


def _create(store, rank: int, world_size: int, timeout) -> NoopProcessGroup:
    return NoopProcessGroup(rank, world_size)


def register_backend() -> None:
    """Make ``dist.init_process_group("noop", ...)`` and ``new_group(backend="noop")`` available (idempotent)."""
    if not compat.backend_registered(BACKEND_NAME):
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])


def init_noop_process_group(world_size: int, rank: int = 0) -> NoopProcessGroup:
    """Make this process ``rank`` of a ``world_size``-rank world whose collectives do nothing."""
    if dist.is_initialized():
        raise RuntimeError(
            "init_noop_process_group: a default process group already exists in this process; "
            "call torch.distributed.destroy_process_group() first"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"init_noop_process_group: rank {rank} is outside a world of {world_size} ranks")
    register_backend()
    _groups.clear()  # noop_calls() counts the groups of this world only
    dist.init_process_group(BACKEND_NAME, store=dist.HashStore(), rank=rank, world_size=world_size)
    return compat.default_process_group()


def noop_calls() -> collections.Counter[str]:
    """Collectives called on the no-op groups of the current world (default group and sub-groups), by kind."""
    total: collections.Counter[str] = collections.Counter()
    for group in _groups:
        total.update(group.calls)
    return total
