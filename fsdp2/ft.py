"""Fault-tolerant HSDP on torchft: the replicate dim is torchft's, the shard dim is ours.

Each replica group is its own job (its own torchrun, its own 1-D shard mesh); the groups find
each other through torchft's lighthouse. Per step, every rank of every group:

1. ``begin_step()``: joins the step's quorum. A group that is behind (new, restarted) first
   receives the live sharded model and optimizer state from a peer group, shard rank r from
   shard rank r, and is checked against this group's layout (the model, how it is fully_shard'ed,
   the optimizer) before anything is loaded.
2. forward / backward: each FSDP module's reduced gradient bucket is averaged across the
   quorum's groups by the torchft ``Manager`` (``set_all_reduce_hook``, as torchtitan wires
   PyTorch's FSDP2). A failed all-reduce does not raise: the manager records it.
3. ``commit_step()``: the optimizer steps only if every rank of this group saw its all-reduces
   succeed and the quorum was large enough; otherwise no rank of the group steps.

The same object drives PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``): it only needs
``set_all_reduce_hook`` and DTensor parameters.
"""

from __future__ import annotations

import enum
import os
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from fsdp2 import compat
from fsdp2.errors import FSDPUsageError, FSDPUsageTypeError
from fsdp2.policies import reduce_dtype_of

__all__ = ["DEFAULT_QUORUM_RETRIES", "FaultTolerantHSDP", "QuorumTimeoutError", "ReplicaLayout"]

# How often a group's manager asks the lighthouse again after a failed quorum request, within the
# quorum timeout: torchft's default, 0, lets a lighthouse restart kill every group.
DEFAULT_QUORUM_RETRIES = 3


def _require_torchft() -> None:
    try:
        import torchft  # noqa: F401
    except ImportError as e:
        raise ImportError('fsdp2.ft needs torchft: pip install "fsdp2[ft]"') from e


# One fully_shard unit: the module(s) it was applied to, the parameters whose gradients it
# reduces (in order) and the dtype its reduced gradient bucket has when it is all-reduced.
_UnitLayout = tuple[str, tuple[str, ...], str]
# The optimizer: its class and the parameters of each of its param groups, by name.
_OptimizerLayout = tuple[str, tuple[tuple[str, ...], ...]]


