"""Optimizers for fsdp2-sharded parameters."""

from fsdp2.optim.muon import Muon, muon_param_groups
from fsdp2.optim.whole_matrix import WholeMatrixSchedule, gather_apply

__all__ = ["Muon", "WholeMatrixSchedule", "gather_apply", "muon_param_groups"]
