"""The data-parallel mesh a fully_shard call works on: which dim shards, which replicates."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from fsdp2 import compat
from fsdp2.errors import FSDPUsageError

# Subgroups for reshard_after_forward=k, by (root mesh, shard dim, k): creating process groups
# is collective and slow, so every fully_shard call with the same k shares them.
_SUBGROUPS: dict[tuple[int, int, int], tuple[dist.ProcessGroup, int]] = {}


@dataclass(frozen=True)
class DataParallelMesh:
    """A 1-D mesh (FSDP: shard on it) or a 2-D mesh (HSDP: replicate on dim 0, shard on dim 1)."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh | None, module_name: str) -> "DataParallelMesh":
        if mesh is None:
            if not dist.is_initialized():
                raise FSDPUsageError(
                    f"fully_shard({module_name}): no mesh was given and torch.distributed is not "
                    "initialized. Call torch.distributed.init_process_group() first or pass mesh=."
                )
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
            mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        if not isinstance(mesh, DeviceMesh):
            raise FSDPUsageError(f"fully_shard({module_name}): mesh must be a DeviceMesh, got {type(mesh).__name__}")
        if mesh.ndim == 1:
            return cls(mesh, mesh.get_group(0), mesh.size(0), mesh.get_local_rank(0), None, 1)
        if mesh.ndim == 2:
            return cls(mesh, mesh.get_group(1), mesh.size(1), mesh.get_local_rank(1), mesh.get_group(0), mesh.size(0))
        raise FSDPUsageError(
            f"fully_shard({module_name}): mesh has {mesh.ndim} dims {tuple(mesh.shape)}; expected a 1-D mesh "
            "(FSDP) or a 2-D (replicate, shard) mesh (HSDP). For FSDP + tensor parallel pass the data-parallel "
            'sub-mesh, e.g. mesh["dp"].'
        )

    @property
    def is_hybrid(self) -> bool:
        return self.replicate_group is not None

    @property
    def data_parallel_size(self) -> int:
        """Number of ranks whose gradients are averaged (shard x replicate)."""
        return self.shard_size * self.replicate_size

    @property
    def device(self) -> torch.device:
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    def placements(self, shard_dim: int) -> tuple:
        """DTensor placements of a parameter sharded on ``shard_dim`` on this mesh."""
        if self.is_hybrid:
            return (Replicate(), Shard(shard_dim))
        return (Shard(shard_dim),)

    def subgroup(self, ranks_per_group: int) -> tuple[dist.ProcessGroup, int]:
        """This rank's group of ``ranks_per_group`` consecutive shard ranks, and its position in it.

        Collective over the whole job: every rank must call it, in the same order, because
        creating a process group is.
        """
        root = compat.root_mesh(self.mesh)
        names = self.mesh.mesh_dim_names
        shard_dim = root.mesh_dim_names.index(names[-1]) if names else self.mesh.ndim - 1
        key = (id(root), shard_dim, ranks_per_group)
        if key not in _SUBGROUPS:
            # Every shard group of the job, one per row: all ranks enumerate the same list.
            rows = root.mesh.movedim(shard_dim, -1).reshape(-1, self.shard_size).tolist()
            groups = [row[i : i + ranks_per_group] for row in rows for i in range(0, self.shard_size, ranks_per_group)]
            mine, _ = dist.new_subgroups_by_enumeration(groups)
            position = self.shard_rank % ranks_per_group
            if dist.get_rank(mine) != position:
                raise FSDPUsageError(
                    f"reshard_after_forward={ranks_per_group}: the mesh's shard dim does not list ranks in "
                    "increasing order, which resharding to a subgroup relies on; use True or False."
                )
            _SUBGROUPS[key] = (mine, position)
        return _SUBGROUPS[key]