@dataclass(frozen=True)
class ReplicaLayout:
    """What two replica groups must share for one to heal from the other and then all-reduce
    with it: every parameter's name, global shape and dtype; the shard world size (shard rank r
    heals from shard rank r); the fully_shard units (which module reduces which parameters, in
    which dtype: each unit's reduced gradients are one all-reduce across the groups, of that size);
    and the optimizer (its class and its param groups, whose state is loaded by position)."""

    shard_world_size: int
    params: tuple[tuple[str, tuple[int, ...], str], ...]
    units: tuple[_UnitLayout, ...] = ()
    optimizer: _OptimizerLayout = ("", ())

    @classmethod
    def of(
        cls, model: nn.Module, shard_world_size: int, optimizer: torch.optim.Optimizer | None = None
    ) -> "ReplicaLayout":
        params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters())
        units = tuple(u.layout() for u in _fsdp_units(model)[0])
        return cls(
            shard_world_size, params, units, _optimizer_layout(optimizer, model) if optimizer is not None else ("", ())
        )

    def as_dict(self) -> dict:
        return {
            "shard_world_size": self.shard_world_size,
            "params": [list(p) for p in self.params],
            "units": [[module, list(names), dtype] for module, names, dtype in self.units],
            "optimizer": [self.optimizer[0], [list(group) for group in self.optimizer[1]]],
        }

    @classmethod
    def from_dict(cls, d: Any) -> "ReplicaLayout":
        try:
            return cls(
                int(d["shard_world_size"]),
                tuple((str(n), tuple(s), str(t)) for n, s, t in d["params"]),
                tuple((str(m), tuple(str(n) for n in names), str(t)) for m, names, t in d["units"]),
                (str(d["optimizer"][0]), tuple(tuple(str(n) for n in group) for group in d["optimizer"][1])),
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise FSDPUsageError(
                f"fsdp2.ft: the peer's state has no readable layout ({e!r}); is it running fsdp2.ft, the same "
                "fsdp2 version as this group?"
            ) from e

    def mismatch(self, peer: "ReplicaLayout") -> str | None:
        """Why this group cannot take ``peer``'s state, or None if it can."""
        if self.shard_world_size != peer.shard_world_size:
            return (
                f"this replica group has {self.shard_world_size} shard ranks, the live groups have "
                f"{peer.shard_world_size}; start it with the same number of ranks (torchrun --nproc_per_node)"
            )
        return self._params_mismatch(peer) or self._units_mismatch(peer) or self._optimizer_mismatch(peer)

    def _params_mismatch(self, peer: "ReplicaLayout") -> str | None:
        mine, theirs = dict((n, (s, t)) for n, s, t in self.params), dict((n, (s, t)) for n, s, t in peer.params)
        for name in list(mine) + [n for n in theirs if n not in mine]:  # the model's order: the first difference
            if name not in theirs:
                return f"parameter {name!r} is not in the live groups' model; run the same model on every replica group"
            if name not in mine:
                return (
                    f"the live groups' model has parameter {name!r}, this one does not; "
                    "run the same model on every replica group"
                )
            if mine[name] != theirs[name]:
                (s, t), (ps, pt) = mine[name], theirs[name]
                return (
                    f"parameter {name!r} is {list(s)} {t} here, {list(ps)} {pt} on the live groups; run the same model"
                )
        return None

    def _units_mismatch(self, peer: "ReplicaLayout") -> str | None:
        fix = "apply fully_shard to the same modules, with the same mp_policy, on every replica group"
        mine, theirs = [m for m, _, _ in self.units], [m for m, _, _ in peer.units]
        if mine != theirs:
            return (
                f"the model is fully_shard'ed differently: fully_shard was applied to {_unit_names(mine)} here, to "
                f"{_unit_names(theirs)} on the live groups (each one's gradients are one all-reduce across the "
                f"groups); {fix}"
            )
        for (module, names, dtype), (_, peer_names, peer_dtype) in zip(self.units, peer.units):
            if names != peer_names:
                return (
                    f"fully_shard({_unit_name(module)}) reduces {_names(names)} here, {_names(peer_names)} on the "
                    f"live groups; {fix}"
                )
            if dtype != peer_dtype:
                return (
                    f"fully_shard({_unit_name(module)}) reduces gradients in {dtype} here, {peer_dtype} on the live "
                    f"groups (MixedPrecisionPolicy reduce_dtype/param_dtype); {fix}"
                )
        return None

    def _optimizer_mismatch(self, peer: "ReplicaLayout") -> str | None:
        (cls, groups), (peer_cls, peer_groups) = self.optimizer, peer.optimizer
        if cls != peer_cls:
            return (
                f"the optimizer is {cls} here, {peer_cls} on the live groups, whose optimizer state this group "
                "would load; use the same optimizer on every replica group"
            )
        if groups != peer_groups:
            if len(groups) != len(peer_groups):
                return (
                    f"the optimizer {cls} has {len(groups)} param groups here, {len(peer_groups)} on the live groups; "
                    "build the optimizer with the same param groups on every replica group"
                )
            i = next(i for i, (a, b) in enumerate(zip(groups, peer_groups)) if a != b)
            return (
                f"param group {i} of the optimizer {cls} holds {_names(groups[i])} here, "
                f"{_names(peer_groups[i])} on the "
                "live groups (its state is loaded by position); build the optimizer with the same parameters, in the "
                "same order, on every replica group"
            )
        return None


def _unit_name(module: str) -> str:
    return repr(module) if module else "the root module"


def _unit_names(modules: list[str], shown: int = 6) -> str:
    listed = ", ".join(_unit_name(m) for m in modules[:shown])
    return listed + (f", ... ({len(modules)} in all)" if len(modules) > shown else "") if modules else "no module"


def _names(names: tuple[str, ...], shown: int = 4) -> str:
    listed = ", ".join(repr(n) for n in names[:shown])
    more = f", ... ({len(names)} in all)" if len(names) > shown else ""
    return f"[{listed}{more}]"


@dataclass
class _Unit:
    """One fully_shard call's state as found on the model (fsdp2's or PyTorch's FSDP2)."""

    modules: list[str]
    state: Any
    params: list[tuple[str, nn.Parameter]]

    def layout(self) -> _UnitLayout:
        return "+".join(self.modules), tuple(n for n, _ in self.params), self.reduce_dtype()

    def reduce_dtype(self) -> str:
        from fsdp2.runtime.torch_view import TorchStateView

        if not self.params:
            return str(None)  # nothing to reduce, no all-reduce
        mp = (
            self.state._state.mp_policy
            if isinstance(self.state, TorchStateView)
            else compat.torch_fsdp_mp_policy(self.state)
        )
        trainable = [p for _, p in self.params if p.requires_grad] or [p for _, p in self.params]
        return str(reduce_dtype_of(trainable[0], mp))


def _fsdp_units(model: nn.Module) -> tuple[list[_Unit], list[str]]:
    """The model's fully_shard units in module order, each with the parameters it manages (those
    below it and not below a nested unit), and the trainable parameters no unit averages (not
    under any fully_shard'ed module, or left plain tensors there: ignored_params)."""
    state_of = compat.torch_fully_shard_home().fully_shard.state  # answers for fsdp2's modules too
    units: dict[int, _Unit] = {}
    unit_of_module: dict[str, _Unit] = {}
    for name, module in model.named_modules():
        if isinstance(module, compat.TorchFSDPModule):
            state = state_of(module)
            unit = units.setdefault(id(state), _Unit([], state, []))
            unit.modules.append(name)
            unit_of_module[name] = unit
    not_averaged = []
    for name, param in model.named_parameters():
        owner = _innermost(unit_of_module, name)
        if owner is not None and isinstance(param, DTensor):
            owner.params.append((name, param))
        elif param.requires_grad:
            not_averaged.append(name)
    return list(units.values()), not_averaged


def _innermost(unit_of_module: dict[str, _Unit], param_name: str) -> _Unit | None:
    """The unit of the innermost fully_shard'ed module holding ``param_name``."""
    parts = param_name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        unit = unit_of_module.get(".".join(parts[:i]))
        if unit is not None:
            return unit
    return None


def _optimizer_layout(optimizer: torch.optim.Optimizer, model: nn.Module) -> _OptimizerLayout:
    names = {id(p): n for n, p in model.named_parameters()}
    groups = tuple(
        tuple(names.get(id(p), f"<a parameter not in the model, shape {list(p.shape)}>") for p in group["params"])
        for group in optimizer.param_groups
    )
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}", groups


