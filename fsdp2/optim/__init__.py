"""Optimizer helpers for sharded parameters."""

from fsdp2.optim.local_step import LocalShardStep, step_on_local_shards

__all__ = ["LocalShardStep", "step_on_local_shards"]
