"""Whole-matrix transforms of sharded tensors, each run once, on one owner rank of its shard group.

Muon, Shampoo or SOAP transform a whole matrix, while an fsdp2 rank holds only a shard of it.
Gathering every matrix on every rank would repeat each transform N times. Instead every tensor
gets one *owner* rank in its shard group (balanced by cost), and per shard group a step does:

1. one all-to-all: every rank sends its shard of each tensor to that tensor's owner;
2. each owner concatenates the shards (rank order, ``torch.chunk`` layout) and runs ``fn`` on
   the whole tensors it owns;
3. one all-to-all back: the owner sends every rank its shard of each result, behind a status
   element (so an owner's failure raises on every rank instead of hanging the others).

Elements moved per step, over the whole group: twice the tensors' numel (plus N^2 status
elements), in the exchange dtype; the transform's cost per rank is about 1/N of the total
(greedy largest-first balancing).

Which tensors take part: DTensors sharded on exactly one mesh dim (FSDP ``(Shard(d),)``, HSDP
``(Replicate(), Shard(d))``: the exchange stays within a replica), on any tensor dim ``d``;
plain tensors and fully replicated DTensors are transformed locally on every rank. Tensors
sharded on two mesh dims (tensor parallel + FSDP) or with Partial/strided placements are
refused: their whole matrix spans more than one process group.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from fsdp2 import compat
from fsdp2.errors import FSDPUsageError
from fsdp2.runtime import collectives
from fsdp2.layout.shard_layout import ShardLayout

# fn(index, whole tensor) -> transformed whole tensor (same shape).
Transform = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Sharding:
    """How one tensor is split over its shard group (``group is None``: every rank holds it whole)."""

    layout: ShardLayout | None
    group: dist.ProcessGroup | None
    device: torch.device  # where the exchange buffers live: the mesh's device

    @classmethod
    def of(cls, tensor: torch.Tensor, name: str) -> "Sharding":
        if not isinstance(tensor, DTensor):
            return cls(None, None, tensor.device)
        mesh, placements = tensor.device_mesh, tuple(tensor.placements)
        sharded = [dim for dim, p in enumerate(placements) if not p.is_replicate()]
        unsupported = [p for p in placements if not p.is_replicate() and type(p) is not Shard]
        if unsupported or len(sharded) > 1:
            raise FSDPUsageError(
                f"fsdp2.optim: {name} has placements {placements} on mesh dims {mesh.mesh_dim_names or mesh.shape}. "
                "Whole-matrix transforms gather a tensor within one shard group, so they support FSDP "
                "(Shard(d),) and HSDP (Replicate(), Shard(d)) parameters only; tensor-parallel + FSDP "
                "parameters (sharded on two mesh dims) and Partial placements are not supported. Optimize "
                "them elementwise instead (e.g. an AdamW group: {'params': [...], 'use_muon': False})."
            )
        device = _mesh_device(mesh)
        if not sharded:
            return cls(None, None, device)
        mesh_dim = sharded[0]
        layout = ShardLayout(tensor.shape, placements[mesh_dim].dim, mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
        if compat.local_tensor(tensor).shape != layout.local_shape:
            raise ValueError(
                f"fsdp2.optim: {name}: local shard has shape {tuple(compat.local_tensor(tensor).shape)}, expected "
                f"{tuple(layout.local_shape)} (torch.chunk layout of {tuple(tensor.shape)} over {layout.world} ranks)."
            )
        return cls(layout, mesh.get_group(mesh_dim), device)

    @property
    def is_local(self) -> bool:
        return self.group is None or self.layout.world == 1

    def piece_shape(self, rank: int) -> torch.Size:
        return self.layout.shape_of(rank)

    def piece_numel(self, rank: int) -> int:
        return math.prod(self.layout.shape_of(rank))

    def piece_of(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        return whole.narrow(self.layout.dim, self.layout.offset_of(rank), self.layout.rows_of(rank))


def _mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def default_cost(shape: torch.Size) -> float:
    """Proportional to the flops of matrix products on a ``rows x cols`` view (``numel`` for 1-D)."""
    numel = math.prod(shape)
    if len(shape) < 2 or numel == 0:
        return float(numel)
    return float(numel * min(shape[0], numel // shape[0]))


def balance(costs: Sequence[float], ranks: int) -> list[int]:
    """Owner of each item: largest first, each to the least-loaded rank (lowest rank on ties).

    Deterministic, so every rank computes the same owners without communicating; within 4/3 of
    the best possible maximum load.
    """
    owners = [0] * len(costs)
    loads = [(0.0, rank) for rank in range(ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (load + costs[i], rank))
    return owners


@dataclass(frozen=True)
class BufferLayout:
    """A 1-D all-to-all buffer: one segment per rank in rank order, each an optional one-element
    status header followed by that rank's items, in the order given."""

    splits: list[int]  # elements per rank's segment
    offsets: dict  # item key -> offset of its first element
    headers: list[int]  # offset of each segment's status element (empty without headers)

    @classmethod
    def build(cls, segments: list[list[tuple[object, int]]], header: bool) -> "BufferLayout":
        splits, offsets, headers, total = [], {}, [], 0
        for items in segments:
            start = total
            if header:
                headers.append(total)
                total += 1
            for key, numel in items:
                offsets[key] = total
                total += numel
            splits.append(total - start)
        return cls(splits, offsets, headers)

    @property
    def numel(self) -> int:
        return sum(self.splits)