@dataclass
class _Shard:
    """A DTensor's local shard on the wire (the transport pickles plain tensors; a DTensor would
    carry its device mesh, which means nothing in another process)."""

    local: torch.Tensor


class _Phase(enum.Enum):
    BETWEEN_STEPS = "between steps"
    IN_STEP = "in a step"  # quorum joined; forward/backward/all-reduces may run
    CLOSED = "closed"


class QuorumTimeoutError(TimeoutError):
    """``begin_step`` got no quorum of ``min_replicas`` groups within ``quorum_timeout`` (the
    lighthouse is down or unreachable, or fewer groups asked for one), or the constructor could not
    reach the lighthouse within ``timeout``. Raised on every rank of the group."""


# Arguments torchft's Manager takes that FaultTolerantHSDP sets itself: manager_kwargs must not.
_MANAGER_ARGUMENTS = {
    "pg": None,
    "load_state_dict": None,
    "state_dict": None,
    "use_async_quorum": None,
    "min_replica_size": "min_replicas",
    "timeout": "timeout",
    "quorum_timeout": "quorum_timeout",
    "connect_timeout": "timeout",
    "lighthouse_addr": "lighthouse",
    "replica_id": "replica_id",
    "init_sync": "init_sync",
    "quorum_retries": "quorum_retries",
}

# What torchft's Manager reads from torchrun's environment unless manager_kwargs gives it.
_GROUP_ENVIRONMENT = (
    ("MASTER_ADDR", "store_addr"),
    ("MASTER_PORT", "store_port"),
    ("RANK", "rank"),
    ("WORLD_SIZE", "world_size"),
)

# How long begin_step waits before it asks the lighthouse again after a quorum of fewer than
# min_replicas groups (the lighthouse answers at once while no other group asks).
_QUORUM_POLL_S = 0.2

# Each fully_shard'ed module's current FaultTolerantHSDP (its all-reduce hook calls that one).
_HOOK_OWNERS: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[FaultTolerantHSDP]]" = weakref.WeakKeyDictionary()


