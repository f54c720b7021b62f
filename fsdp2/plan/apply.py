"""Run a planned strategy: its device mesh, and the model sharded as the planner modelled it.

    mesh = device_mesh(strategy, "cuda")                  # every rank, after init_process_group
    model = apply(model, strategy, mesh, source=source, mp_policy=precision.policy())

Used by ``--calibrate``, by the tests that check the predictions against measured runs, and by
benchmarks/bench_plan.py. fsdp2 has no DDP: ``apply`` wraps DDP strategies in torch's
``DistributedDataParallel``.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp2 import MixedPrecisionPolicy, fully_shard
from fsdp2.plan.model_source import ModelSource
from fsdp2.plan.strategies import Kind, Strategy


def device_mesh(strategy: Strategy, device_type: str) -> DeviceMesh:
    """The (replicate, shard, tp) mesh of ``strategy`` with its size-1 dims left out."""
    dims = [("replicate", strategy.replicate), ("shard", strategy.shard), ("tp", strategy.tp)]
    if strategy.kind is Kind.DDP:
        dims = [("replicate", strategy.replicate)]
    kept = [(name, size) for name, size in dims if size > 1] or [("shard", 1)]
    return init_device_mesh(device_type, tuple(size for _, size in kept), mesh_dim_names=tuple(name for name, _ in kept))


def _data_parallel_mesh(strategy: Strategy, mesh: DeviceMesh) -> DeviceMesh:
    names = [n for n in ("replicate", "shard") if n in mesh.mesh_dim_names]
    return mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]


def apply(model: nn.Module, strategy: Strategy, mesh: DeviceMesh, *, source: ModelSource,
          mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Shard ``model`` (built by ``source``) as ``strategy`` says; returns the model to train."""
    if strategy.kind is Kind.DDP:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    dp_mesh = _data_parallel_mesh(strategy, mesh)
    plan = source.tp_plan() if strategy.tp > 1 else None
    if strategy.tp > 1 and plan is None:
        raise ValueError(f"{strategy.name}: {source.name} has no tensor-parallel plan")
    mp_policy = mp_policy or MixedPrecisionPolicy()
    for block in [m for m in model.modules() if source.is_block(m)]:
        if plan is not None:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=strategy.reshard_after_forward)
    return fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=strategy.reshard_after_forward)