class GroupExchange:
    """The tensors of one shard group: their owners, and the layouts of the all-to-all buffers.

    To the owners, each rank sends, by destination rank, its piece of every tensor that rank
    owns; each owner receives, by source rank, that rank's piece of every tensor it owns. The
    return trip swaps the roles, and every segment starts with a status element (non-zero: the
    owner's transform failed), so a failure raises on every rank instead of hanging the others.
    """

    def __init__(self, indices: list[int], shardings: list[Sharding], owners: list[int]):
        first = shardings[0]
        self.group, self.device = first.group, first.device
        self.size, self.rank = first.layout.world, first.layout.rank
        self.indices, self.shardings, self.owners = indices, shardings, owners
        self.owned = [k for k, owner in enumerate(owners) if owner == self.rank]
        mine = [
            [(k, s.piece_numel(self.rank)) for k, s in enumerate(shardings) if owners[k] == dest]
            for dest in range(self.size)
        ]
        theirs = [[((src, k), shardings[k].piece_numel(src)) for k in self.owned] for src in range(self.size)]
        self.to_owners, self.at_owner = BufferLayout.build(mine, False), BufferLayout.build(theirs, False)
        self.from_owner, self.back_home = BufferLayout.build(theirs, True), BufferLayout.build(mine, True)

    def run(self, pieces: list[torch.Tensor], fn: Transform, dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's piece of ``fn(whole)`` for each tensor, given its piece of each (tensor order)."""
        send = torch.empty(self.to_owners.numel, dtype=dtype, device=self.device)
        for k, piece in enumerate(pieces):
            _slot(send, self.to_owners.offsets[k], piece.shape).copy_(piece)
        recv = torch.empty(self.at_owner.numel, dtype=dtype, device=self.device)
        collectives.all_to_all(recv, send, self.at_owner.splits, self.to_owners.splits, self.group, async_op=False)

        results = torch.empty(self.from_owner.numel, dtype=dtype, device=self.device)
        try:
            for k in self.owned:
                sharding = self.shardings[k]
                parts = [
                    _slot(recv, self.at_owner.offsets[(src, k)], sharding.piece_shape(src)) for src in range(self.size)
                ]
                whole = torch.cat(parts, dim=sharding.layout.dim)
                whole = _checked(fn(self.indices[k], whole), whole.shape, self.indices[k])
                for src in range(self.size):
                    _slot(results, self.from_owner.offsets[(src, k)], sharding.piece_shape(src)).copy_(
                        sharding.piece_of(whole, src)
                    )
            failure = None
        except Exception as error:  # noqa: BLE001 - re-raised below, after the others are told
            failure = error
        results[self.from_owner.headers] = 0 if failure is None else 1
        back = torch.empty(self.back_home.numel, dtype=dtype, device=self.device)
        back[self.back_home.headers] = 0  # overwritten by the owners; stays "ok" where collectives are fakes
        collectives.all_to_all(back, results, self.back_home.splits, self.from_owner.splits, self.group, async_op=False)
        if failure is not None:
            raise failure
        status = back[self.back_home.headers]
        if status.any():
            failed = [owner for owner, bad in enumerate(status.tolist()) if bad]
            raise RuntimeError(
                f"fsdp2.optim: the whole-matrix transform failed on rank(s) {failed} of this shard group "
                "(their error says why); no result was applied."
            )
        return [_slot(back, self.back_home.offsets[k], piece.shape) for k, piece in enumerate(pieces)]

    def bytes_sent(self, element_size: int) -> int:
        """What this rank hands to the two all-to-alls (``count_comm``'s ``all_to_all`` bytes): its
        pieces to the owners, then every rank's piece of the tensors it owns plus a status element per rank."""
        return (self.to_owners.numel + self.from_owner.numel) * element_size

    def cost(self, costs: Sequence[float]) -> float:
        return sum(costs[self.indices[k]] for k in self.owned)


def _slot(buffer: torch.Tensor, offset: int, shape: torch.Size) -> torch.Tensor:
    return buffer[offset : offset + math.prod(shape)].view(shape)


def _checked(result: torch.Tensor, shape: torch.Size, index: int) -> torch.Tensor:
    if result.shape != shape:
        raise ValueError(
            f"fsdp2.optim: the transform returned shape {tuple(result.shape)} for tensor {index} of shape "
            f"{tuple(shape)}; it must return a tensor of its input's shape."
        )
    return result


class WholeMatrixSchedule:
    """Owners and exchange plans for a fixed list of tensors (the same list, in the same order, on every rank).

    Owners depend only on the tensors' shapes, their shard groups and ``costs``, so they stay the
    same from step to step: a transform may keep per-tensor state on the owner (``fn`` gets the
    tensor's index).
    """

    def __init__(
        self, tensors: Sequence[torch.Tensor], costs: Sequence[float] | None = None, names: Sequence[str] | None = None
    ):
        names = names or [f"tensor {i}" for i in range(len(tensors))]
        self.shardings = [Sharding.of(t, name) for t, name in zip(tensors, names)]
        self.costs = list(costs) if costs is not None else [default_cost(t.shape) for t in tensors]
        self.local = [i for i, s in enumerate(self.shardings) if s.is_local]
        by_group: dict[dist.ProcessGroup, list[int]] = {}  # insertion order: first appearance
        for i, sharding in enumerate(self.shardings):
            if not sharding.is_local:
                by_group.setdefault(sharding.group, []).append(i)
        self.exchanges = []
        for indices in by_group.values():
            shardings = [self.shardings[i] for i in indices]
            owners = balance([self.costs[i] for i in indices], shardings[0].layout.world)
            self.exchanges.append(GroupExchange(indices, shardings, owners))

    def owner(self, index: int) -> int | None:
        """Rank (in its shard group) that transforms tensor ``index``; None when every rank does."""
        for exchange in self.exchanges:
            if index in exchange.indices:
                return exchange.owners[exchange.indices.index(index)]
        return None

    def cost_on_this_rank(self) -> float:
        """Sum of ``costs`` of the tensors this rank transforms (owned ones and local ones)."""
        return sum(self.costs[i] for i in self.local) + sum(e.cost(self.costs) for e in self.exchanges)

    def bytes_sent(self, element_size: int) -> int:
        """Bytes this rank sends per ``apply`` (both all-to-alls), for an exchange dtype of ``element_size``."""
        return sum(exchange.bytes_sent(element_size) for exchange in self.exchanges)

    def apply(
        self, pieces: Sequence[torch.Tensor], fn: Transform, dtype: torch.dtype | None = None
    ) -> list[torch.Tensor]:
        """This rank's piece of ``fn(i, whole_i)`` for every tensor ``i``, given this rank's piece of each.

        ``pieces[i]`` is this rank's local tensor (a DTensor's ``to_local()``, or the whole tensor
        when it is not sharded). Wholes and results travel and are returned in ``dtype`` (default:
        the pieces' promoted dtype); results come back on each piece's device.
        """
        if len(pieces) != len(self.shardings):
            raise ValueError(f"fsdp2.optim: {len(pieces)} tensors given to a schedule of {len(self.shardings)}")
        if dtype is None:
            dtype = pieces[0].dtype if pieces else torch.float32
            for piece in pieces[1:]:
                dtype = torch.promote_types(dtype, piece.dtype)
        out: list[torch.Tensor | None] = [None] * len(pieces)
        for i in self.local:
            whole = pieces[i].to(dtype, copy=True)
            out[i] = _checked(fn(i, whole), whole.shape, i).to(dtype)
        for exchange in self.exchanges:
            results = exchange.run([pieces[i] for i in exchange.indices], fn, dtype)
            for i, result in zip(exchange.indices, results):
                out[i] = result.to(pieces[i].device)
        return out


def gather_apply(
    fn: Transform,
    tensors: Sequence[torch.Tensor],
    *,
    costs: Sequence[float] | None = None,
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """``[fn(i, full(t_i)) for i, t_i in enumerate(tensors)]``, each computed once, on its owner rank.

    ``tensors`` are DTensors (FSDP or HSDP shards) or plain tensors, the same list on every rank
    of a shard group (collective). Returns tensors like the inputs: a DTensor with the input's
    mesh and placements holding this rank's shard of the result, or the plain result.
    ``costs`` (default: matrix-product flops of each shape) balance the owners. For a transform
    applied every step, build a :class:`WholeMatrixSchedule` once and call its ``apply``.
    """
    schedule = WholeMatrixSchedule(tensors, costs)
    pieces = [compat.local_tensor(t) if isinstance(t, DTensor) else t for t in tensors]
    results = schedule.apply(pieces, fn, dtype)
    return [
        DTensor.from_local(r, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
        if isinstance(t, DTensor)
        else r
        for t, r in zip(tensors, results)
    ]