class FaultTolerantHSDP:
    """One rank of one replica group of a fault-tolerant HSDP job.

    ``model`` is fully_shard'ed on this group's 1-D shard mesh (the replicate dim is torchft's),
    every trainable parameter under fully_shard (apply it to the root last); ``optimizer`` steps
    its parameters. The group's torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) and ``TORCHFT_LIGHTHOUSE`` locate this rank, its group's store and the
    lighthouse; the keyword arguments override them. One FaultTolerantHSDP per model: it installs
    the model's all-reduce hooks (``close()`` it before making another).

    ``replica_id``: this group's name, the same across its restarts.
    ``min_replicas``: a step runs only with at least this many groups (``begin_step`` waits for them).
    ``timeout``: bounds every all-reduce, commit vote and state transfer (a dead peer costs at
    most this long), and reaching the lighthouse; ``quorum_timeout``: how long ``begin_step`` waits
    for a quorum of ``min_replicas`` groups before it raises :class:`QuorumTimeoutError`.
    ``quorum_retries`` (default ``DEFAULT_QUORUM_RETRIES``, 3): how often this group's manager asks
    the lighthouse again, within ``quorum_timeout``, after a failed quorum request, so a restarted
    lighthouse does not end every group (torchft's own default is 0). ``TORCHFT_QUORUM_RETRIES``
    in the environment, which torchft reads, takes precedence.
    ``manager_kwargs``: further arguments of ``torchft.manager.Manager`` (not the ones above).

    Arguments, the model and the environment are checked before anything connects: a bad one
    raises :class:`~fsdp2.FSDPUsageError` naming it. What the constructor or ``begin_step`` raises
    on one rank of the group, every rank raises.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        replica_id: str,
        min_replicas: int = 1,
        lighthouse: str | None = None,
        timeout: timedelta = timedelta(seconds=60),
        quorum_timeout: timedelta = timedelta(seconds=60),
        init_sync: bool = True,
        quorum_retries: int = DEFAULT_QUORUM_RETRIES,
        manager_kwargs: dict | None = None,
    ):
        _require_torchft()
        lighthouse = lighthouse if lighthouse is not None else os.environ.get("TORCHFT_LIGHTHOUSE")
        _check_arguments(
            model,
            optimizer,
            replica_id,
            min_replicas,
            lighthouse,
            timeout,
            quorum_timeout,
            init_sync,
            quorum_retries,
            manager_kwargs,
        )
        fsdp_modules = [m for m in model.modules() if isinstance(m, compat.TorchFSDPModule)]
        if not fsdp_modules:
            raise FSDPUsageError(
                "FaultTolerantHSDP: the model has no fully_shard'ed module; "
                "call fully_shard(model, mesh=shard_mesh) first"
            )
        _check_every_gradient_is_averaged(model)
        self._mesh = _shard_mesh(model)  # this replica group's ranks
        self._shard_world_size = self._mesh.size()
        _check_optimizer(optimizer, model)
        _check_not_hooked_already(fsdp_modules, replica_id)
        group_rank = _check_group_environment(manager_kwargs or {})
        self.model = model
        self.optimizer = optimizer
        self.replica_id = replica_id
        self.min_replicas = min_replicas
        self.lighthouse = lighthouse
        self.quorum_timeout = quorum_timeout
        self.layout = ReplicaLayout.of(model, self._shard_world_size, optimizer)

        # Validation is over: from here on this connects.
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        device_type = next(model.parameters()).device.type
        self._device = _agreement_device(self._mesh, device_type)

        def make_manager() -> Manager:
            pg = ProcessGroupNCCL(timeout=timeout) if device_type == "cuda" else ProcessGroupGloo(timeout=timeout)
            self._pg = pg  # released by close()
            return Manager(
                pg=pg,
                load_state_dict=self.load_state_dict,
                state_dict=self.state_dict,
                min_replica_size=min_replicas,
                # Synchronous quorum: a joiner receives, checks and loads the live state in
                # begin_step, before it issues any collective a mismatched model could garble.
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=quorum_timeout,
                connect_timeout=timeout,
                lighthouse_addr=lighthouse,
                replica_id=replica_id,
                init_sync=init_sync,
                quorum_retries=quorum_retries,
                **(manager_kwargs or {}),
            )

        # Group rank 0 starts torchft's manager server (it connects to the lighthouse) and the
        # other ranks wait for it in torchft's store: they make theirs only once rank 0 is up, so
        # a failure there reaches every rank at once instead of leaving them waiting in the store.
        manager = failure = None
        for turn in (group_rank == 0, group_rank != 0):
            if turn:
                try:
                    manager = make_manager()
                except Exception as e:  # noqa: BLE001 (every rank of the group raises it, below)
                    failure = self._manager_failure(e, timeout, group_rank)
            try:
                _agree(failure, self._mesh, self._device)
            except BaseException:
                if manager is not None:
                    manager.shutdown(wait=False)
                raise
        self.manager = manager
        self._phase = _Phase.BETWEEN_STEPS
        self._hooked = fsdp_modules
        for m in fsdp_modules:
            m.set_all_reduce_hook(self._all_reduce_across_replicas)
            _HOOK_OWNERS[m] = weakref.ref(self)

    # -- the training step ----------------------------------------------------------------------

    def begin_step(self) -> None:
        """Join this step's quorum (healing from a live group first if this one is behind) and
        clear the gradients. Call before the forward pass.

        Waits up to ``quorum_timeout`` for a quorum of at least ``min_replicas`` groups, then
        raises :class:`QuorumTimeoutError`. Every rank of the group raises what any of them
        raises here (a joiner refused on one shard rank is refused on all)."""
        self._expect(_Phase.BETWEEN_STEPS, "begin_step")
        deadline = time.monotonic() + self.quorum_timeout.total_seconds()
        while True:
            failure, too_few = None, False
            try:
                # The lighthouse may form quorums smaller than min_replicas (its own --min_replicas
                # is lower): ask again until enough groups are in one, or the deadline passes.
                self.manager.start_quorum(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
                participants = self.manager.num_participants()
                too_few = participants < self.min_replicas
                if too_few and time.monotonic() >= deadline:
                    failure = QuorumTimeoutError(self._too_few_groups(participants))
            except TimeoutError as e:  # torchft's, from its gRPC status: "status: Cancelled, message: ..."
                failure = QuorumTimeoutError(self._no_quorum(e))
                failure.__cause__ = e
            except Exception as e:  # noqa: BLE001 (every rank of the group raises it, below)
                failure = e
            # One small collective per try: a rank that fails here (a refused joiner's heal, its
            # own deadline) stops every rank of the group, none goes on into the forward pass.
            _agree(failure, self._mesh, self._device)
            if not too_few:
                break
            time.sleep(_QUORUM_POLL_S)
        self.optimizer.zero_grad()
        self._phase = _Phase.IN_STEP

    def _no_quorum(self, e: BaseException) -> str:
        return (
            f"FaultTolerantHSDP.begin_step: replica group {self.replica_id!r} got no quorum from the lighthouse "
            f"{self.lighthouse} within quorum_timeout={self.quorum_timeout} (min_replicas={self.min_replicas}). "
            f"Either the lighthouse is down or unreachable from here, or fewer than {self.min_replicas} replica "
            "groups asked for a quorum. Check that torchft_lighthouse runs at that address and that enough groups "
            f"are up, then restart this group (it heals from a live one). torchft: {e}"
        )

    def _too_few_groups(self, participants: int) -> str:
        return (
            f"FaultTolerantHSDP.begin_step: replica group {self.replica_id!r} waited quorum_timeout="
            f"{self.quorum_timeout} for a quorum of min_replicas={self.min_replicas} replica groups, but the "
            f"lighthouse {self.lighthouse} formed quorums of {participants} (its --min_replicas is lower). Start "
            f"more replica groups, or lower min_replicas; start torchft_lighthouse with --min_replicas "
            f"{self.min_replicas} so that it waits for them too. Then restart this group (it heals from a live one)."
        )

    def _manager_failure(self, e: Exception, timeout: timedelta, group_rank: int) -> Exception:
        """What torchft's Manager raised while starting, as this rank reports it to its group."""
        if group_rank == 0 and self.lighthouse in str(e):  # its manager server could not connect
            failure: Exception = QuorumTimeoutError(
                f"FaultTolerantHSDP: replica group {self.replica_id!r} could not reach the lighthouse "
                f"{self.lighthouse} within timeout={timeout}. Check that torchft_lighthouse runs at that address and "
                f"is reachable from this node (lighthouse= or TORCHFT_LIGHTHOUSE), then restart this group. "
                f"torchft: {e}"
            )
        else:
            failure = RuntimeError(
                f"FaultTolerantHSDP: replica group {self.replica_id!r} could not start torchft's Manager on "
                f"group rank {group_rank}: {type(e).__name__}: {e}"
            )
        failure.__cause__ = e
        return failure

    def commit_step(self) -> bool:
        """Step the optimizer if the whole group's all-reduces succeeded (True), else skip it on
        every rank of the group (False). Call after backward, instead of ``optimizer.step()``."""
        self._expect(_Phase.IN_STEP, "commit_step")
        self._phase = _Phase.BETWEEN_STEPS
        if not self.manager.should_commit():
            return False
        self.optimizer.step()
        return True

    @property
    def step(self) -> int:
        """Committed steps of the job so far (the same on every live group; a healed group takes its peer's)."""
        return self.manager.current_step()

    @property
    def participants(self) -> int:
        """How many replica groups this step's gradients are averaged over."""
        return self.manager.num_participants()

    def close(self) -> None:
        """Leave the job. The model's all-reduce hooks are removed: it trains as plain FSDP on its
        shard mesh again (no averaging across the groups), and another FaultTolerantHSDP may
        take it."""
        if self._phase is not _Phase.CLOSED:
            self._phase = _Phase.CLOSED
            for m in self._hooked:
                owner = _HOOK_OWNERS.get(m)
                if owner is not None and owner() is self:
                    del _HOOK_OWNERS[m]
                    m.set_all_reduce_hook(None)
            self.manager.shutdown(wait=False)
            self._pg.shutdown()

    def __enter__(self) -> "FaultTolerantHSDP":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _expect(self, phase: _Phase, verb: str) -> None:
        if self._phase is not phase:
            raise FSDPUsageError(
                f"FaultTolerantHSDP.{verb}: called {self._phase.value}; each step is begin_step(), forward/backward, "
                "commit_step()"
            )

    def _all_reduce_across_replicas(self, reduced: torch.Tensor) -> None:
        if self._phase is not _Phase.IN_STEP:
            # Outside a step no quorum holds the other groups to this all-reduce: it would stall
            # for `timeout` and leave garbage, or average with whatever they reduce.
            raise FSDPUsageError(
                f"FaultTolerantHSDP: a backward with gradient sync ran {self._phase.value}, outside begin_step() ... "
                "commit_step(); its gradients would be averaged across the replica groups outside any quorum. "
                "Call begin_step() before the forward pass"
            )
        # Averages over the quorum's groups in place; on failure the manager records the error
        # (the tensor is then garbage, and commit_step will not step on it).
        self.manager.allreduce(reduced).wait()

    # -- the state a joining group heals from -----------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's shards of the model and optimizer state, as sent to a healing peer."""
        return {
            "layout": self.layout.as_dict(),
            "model": _to_wire(self.model.state_dict()),
            "optimizer": _to_wire(self.optimizer.state_dict()),
        }

    def load_state_dict(self, state: dict) -> None:
        """Take a live peer's ``state_dict()``; refuses (FSDPUsageError, nothing loaded) one of
        another model, shard world size, fully_shard wrapping or optimizer."""
        peer = ReplicaLayout.from_dict(state.get("layout") if isinstance(state, dict) else None)
        why = self.layout.mismatch(peer)
        if why is not None:
            raise FSDPUsageError(f"fsdp2.ft: replica group {self.replica_id!r} cannot join the job: {why}")
        own = self.model.state_dict()
        self.model.load_state_dict({k: _from_wire(v, own.get(k)) for k, v in state["model"].items()})
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        optim = state["optimizer"]
        optim["state"] = {
            idx: {k: _from_wire(v, params[idx]) for k, v in entry.items()} for idx, entry in optim["state"].items()
        }
        self.optimizer.load_state_dict(optim)


