"""The sharding strategies the planner compares, and where each one's collectives run.

Ranks are laid out as a row-major ``(replicate, shard, tp)`` mesh: TP peers are neighbours
(inside a node), a shard group's ranks are ``tp`` apart, replicas ``shard x tp`` apart. This is
``init_device_mesh(device, (r, s, t))`` on ranks numbered node by node.

How each strategy is run (what the planner models):

========  ===========================================================================================
DDP       torch DDP (fsdp2 has no DDP): full params, grads and optimizer state on every rank, the
          gradients all-reduced in buckets during backward (``gradient_as_bucket_view=False``,
          the default, so the buckets are a second copy of the gradients); with gradient
          accumulation only the last micro-batch all-reduces (``no_sync()`` for the others)
ZeRO-2    ``fully_shard(reshard_after_forward=False)`` on a 1-D mesh: params gathered once per
          step and kept until backward ends; grads reduce-scattered; optimizer state sharded
FSDP      ``fully_shard`` on a 1-D mesh (ZeRO-3): blocks free their gathered params after forward
HSDP      ``fully_shard`` on a 2-D (replicate, shard) mesh: FSDP inside a shard group, gradient
          shards all-reduced across replicas
FSDP+TP   ``parallelize_module`` on the ``tp`` dim (inside a node), ``fully_shard`` on ``dp``
HSDP+TP   the same with a (replicate, shard) data-parallel mesh
========  ===========================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from fsdp2.plan.cluster import Cluster


class Kind(Enum):
    """Ordered from simplest to run to most involved: the verdict prefers the earlier."""

    DDP = "DDP"
    ZERO2 = "ZeRO-2"
    FSDP = "FSDP"
    HSDP = "HSDP"
    FSDP_TP = "FSDP+TP"
    HSDP_TP = "HSDP+TP"

    @property
    def simplicity(self) -> int:
        return list(Kind).index(self)


@dataclass(frozen=True)
class Strategy:
    kind: Kind
    replicate: int  # r: data-parallel replicas (DDP: every rank)
    shard: int  # s: ranks a parameter is sharded over (DDP: 1)
    tp: int = 1  # t: tensor-parallel ranks

    @property
    def gpus(self) -> int:
        return self.replicate * self.shard * self.tp

    @property
    def data_parallel(self) -> int:
        """Ranks that take different batches."""
        return self.replicate * self.shard

    @property
    def name(self) -> str:
        if self.kind in (Kind.DDP, Kind.ZERO2, Kind.FSDP):
            return self.kind.value
        if self.kind is Kind.HSDP:
            return f"HSDP {self.replicate}x{self.shard}"
        if self.kind is Kind.FSDP_TP:
            return f"FSDP+TP {self.shard}x{self.tp}"
        return f"HSDP+TP {self.replicate}x{self.shard}x{self.tp}"

    @property
    def shards_params(self) -> bool:
        return self.kind is not Kind.DDP

    @property
    def reshard_after_forward(self) -> bool | None:
        """fully_shard's setting (None: PyTorch 2.13's default, the root keeps, blocks free)."""
        return False if self.kind is Kind.ZERO2 else None

    # Where the collectives run (see the module docstring for the rank layout).
    def shard_link(self, cluster: Cluster) -> str:
        return cluster.link(self.tp, self.shard)

    def replicate_link(self, cluster: Cluster) -> str:
        return cluster.link(self.shard * self.tp, self.replicate)

    def tp_link(self, cluster: Cluster) -> str:
        return cluster.link(1, self.tp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_strategies(cluster: Cluster, tp_degrees: list[int]) -> list[Strategy]:
    """DDP, ZeRO-2, FSDP, every HSDP replica count that divides the cluster, and for each TP
    degree in ``tp_degrees`` (TP inside a node) FSDP+TP and every HSDP+TP."""
    n = cluster.gpus
    found = [Strategy(Kind.DDP, n, 1), Strategy(Kind.ZERO2, 1, n), Strategy(Kind.FSDP, 1, n)]
    found += [Strategy(Kind.HSDP, r, n // r) for r in _divisors(n) if 1 < r < n]
    for t in tp_degrees:
        if t == 1 or n % t or cluster.node_size % t:
            continue
        dp = n // t
        found.append(Strategy(Kind.FSDP_TP, 1, dp, t))
        found += [Strategy(Kind.HSDP_TP, r, dp // r, t) for r in _divisors(dp) if 1 < r < dp]
    return found


def tp_candidates(cluster: Cluster) -> list[int]:
    """TP degrees that fit inside a node: its divisors above 1."""
    return [t for t in _divisors(cluster.node_size) if t > 1]
