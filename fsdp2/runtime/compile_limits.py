"""What the compiled whole step (fsdp2.runtime.traced) refuses, checked as dynamo traces each
group's gather: what it cannot express, and state an eager call left that it would ignore. Each
refusal names the module and the way out; none computes other numerics than eager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp2.errors import FSDPUsageError
from fsdp2.runtime import collectives, traced_ops
from fsdp2.runtime.extensions import SubclassCodec
from fsdp2.runtime.param_group import GroupState

if TYPE_CHECKING:
    from fsdp2.runtime.param_group import ParamGroup


def check_traceable(group: "ParamGroup") -> None:
    """Refuse, naming the module and the way out, what the traced path cannot do as eager does."""
    where = f"torch.compile over fully_shard({group.name})"
    problem = None
    if collectives.active_counters and not traced_ops.records_comm:
        problem = "fsdp2.tools.comm_stats.count_comm() around a compiled step on this torch (no ordered effects)"
    elif any(p.tensor_parallel is not None and p.tensor_parallel.data_parallel_mesh_dims for p in group.params):
        problem = "parameters on the full SPMD mesh (dp_mesh_dims)"
    elif any(isinstance(p.codec, SubclassCodec) and p.tensor_parallel is not None for p in group.params):
        # The hooks run on a copy of the shard without torchao's precomputed scale (its detach
        # drops it), so they scale each TP shard by its own amax, where eager scales the whole weight.
        problem = "a tensor subclass's own all-gather (torchao's float8 all-gather) on tensor-parallel parameters"
    elif any(step.plan.reduce_scatter_op.functional_name is None for step in group.step.reduce_steps):
        problem = (
            "set_gradient_divide_factor on NCCL (its PREMUL_SUM reduce op has no functional collective; "
            "set_force_sum_reduction_for_comms(True) divides in a separate op)"
        )
    replaced = []
    if group.params_replaced:  # read in every trace: dynamo guards on it, so a replacement retraces
        replaced = [p.fqn for p in group.params if p.registered_replacement() is not None]
    if problem is None and replaced:
        # Eager fsdp2 takes such a parameter over at its first forward (ShardedParam.refresh).
        problem = (
            f"parameter {replaced[0]} replaced by assignment after fully_shard (load_state_dict takes it over; "
            "so does one eager forward)"
        )
    if problem is not None:
        raise FSDPUsageError(
            f"{where}: {problem} is not supported on the traced path (fullgraph). Remove it, or compile "
            "each block instead (block.compile()), which keeps fsdp2's hooks eager."
        )
    check_no_eager_state(group)


def check_no_eager_state(group: "ParamGroup") -> None:
    """Refuse a compiled step that would ignore what an eager call left in the group: the traced
    path gathers from the shards, so eager's gathered parameters would silently not take part
    (sums kept for an accumulation do: see fsdp2.runtime.grad_sinks). Each read here is guarded:
    the eager call that changes it makes the next compiled call retrace into this."""
    where = f"torch.compile over fully_shard({group.name})"
    # The setting before the state it leaves behind: an eager step with it leaves the group gathered.
    if not group.reshard_after_backward:
        raise FSDPUsageError(
            f"{where}: set_reshard_after_backward(False) keeps the gathered parameters for the next step, "
            "which eager and PyTorch's FSDP2 then compute with (not the optimizer's update); the compiled "
            "step gathers afresh. Compile with the default (True), or run these steps eagerly."
        )
    if group.state is not GroupState.SHARDED:
        raise FSDPUsageError(
            f"{where}: its parameters are gathered outside the compiled step (unshard()); the compiled step "
            "gathers its own and would leave these registered. Call reshard() on the module before the "
            "compiled step."
        )