def _check_arguments(
    model,
    optimizer,
    replica_id,
    min_replicas,
    lighthouse,
    timeout,
    quorum_timeout,
    init_sync,
    quorum_retries,
    manager_kwargs,
) -> None:
    where = "FaultTolerantHSDP"
    if not isinstance(model, nn.Module):
        raise FSDPUsageTypeError(f"{where}: model must be a fully_shard'ed nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise FSDPUsageTypeError(
            f"{where}: optimizer must be a torch.optim.Optimizer over the model's parameters, "
            f"got {type(optimizer).__name__}"
        )
    if not isinstance(replica_id, str):
        raise FSDPUsageTypeError(
            f"{where}: replica_id must be a str naming this replica group (the same across its restarts), got "
            f'{type(replica_id).__name__} {replica_id!r}; e.g. replica_id=f"replica_{{index}}"'
        )
    if not replica_id:
        raise FSDPUsageError(f'{where}: replica_id is empty; name this replica group, e.g. replica_id="replica_0"')
    _check_int(where, "min_replicas", min_replicas, 1, "the number of replica groups a step needs to commit")
    _check_int(where, "quorum_retries", quorum_retries, 0, "how often to ask the lighthouse again")
    if lighthouse is None or lighthouse == "":
        raise FSDPUsageError(
            f"{where}: no lighthouse address; pass lighthouse= or set TORCHFT_LIGHTHOUSE "
            "(start one with torchft_lighthouse)"
        )
    if not isinstance(lighthouse, str):
        raise FSDPUsageTypeError(
            f"{where}: lighthouse must be an address string like 'http://host:29510', got {lighthouse!r}"
        )
    if "://" not in lighthouse:
        raise FSDPUsageError(f"{where}: lighthouse address {lighthouse!r} has no scheme; pass 'http://{lighthouse}'")
    for name, value in (("timeout", timeout), ("quorum_timeout", quorum_timeout)):
        if not isinstance(value, timedelta):
            raise FSDPUsageTypeError(
                f"{where}: {name} must be a datetime.timedelta, got {type(value).__name__} {value!r}"
            )
        if value <= timedelta(0):
            raise FSDPUsageError(f"{where}: {name} must be positive, got {value}")
    if not isinstance(init_sync, bool):
        raise FSDPUsageTypeError(f"{where}: init_sync must be a bool, got {type(init_sync).__name__}")
    if manager_kwargs is not None and not isinstance(manager_kwargs, dict):
        raise FSDPUsageTypeError(f"{where}: manager_kwargs must be a dict, got {type(manager_kwargs).__name__}")
    for key in manager_kwargs or {}:
        if key in _MANAGER_ARGUMENTS:
            ours = _MANAGER_ARGUMENTS[key]
            fix = f"pass {ours}= to FaultTolerantHSDP instead" if ours else "FaultTolerantHSDP sets it itself"
            raise FSDPUsageError(f"{where}: manager_kwargs[{key!r}]: {fix}")


