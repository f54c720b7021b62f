"""fsdp2's process-wide hooks (fsdp2.runtime.process_hooks) exist only while fsdp2 modules do.

Each case runs in a fresh interpreter: importing fsdp2 installs nothing; the first fully_shard
installs torch.optim's global step pre-hook, nn.Module's parameter-registration hook and the guard
on PyTorch's fully_shard; freeing the last fully_shard'ed module removes all three (the next
fully_shard puts them back), also after uninstall_as_torch_fsdp().
"""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import gc, json, torch, torch.distributed as dist
import torch.nn.modules.module as nn_module
from torch.optim.optimizer import _global_optimizer_pre_hooks
from torch.testing._internal.distributed.fake_pg import FakeStore
from fsdp2 import compat

def state():
    lookup = compat.torch_fully_shard_module_lookup()
    return {
        "optimizer": len(_global_optimizer_pre_hooks),
        "registration": len(nn_module._global_parameter_registration_hooks),
        "guard": getattr(lookup, "__wrapped__", None) is not None,
    }

seen = {"before import": state()}
import fsdp2
from fsdp2.runtime.process_hooks import PROCESS_HOOKS
seen["imported"] = state()
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
model = fsdp2.fully_shard(torch.nn.Linear(4, 4))
seen["sharded"] = state()
seen["installed"] = sorted(PROCESS_HOOKS.installed())
STEP
print(json.dumps(seen))
"""


def _probe(step: str) -> dict:
    code = _PROBE.replace("STEP", step)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


NONE = {"optimizer": 0, "registration": 0, "guard": False}
ALL = {"optimizer": 1, "registration": 1, "guard": True}


def test_installed_by_the_first_fully_shard_and_removed_with_the_last_module():
    seen = _probe(
        "del model; gc.collect(); seen['freed'] = state()\n"
        "again = fsdp2.fully_shard(torch.nn.Linear(4, 4)); seen['again'] = state()"
    )
    assert seen["before import"] == NONE and seen["imported"] == NONE, seen
    assert seen["sharded"] == ALL, seen
    assert seen["installed"] == ["PyTorch fully_shard guard", "optimizer local-shard step", "parameter registration"]
    assert seen["freed"] == NONE, seen
    assert seen["again"] == ALL, seen


def test_the_guard_on_pytorch_fully_shard_outlives_uninstall_as_torch_fsdp_while_fsdp2_modules_exist():
    """PyTorch's fully_shard on a parent of a live fsdp2 module after uninstall_as_torch_fsdp():
    the error that says one model takes one implementation, not a failure inside PyTorch's code."""
    seen = _probe(
        "fsdp2.install_as_torch_fsdp(); fsdp2.uninstall_as_torch_fsdp(); seen['uninstalled'] = state()\n"
        "from torch.distributed.fsdp import fully_shard as torch_fully_shard\n"
        "try:\n"
        "    torch_fully_shard(torch.nn.Sequential(model, torch.nn.Linear(4, 4)))\n"
        "except Exception as e:\n"
        "    seen['error'] = [type(e).__name__, str(e)]\n"
        "del model; gc.collect(); seen['freed'] = state()"
    )
    assert seen["uninstalled"] == ALL, seen
    name, message = seen["error"]
    assert name == "FSDPUsageError" and "one model must be sharded by one implementation" in message, seen
    assert seen["freed"] == NONE, seen


def test_a_trained_module_is_freed_eager_and_compiled():
    """After training steps (eager, and compiled once dynamo forgets its graphs), deleting the model
    frees it, and with it the hooks (autograd's hooks on leaves must not keep it alive)."""
    seen = _probe(
        "opt = torch.optim.AdamW(model.parameters())\n"
        "for run in (model, torch.compile(model, backend='aot_eager', fullgraph=True)):\n"
        "    for _ in range(2):\n"
        "        run(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "import weakref; alive = weakref.ref(model); del model, opt, run\n"
        "torch._dynamo.reset(); gc.collect()\n"
        "seen['freed'] = alive() is None; seen['after'] = state()"
    )
    assert seen["freed"], seen
    assert seen["after"] == NONE, seen
