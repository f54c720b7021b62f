"""Fault-tolerant HSDP on torchft: the replicate dim is torchft's, the shard dim is ours.

Each replica group is its own job (its own torchrun, its own 1-D shard mesh); the groups find
each other through torchft's lighthouse. Per step, every rank of every group:

1. ``begin_step()``: joins the step's quorum. A group that is behind (new, restarted) first
   receives the live sharded model and optimizer state from a peer group, shard rank r from
   shard rank r, and is checked against this group's layout before anything is loaded.
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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from fsdp2.errors import FSDPUsageError

__all__ = ["FaultTolerantHSDP", "ReplicaLayout"]


def _require_torchft() -> None:
    try:
        import torchft  # noqa: F401
    except ImportError as e:
        raise ImportError('fsdp2.ft needs torchft: pip install "fsdp2[ft]"') from e


@dataclass(frozen=True)
class ReplicaLayout:
    """What two replica groups must share for one to heal from the other: every parameter's name,
    global shape and dtype, and the shard world size (shard rank r heals from shard rank r)."""

    shard_world_size: int
    params: tuple[tuple[str, tuple[int, ...], str], ...]

    @classmethod
    def of(cls, model: nn.Module, shard_world_size: int) -> "ReplicaLayout":
        return cls(shard_world_size, tuple((n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()))

    def as_dict(self) -> dict:
        return {"shard_world_size": self.shard_world_size, "params": [list(p) for p in self.params]}

    @classmethod
    def from_dict(cls, d: Any) -> "ReplicaLayout":
        try:
            return cls(int(d["shard_world_size"]), tuple((str(n), tuple(s), str(t)) for n, s, t in d["params"]))
        except (KeyError, TypeError, ValueError) as e:
            raise FSDPUsageError(
                f"fsdp2.ft: the peer's state has no readable layout ({e!r}); is it running fsdp2.ft?"
            ) from e

    def mismatch(self, peer: "ReplicaLayout") -> str | None:
        """Why this group cannot take ``peer``'s state, or None if it can."""
        if self.shard_world_size != peer.shard_world_size:
            return (
                f"this replica group has {self.shard_world_size} shard ranks, the live groups have "
                f"{peer.shard_world_size}; start it with the same number of ranks (torchrun --nproc_per_node)"
            )
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
                return f"parameter {name!r} is {list(s)} {t} here, {list(ps)} {pt} on the live groups; run the same model"
        return None


@dataclass
class _Shard:
    """A DTensor's local shard on the wire (the transport pickles plain tensors; a DTensor would
    carry its device mesh, which means nothing in another process)."""

    local: torch.Tensor


class _Phase(enum.Enum):
    BETWEEN_STEPS = "between steps"
    IN_STEP = "in a step"  # quorum joined; forward/backward/all-reduces may run
    CLOSED = "closed"


class FaultTolerantHSDP:
    """One rank of one replica group of a fault-tolerant HSDP job.

    ``model`` is fully_shard'ed on this group's 1-D shard mesh (the replicate dim is torchft's);
    ``optimizer`` steps its parameters. The group's torchrun environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) and ``TORCHFT_LIGHTHOUSE`` locate this rank, its group's
    store and the lighthouse; the keyword arguments override them.

    ``min_replicas``: a step commits only if at least this many groups took part.
    ``timeout``: bounds every all-reduce, commit vote and state transfer (a dead peer costs at
    most this long); ``quorum_timeout``: how long to wait for a quorum.
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
        manager_kwargs: dict | None = None,
    ):
        _require_torchft()
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if not fsdp_modules:
            raise FSDPUsageError(
                "FaultTolerantHSDP: the model has no fully_shard'ed module; call fully_shard(model, mesh=shard_mesh) first"
            )
        self._shard_world_size = _shard_world_size(model)
        self.model = model
        self.optimizer = optimizer
        self.replica_id = replica_id
        self.layout = ReplicaLayout.of(model, self._shard_world_size)
        lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise FSDPUsageError(
                "FaultTolerantHSDP: no lighthouse address; pass lighthouse= or set TORCHFT_LIGHTHOUSE "
                "(start one with torchft_lighthouse)"
            )
        device_type = next(model.parameters()).device.type
        pg = ProcessGroupNCCL(timeout=timeout) if device_type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
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
            **(manager_kwargs or {}),
        )
        self._phase = _Phase.BETWEEN_STEPS
        for m in fsdp_modules:
            m.set_all_reduce_hook(self._all_reduce_across_replicas)

    # -- the training step ----------------------------------------------------------------------

    def begin_step(self) -> None:
        """Join this step's quorum (healing from a live group first if this one is behind) and
        clear the gradients. Call before the forward pass."""
        self._expect(_Phase.BETWEEN_STEPS, "begin_step")
        self.manager.start_quorum()
        self.optimizer.zero_grad()
        self._phase = _Phase.IN_STEP

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
        if self._phase is not _Phase.CLOSED:
            self._phase = _Phase.CLOSED
            self.manager.shutdown(wait=False)

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
        another model or shard world size."""
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


def _shard_world_size(model: nn.Module) -> int:
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
    return next(iter(meshes)).size()


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
