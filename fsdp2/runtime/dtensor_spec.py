"""How a sharded parameter is described as a DTensor, with or without tensor parallelism.

Plain parameter: FSDP shards the full tensor; the DTensor lives on the data-parallel mesh.

Tensor-parallel parameter (already a DTensor on a TP mesh, from ``parallelize_module``): FSDP
shards each rank's TP-local tensor, and the result is a DTensor on the combined (dp..., tp)
mesh. When FSDP and TP split the same dim, the rows a rank holds are "every tp-th block"
of that dim, which DTensor expresses as ``_StridedShard(dim, split_factor=tp_shards)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fsdp2.runtime.dp_mesh import DataParallelMesh
from fsdp2 import compat
from fsdp2.errors import FSDPUsageError, FSDPUsageRuntimeError


@dataclass(frozen=True)
class TensorParallelSpec:
    """Where the unsharded parameter lives during compute: a DTensor on the TP mesh."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    # Mesh dims whose gradient placement is left as autograd made it: the data-parallel dims of a
    # full SPMD mesh (dp_mesh_dims), which FSDP's reduce-scatter sums, not a redistribution.
    data_parallel_mesh_dims: frozenset[int] = frozenset()

    def wrap(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The TP-local gradient, first turning Partial (pending-sum) grads into our placements."""
        if isinstance(grad, DTensor):
            wanted = tuple(
                current if i in self.data_parallel_mesh_dims else ours
                for i, (current, ours) in enumerate(zip(grad.placements, self.placements))
            )
            if tuple(grad.placements) != wanted:
                grad = grad.redistribute(self.mesh, wanted)
            return compat.local_tensor(grad)
        return grad


@dataclass(frozen=True)
class ShardedSpec:
    """The DTensor mesh/placements of the sharded parameter, and the tensor FSDP splits."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    fsdp_input: torch.Tensor  # the full tensor, or the TP-local tensor
    tensor_parallel: TensorParallelSpec | None


def sharded_spec(fqn: str, param: torch.Tensor, dp: DataParallelMesh, shard_dim: int) -> ShardedSpec:
    if not isinstance(param, DTensor):
        return ShardedSpec(dp.mesh, dp.placements(shard_dim), param.detach(), None)
    if dp.spmd_mesh is not None and param.device_mesh == dp.spmd_mesh:
        return _spmd_spec(fqn, param, dp, shard_dim)
    tp_mesh = param.device_mesh
    tp = TensorParallelSpec(tp_mesh, tuple(param.placements), param.shape, param.stride())
    tp_splits = 1
    for placement, size in zip(param.placements, tp_mesh.shape):
        if isinstance(placement, (Shard, compat.StridedShard)) and placement.dim == shard_dim:
            tp_splits *= size
        elif not isinstance(placement, (Shard, Replicate)):
            raise FSDPUsageError(
                f"fully_shard: parameter {fqn} has TP placement {placement}; only Shard and Replicate "
                "tensor-parallel parameters can be further sharded."
            )
    fsdp = compat.StridedShard(shard_dim, split_factor=tp_splits) if tp_splits > 1 else Shard(shard_dim)
    dp_placements = (Replicate(), fsdp) if dp.is_hybrid else (fsdp,)
    mesh = _combined_mesh(fqn, dp.mesh, tp_mesh)
    return ShardedSpec(mesh, dp_placements + tuple(param.placements), compat.local_tensor(param).detach(), tp)


def _combined_mesh(fqn: str, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The (dp..., tp...) mesh: the data-parallel mesh's dims, then the TP mesh's.

    Both must come from one root mesh, in any order of dims: named dims of one ``init_device_mesh``,
    or meshes made by unflattening one flat world mesh (torchtitan's), whose root names neither's dims.
    """
    dp_names, tp_names = dp_mesh.mesh_dim_names, tp_mesh.mesh_dim_names
    if not dp_names or not tp_names or set(dp_names) & set(tp_names):
        raise FSDPUsageRuntimeError(
            f"fully_shard: parameter {fqn} is already a DTensor on mesh dims {tp_names}, and fully_shard got mesh "
            f"dims {dp_names}. fully_shard composes with tensor parallelism on another named dim of the same "
            "mesh: mesh = init_device_mesh(..., mesh_dim_names=('dp', 'tp')); parallelize_module(m, mesh['tp'], "
            "plan); fully_shard(m, mesh=mesh['dp'])."
        )
    fix = (
        "Slice the data-parallel and tensor-parallel meshes from one DeviceMesh: "
        "init_device_mesh(..., mesh_dim_names=('dp', 'tp')) and mesh['dp'], mesh['tp'], or unflatten one world "
        "mesh into both."
    )
    if _ranks_in_order(dp_mesh) != _ranks_in_order(tp_mesh):
        raise FSDPUsageRuntimeError(
            f"fully_shard: parameter {fqn} is tensor-parallel on {tp_mesh}, which shares no root mesh with the "
            f"data-parallel mesh {dp_mesh} (their roots order the ranks differently). {fix}"
        )
    try:
        return compat.concatenate_meshes([dp_mesh, tp_mesh])
    except (KeyError, RuntimeError, ValueError) as e:  # overlapping dims, or a torch that cannot join them
        raise FSDPUsageRuntimeError(
            f"fully_shard: parameter {fqn} is tensor-parallel on {tp_mesh}, which cannot be joined with the "
            f"data-parallel mesh {dp_mesh} ({e}). {fix}"
        ) from e


def _ranks_in_order(mesh: DeviceMesh) -> list[int]:
    """The ranks of the mesh ``mesh`` was sliced or unflattened from, in its order: meshes whose
    roots list the same ranks in the same order have dims that index the same devices."""
    return compat.root_mesh(mesh).mesh.flatten().tolist()


def _spmd_spec(fqn: str, param: DTensor, dp: DataParallelMesh, shard_dim: int) -> ShardedSpec:
    """A parameter on the full SPMD mesh (``dp_mesh_dims``), as PyTorch 2.13 shards it: forward
    sees it as it was (Replicate on the data-parallel dims, its other placements kept); the shard
    is Shard(shard_dim) on the data-parallel shard dim(s), flattened into one if several."""
    mesh, placements = param.device_mesh, tuple(param.placements)
    names = mesh.mesh_dim_names
    data_parallel = [names.index(n) for n in dp.data_parallel_dims]
    for i in data_parallel:
        if not isinstance(placements[i], Replicate):
            raise FSDPUsageError(
                f"fully_shard: parameter {fqn} is {placements[i]!r} on data-parallel mesh dim {names[i]!r}; with "
                "dp_mesh_dims parameters must be Replicate() on the data-parallel dims"
            )
    for name, placement in zip(names, placements):
        if not isinstance(placement, (Shard, compat.StridedShard, Replicate)):
            raise FSDPUsageError(
                f"fully_shard: parameter {fqn} is {placement!r} on mesh dim {name!r}; only Shard and Replicate "
                "placements can be further sharded."
            )
    shard_at = [names.index(n) for n in dp.shard_dims]
    first, last = min(shard_at), max(shard_at)
    if sorted(shard_at) != list(range(first, last + 1)):
        raise FSDPUsageRuntimeError(
            f"fully_shard: dp_mesh_dims shard dims {dp.shard_dims} are not adjacent in the mesh {names}; "
            "order the mesh so the data-parallel shard dims are next to each other."
        )
    # Dims after the shard dims that split the same tensor dim make a rank's rows every k-th block.
    split_factor = 1
    for j in range(last + 1, mesh.ndim):
        if isinstance(placements[j], (Shard, compat.StridedShard)) and placements[j].dim == shard_dim:
            split_factor *= mesh.size(j)
    fsdp = compat.StridedShard(shard_dim, split_factor=split_factor) if split_factor > 1 else Shard(shard_dim)
    if first == last:
        spec_mesh = mesh
    else:
        before = [mesh[n] for n in names[:first]]
        after = [mesh[n] for n in names[last + 1 :]]
        spec_mesh = compat.concatenate_meshes([*before, dp.shard_mesh, *after])
    spec_placements = placements[:first] + (fsdp,) + placements[last + 1 :]
    unsharded = TensorParallelSpec(mesh, placements, param.shape, param.stride(), frozenset(data_parallel))
    return ShardedSpec(spec_mesh, spec_placements, compat.local_tensor(param).detach(), unsharded)
