"""The data-parallel mesh a fully_shard call works on: which dim shards, which replicates."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from fsdp2 import compat
from fsdp2.errors import FSDPUsageError

try:  # torch >= 2.13: name the data-parallel dims of a full SPMD mesh
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # torch 2.11

    @dataclass(frozen=True)
    class DataParallelMeshDims:  # type: ignore[no-redef]
        """Which dims of a full SPMD mesh are data parallel (PyTorch 2.13's class, for older torch)."""

        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

        @property
        def shard_names(self) -> tuple[str, ...]:
            return () if self.shard is None else (self.shard,) if isinstance(self.shard, str) else tuple(self.shard)

        @property
        def replicate_names(self) -> tuple[str, ...]:
            if self.replicate is None:
                return ()
            return (self.replicate,) if isinstance(self.replicate, str) else tuple(self.replicate)


# Subgroups for reshard_after_forward=k, by their ranks, with the default group they were made in
# (a world initialized again makes its own): creating process groups is collective and slow, so
# every fully_shard call over the same ranks shares them.
_SUBGROUPS: dict[tuple[tuple[int, ...], ...], tuple[object, dist.ProcessGroup]] = {}


@dataclass(frozen=True)
class DataParallelMesh:
    """A 1-D mesh (FSDP: shard on it) or a 2-D mesh (HSDP: replicate on dim 0, shard on dim 1)."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    # With dp_mesh_dims: the full SPMD mesh the parameters live on, its data-parallel dims by role,
    # and the 1-D mesh FSDP shards over (several shard dims flattened into one).
    spmd_mesh: DeviceMesh | None = field(default=None, compare=False)
    shard_dims: tuple[str, ...] = ()
    replicate_dims: tuple[str, ...] = ()
    flat_shard_mesh: DeviceMesh | None = field(default=None, compare=False)

    @classmethod
    def from_mesh(
        cls, mesh: DeviceMesh | None, module_name: str, dp_mesh_dims: DataParallelMeshDims | None = None
    ) -> "DataParallelMesh":
        if mesh is None:
            mesh = _default_mesh(module_name)
        if not isinstance(mesh, DeviceMesh):
            raise FSDPUsageError(f"fully_shard({module_name}): mesh must be a DeviceMesh, got {type(mesh).__name__}")
        if dp_mesh_dims is not None:
            return cls._from_named_dims(mesh, dp_mesh_dims, module_name)
        if mesh.ndim == 1:
            return cls(mesh, mesh.get_group(0), mesh.size(0), mesh.get_local_rank(0), None, 1)
        if mesh.ndim == 2:
            return cls(mesh, mesh.get_group(1), mesh.size(1), mesh.get_local_rank(1), mesh.get_group(0), mesh.size(0))
        raise FSDPUsageError(
            f"fully_shard({module_name}): mesh has {mesh.ndim} dims {tuple(mesh.shape)}; expected a 1-D mesh "
            "(FSDP) or a 2-D (replicate, shard) mesh (HSDP). For FSDP + tensor parallel pass the data-parallel "
            'sub-mesh, e.g. mesh["dp"], or the whole mesh with dp_mesh_dims=DataParallelMeshDims(shard="dp").'
        )

    @classmethod
    def _from_named_dims(cls, mesh: DeviceMesh, dims: DataParallelMeshDims, module_name: str) -> "DataParallelMesh":
        names = mesh.mesh_dim_names
        shard, replicate = tuple(dims.shard_names), tuple(dims.replicate_names)
        where = f"fully_shard({module_name}, dp_mesh_dims={dims})"
        if not names:
            raise FSDPUsageError(f"{where}: the mesh needs mesh_dim_names to be addressed by dp_mesh_dims")
        unknown = [n for n in shard + replicate if n not in names]
        if unknown:
            raise FSDPUsageError(f"{where}: mesh dims {unknown} are not in the mesh's dims {names}")
        if not shard:
            raise FSDPUsageError(
                f"{where}: replication without sharding (DDP) is not something fully_shard does in fsdp2; "
                "name the dim to shard over in dp_mesh_dims.shard"
            )
        shard_mesh = _as_one_dim(mesh, shard)
        if replicate:
            replicate_mesh = _as_one_dim(mesh, replicate)
            dp_mesh = compat.concatenate_meshes([replicate_mesh, shard_mesh])
            replicate_group, replicate_size = replicate_mesh.get_group(0), replicate_mesh.size(0)
        else:
            dp_mesh, replicate_group, replicate_size = shard_mesh, None, 1
        return cls(
            dp_mesh,
            shard_mesh.get_group(0),
            shard_mesh.size(0),
            shard_mesh.get_local_rank(0),
            replicate_group,
            replicate_size,
            mesh,
            shard,
            replicate,
            shard_mesh,
        )

    @property
    def data_parallel_dims(self) -> tuple[str, ...]:
        return self.replicate_dims + self.shard_dims

    @property
    def shard_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh of the shard dim (what tensor-subclass all-gather hooks receive, as in
        PyTorch); None for an HSDP mesh without dim names, which cannot be sliced."""
        if self.flat_shard_mesh is not None:
            return self.flat_shard_mesh
        if self.mesh.ndim == 1:
            return self.mesh
        names = self.mesh.mesh_dim_names
        return self.mesh[names[-1]] if names else None

    @property
    def is_hybrid(self) -> bool:
        return self.replicate_group is not None

    @property
    def data_parallel_size(self) -> int:
        """Number of ranks whose gradients are averaged (shard x replicate)."""
        return self.shard_size * self.replicate_size

    @property
    def device(self) -> torch.device:
        """The device parameters are gathered and computed on: the mesh's, this process's index."""
        device_type = self.mesh.device_type
        module = getattr(torch, device_type, None)
        if device_type == "cpu" or not hasattr(module, "current_device"):
            return torch.device(device_type)
        return torch.device(device_type, module.current_device())

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
        k = ranks_per_group
        group = self._group_of(lambda row: [row[i : i + k] for i in range(0, self.shard_size, k)])
        position = self.shard_rank % k
        if dist.get_rank(group) != position:
            raise FSDPUsageError(
                f"reshard_after_forward={k}: the mesh's shard dim does not list ranks in "
                "increasing order, which resharding to a subgroup relies on; use True or False."
            )
        return group, position

    def across_subgroups(self, ranks_per_group: int) -> dist.ProcessGroup:
        """The shard ranks at this rank's position in every group of :meth:`subgroup`'s (shard ranks
        ``j, j + k, j + 2k, ...``): gathering over it first yields exactly the rows a rank keeps with
        ``reshard_after_forward=k`` (the compiled step gathers in these two stages). Collective."""
        k = ranks_per_group
        return self._group_of(lambda row: [row[j::k] for j in range(k)])

    def _group_of(self, split: Callable[[list[int]], list[list[int]]]) -> dist.ProcessGroup:
        """This rank's process group among those ``split`` makes of every shard group's ranks."""
        # Every shard group of the job, one per row: all ranks enumerate the same list.
        rows = compat.groups_along(self.mesh, self.mesh.ndim - 1)
        groups = [group for row in rows for group in split(row)]
        # By the ranks, not the mesh object: fully_shard calls with equal meshes share the groups.
        key = tuple(map(tuple, groups))
        cached = _SUBGROUPS.get(key)
        if cached is None or cached[0] is not dist.group.WORLD:
            mine, _ = dist.new_subgroups_by_enumeration(groups)
            cached = _SUBGROUPS[key] = (dist.group.WORLD, mine)
        return cached[1]


def _as_one_dim(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The 1-D mesh of dim ``names[0]``, or of several dims flattened into one (torchtitan's
    ``shard=("dp_shard", "cp")``), ranks in row-major order as PyTorch flattens them."""
    return mesh[names[0]] if len(names) == 1 else compat.flatten_mesh(mesh[names], "_".join(names))


def _default_mesh(module_name: str) -> DeviceMesh:
    """As PyTorch's fully_shard: the default process group (initialized from the environment,
    e.g. by torchrun, if nobody did yet) as a 1-D mesh on the accelerator if one is usable."""
    if not dist.is_initialized():
        try:
            dist.init_process_group()
        except ValueError as e:  # FSDPUsageError is a ValueError too: callers catching either still do
            raise FSDPUsageError(
                f"fully_shard({module_name}): no mesh was given and torch.distributed could not be initialized "
                "from the environment "
                f"({e}). Launch with torchrun, call torch.distributed.init_process_group() first, or pass mesh=."
            ) from e
    # check_available: a CUDA build on a machine without a GPU (or driver) trains on CPU ranks.
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    device_type = accelerator.type if accelerator is not None else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))