def _check_group_environment(manager_kwargs: dict) -> int:
    """This rank's rank in its replica group; refuses an environment torchft's Manager would
    fail on with a bare ``KeyError`` or ``ValueError`` (a process group started without torchrun)."""
    problems = []
    for env, key in _GROUP_ENVIRONMENT:
        given = manager_kwargs.get(key)
        if given is not None if key == "rank" else bool(given):
            continue  # torchft's own test of whether it falls back to the environment
        value = os.environ.get(env)
        if not value:
            problems.append(f"{env} is not set")
        elif env != "MASTER_ADDR" and not value.strip().isdigit():
            problems.append(f"{env}={value!r} is not an int")
    if problems:
        raise FSDPUsageError(
            f"FaultTolerantHSDP: {', '.join(problems)}. torchft finds this replica group's TCPStore through "
            "MASTER_ADDR and MASTER_PORT, and this rank in the group through RANK and WORLD_SIZE, as torchrun sets "
            "them. Start each replica group with torchrun, or set them (after "
            "init_process_group(init_method='tcp://HOST:PORT'): MASTER_ADDR=HOST, MASTER_PORT=PORT), or pass "
            "manager_kwargs={'store_addr': ..., 'store_port': ..., 'rank': ..., 'world_size': ...}"
        )
    rank = manager_kwargs.get("rank")
    return int(rank) if rank is not None else int(os.environ["RANK"])


