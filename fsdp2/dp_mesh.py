"""The data-parallel mesh a fully_shard call works on: which dim shards, which replicates."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from fsdp2.errors import FSDPUsageError


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
