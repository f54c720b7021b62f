"""The old import paths of the runtime reshape keep working for one release, with a DeprecationWarning."""

import importlib
import sys

import pytest

import fsdp2
from fsdp2.moved import MOVED_MODULES, MOVED_NAMES

# Every public module-level name of the moved modules as the previous layout had them
# (``git show 33b90b7~1:fsdp2/<module>.py``), with the module each one lives in now.
OLD_PUBLIC_NAMES = {
    "fsdp2.collectives": ["CompletedWork", "active_counters", "all_gather", "all_reduce_sum", "reduce_scatter_sum"],
    "fsdp2.comm_stats": ["KINDS", "CommStats", "count_comm"],
    "fsdp2.dp_mesh": ["DataParallelMesh"],
    "fsdp2.dtensor_spec": ["ShardedSpec", "TensorParallelSpec", "sharded_spec"],
    "fsdp2.estimate": ["GroupEstimate", "MemoryEstimate", "estimate_memory", "local_bytes", "optimizer_state_bytes"],
    "fsdp2.fsdp_module": ["FSDPModule", "UnshardHandle", "register_fsdp_forward_method"],
    "fsdp2.fully_shard": ["fully_shard"],
    "fsdp2.grad_clip": ["clip_grad_norm_"],
    "fsdp2.memory_meter": ["PeakMemory"],
    "fsdp2.meta_step": ["GroupBytes", "StepProfile", "dry_run_step", "meta_copy"],
    "fsdp2.param_group": ["FlatBucket", "GroupState", "ParamGroup", "PendingGather", "PendingReduce"],
    "fsdp2.shard_layout": ["ShardLayout"],
    "fsdp2.sharded_param": ["ParamSlot", "ParamState", "ShardedParam", "managed_by", "mark_managed"],
    "fsdp2.streams": ["CommStreams", "Completion", "GatherBuffers", "SideStream"],
}


def _fresh_import(name: str):
    """Imports ``name`` as a first import would (the warning fires once per process otherwise)."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    bound = vars(sys.modules[parent]).get(child)
    if getattr(bound, "__name__", None) == name and isinstance(bound, type(sys)):  # the alias, not fsdp2.fully_shard
        delattr(sys.modules[parent], child)
    __import__(name)  # not importlib.import_module: the warning's frame is then this file
    return sys.modules[name]


def test_every_moved_module_is_listed():
    assert sorted(MOVED_MODULES) == sorted(OLD_PUBLIC_NAMES)


@pytest.mark.parametrize("old", sorted(OLD_PUBLIC_NAMES))
def test_old_path_warns_naming_the_new_path(old):
    new = MOVED_MODULES[old]
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}\b") as record:
        _fresh_import(old)
    # The warning points at the importing code, not at importlib or fsdp2.moved.
    assert record[0].filename == __file__


@pytest.mark.parametrize("old", sorted(OLD_PUBLIC_NAMES))
def test_every_public_name_through_old_and_new_path(old):
    with pytest.warns(DeprecationWarning):
        alias = _fresh_import(old)
    new = importlib.import_module(MOVED_MODULES[old])
    for name in OLD_PUBLIC_NAMES[old]:
        home = importlib.import_module(MOVED_NAMES.get((old, name), MOVED_MODULES[old]))
        assert getattr(alias, name) is getattr(home, name), f"{old}.{name}"
        namespace: dict = {}
        exec(f"from {old} import {name}", namespace)
        assert namespace[name] is getattr(home, name)
    # Names added since the move are reachable through the old path too.
    for name in [n for n in dir(new) if not n.startswith("_")]:
        assert getattr(alias, name) is getattr(new, name)


def test_old_module_path_does_not_replace_the_package_export():
    """``fsdp2.fully_shard`` is both an old module path and the package's function: the function stays."""
    from fsdp2.runtime.fully_shard import fully_shard

    with pytest.warns(DeprecationWarning):
        alias = _fresh_import("fsdp2.fully_shard")
    assert fsdp2.fully_shard is fully_shard
    namespace: dict = {}
    exec("from fsdp2 import fully_shard", namespace)
    assert namespace["fully_shard"] is fully_shard
    assert alias.fully_shard is fully_shard and sys.modules["fsdp2.fully_shard"] is alias


def test_star_import_through_old_path():
    with pytest.warns(DeprecationWarning):
        _fresh_import("fsdp2.estimate")
    namespace: dict = {}
    exec("from fsdp2.estimate import *", namespace)
    assert namespace["estimate_memory"] is fsdp2.tools.estimate.estimate_memory


def test_unknown_name_on_old_path_names_the_new_module():
    with pytest.warns(DeprecationWarning):
        alias = _fresh_import("fsdp2.comm_stats")
    with pytest.raises(AttributeError, match="moved to 'fsdp2.tools.comm_stats'"):
        alias.no_such_name


def test_new_paths_and_unrelated_imports_do_not_warn(recwarn):
    importlib.import_module("fsdp2.tools.comm_stats")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fsdp2.no_such_module")
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning) and "fsdp2" in str(w.message)]