def _agreement_device(mesh: DeviceMesh, device_type: str) -> torch.device:
    """Where the group's agreement flag lives: on the host where the mesh's process groups take
    host tensors (gloo; no device sync per step), else on this rank's device."""
    backend = str(dist.get_backend(mesh.get_group(0)))
    if device_type == "cpu" or backend == "gloo" or "cpu:" in backend:
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _agree(failure: BaseException | None, mesh: DeviceMesh, device: torch.device) -> None:
    """Raise on every rank of ``mesh`` (this replica group's ranks: the model's shard mesh) if any
    rank failed: a failed rank its own error, the others a failed rank's, by kind and with its
    message. Ranks that went on would wait in a collective the failed ones never join."""
    failed = torch.tensor([0 if failure is None else 1], dtype=torch.int32, device=device)
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    for group in groups:  # the maximum along every dim: over the whole mesh
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not failed.item():
        return
    report = None if failure is None else (dist.get_rank(), _failure_kind(failure), str(failure))
    for group in groups:
        reports: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(reports, report, group=group)
        report = next((r for r in reports if r is not None), None)
    if failure is not None:
        raise failure
    rank, kind, message = report
    if kind == "usage":
        raise FSDPUsageError(f"{message} (found on rank {rank} of this replica group)")
    if kind == "timeout":
        raise QuorumTimeoutError(f"{message} (found on rank {rank} of this replica group)")
    raise RuntimeError(f"FaultTolerantHSDP: rank {rank} of this replica group failed: {message}")


