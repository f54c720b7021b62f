"""The packages' public names: what the docs teach to import exists where they say, and importing
``fsdp2.tools`` loads none of its tools until one is used."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

import fsdp2
import fsdp2.optim
import fsdp2.tools


@pytest.mark.parametrize("package", [fsdp2, fsdp2.optim, fsdp2.tools], ids=lambda p: p.__name__)
def test_every_exported_name_resolves(package):
    assert package.__all__, f"{package.__name__} exports nothing"
    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert not missing, f"{package.__name__}.__all__ names what it lacks: {missing}"
    assert set(package.__all__) <= set(dir(package))


def test_tools_exports_the_objects_of_their_modules():
    """Each name is the object its module defines (not a copy or a wrapper), and a star import gives them all."""
    expected = {
        "count_comm": "fsdp2.tools.comm_stats",
        "CommStats": "fsdp2.tools.comm_stats",
        "estimate_memory": "fsdp2.tools.estimate",
        "MemoryEstimate": "fsdp2.tools.estimate",
        "local_bytes": "fsdp2.tools.estimate",
        "optimizer_state_bytes": "fsdp2.tools.estimate",
        "PeakMemory": "fsdp2.tools.memory_meter",
        "count_host_work": "fsdp2.tools.host_work",
        "HostWork": "fsdp2.tools.host_work",
        "init_noop_process_group": "fsdp2.tools.noop_pg",
    }
    for name, module in expected.items():
        assert getattr(fsdp2.tools, name) is getattr(importlib.import_module(module), name), name
    namespace: dict = {}
    exec("from fsdp2.tools import *", namespace)
    assert set(fsdp2.tools.__all__) <= set(namespace)


def test_tools_refuses_an_unknown_name_as_a_module_does():
    with pytest.raises(AttributeError, match="no attribute 'count_comms'"):
        fsdp2.tools.count_comms
    assert not hasattr(fsdp2.tools, "count_comms")


def _tool_modules_loaded_by(statement: str) -> list[str]:
    report = "print(json.dumps(sorted(m for m in sys.modules if m.startswith('fsdp2.tools.'))))"
    code = f"import json, sys; {statement}; {report}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_importing_tools_loads_a_tool_only_when_used():
    assert _tool_modules_loaded_by("import fsdp2.tools") == []
    # Checkpoints use the progress bars alone: the estimator's dry run and the profilers stay unloaded.
    assert _tool_modules_loaded_by("import fsdp2.checkpoint") == ["fsdp2.tools.progress"]
    assert _tool_modules_loaded_by("from fsdp2.tools import count_comm") == ["fsdp2.tools.comm_stats"]


def test_clip_grad_norm_is_one_function_at_both_addresses():
    assert fsdp2.optim.clip_grad_norm_ is fsdp2.clip_grad_norm_
