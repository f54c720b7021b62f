"""Optimizers and optimizer helpers for fsdp2-sharded parameters.

- ``Muon`` and ``gather_apply``/``WholeMatrixSchedule``: whole-matrix updates on sharded
  parameters, each matrix transformed once on an owner rank of its shard group.
- ``step_on_local_shards``: any element-wise ``torch.optim`` optimizer steps the local shards as
  plain tensors (no DTensor dispatch), state and state-dict names unchanged; the default for the
  element-wise ``torch.optim`` classes over fully_shard parameters (``step_on_dtensors`` opts one
  optimizer out, ``set_local_shard_steps(False)`` turns the default off process-wide).
- ``clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_`` across parameters on different meshes
  (TP + FSDP); also ``fsdp2.clip_grad_norm_``.
"""

from fsdp2.optim.grad_clip import clip_grad_norm_
from fsdp2.optim.local_step import LocalShardStep, set_local_shard_steps, step_on_dtensors, step_on_local_shards
from fsdp2.optim.muon import Muon, muon_param_groups
from fsdp2.optim.whole_matrix import WholeMatrixSchedule, gather_apply

__all__ = [
    "LocalShardStep",
    "Muon",
    "WholeMatrixSchedule",
    "clip_grad_norm_",
    "gather_apply",
    "muon_param_groups",
    "set_local_shard_steps",
    "step_on_dtensors",
    "step_on_local_shards",
]