def _failure_kind(failure: BaseException) -> str:
    if isinstance(failure, FSDPUsageError):
        return "usage"
    return "timeout" if isinstance(failure, QuorumTimeoutError) else "other"


def _check_int(where: str, name: str, value: Any, minimum: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FSDPUsageTypeError(f"{where}: {name} ({meaning}) must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise FSDPUsageError(f"{where}: {name} ({meaning}) must be at least {minimum}, got {value}")


def _check_every_gradient_is_averaged(model: nn.Module) -> None:
    # The groups average only what fully_shard reduces: any other gradient stays local to its
    # group, and the groups' models drift apart without an error.
    not_averaged = _fsdp_units(model)[1]
    if not_averaged:
        raise FSDPUsageError(
            f"FaultTolerantHSDP: trainable parameters {_names(tuple(not_averaged), 8)} are not under fully_shard, so "
            "their gradients would never be averaged across the replica groups and the groups would drift apart. "
            "Call fully_shard on the modules holding them, or on the root last: "
            "fully_shard(model, mesh=shard_mesh) after its blocks (parameters in ignored_params cannot be "
            "trained under FaultTolerantHSDP; freeze them with requires_grad_(False))."
        )


def _check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    params = {id(p) for p in model.parameters()}
    foreign = [i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]) if id(p) not in params]
    if foreign:
        raise FSDPUsageError(
            f"FaultTolerantHSDP: the optimizer steps parameters that are not the model's (positions {foreign[:8]}); "
            "build it after fully_shard, from model.parameters()"
        )


def _check_not_hooked_already(fsdp_modules: list[nn.Module], replica_id: str) -> None:
    for m in fsdp_modules:
        owner = _HOOK_OWNERS.get(m)
        other = owner() if owner is not None else None
        if other is not None and other._phase is not _Phase.CLOSED:
            raise FSDPUsageError(
                f"FaultTolerantHSDP(replica_id={replica_id!r}): the model's all-reduce hooks already belong to the "
                f"FaultTolerantHSDP of replica group {other.replica_id!r}, which would stop averaging its gradients; "
                "use one FaultTolerantHSDP per model (keep the first), or close() the first before making another"
            )


def _shard_mesh(model: nn.Module) -> DeviceMesh:
    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    for p in model.parameters():
        if isinstance(p, DTensor) and any(isinstance(pl, Replicate) for pl in p.placements):
            raise FSDPUsageError(
                "FaultTolerantHSDP: the model is sharded on a mesh with a replicate dim; under torchft the "
                "replicate dim is the replica groups: fully_shard(model, mesh=<this group's 1-D shard mesh>)"
            )
    if len(meshes) != 1:
        raise FSDPUsageError(
            f"FaultTolerantHSDP: expected every parameter sharded on one mesh, found {len(meshes)} meshes"
        )
    return next(iter(meshes))


def _to_wire(tree: Any) -> Any:
    if isinstance(tree, DTensor):
        return _Shard(tree.to_local())
    if isinstance(tree, dict):
        return {k: _to_wire(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_wire(v) for v in tree]
    return tree


def _from_wire(value: Any, like: Any) -> Any:
    """``value`` back as a DTensor sharded like the parameter ``like`` (local shards are this rank's)."""
    if not isinstance(value, _Shard):
        return value
    if not isinstance(like, DTensor):
        raise FSDPUsageError("fsdp2.ft: the peer sent a sharded tensor where this model has none; run the same model")
    return DTensor.from_local(value.local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())
