"""The process-wide hooks fsdp2 installs, in one list, and how long they live.

fsdp2 changes three things outside its own objects, each only while fsdp2 modules exist: the
first ``fully_shard`` installs them, and they are removed when the last fully_shard'ed module is
freed (and installed again by the next ``fully_shard``). Each is registered here by the module
that owns it:

- ``"optimizer local-shard step"`` (fsdp2.optim.local_step): torch.optim's global step pre-hook
  that gives element-wise optimizers over fsdp2 shards the local-shard step. Optimizers over
  other tensors are left as they are; ``fsdp2.optim.set_local_shard_steps(False)`` removes it.
- ``"PyTorch fully_shard guard"`` (fsdp2.torch_switch): PyTorch's ``fully_shard`` refuses a module
  holding fsdp2's (one model, one implementation), whether or not the switch is installed.
- ``"parameter registration"`` (fsdp2.runtime.param_group): nn.Module's global parameter-registration
  hook, through which a compiled step notices a parameter replaced by assignment.

``installed()`` lists the ones in place now.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch.nn as nn


@dataclass
class ProcessHook:
    name: str
    install: Callable[[], None]
    remove: Callable[[], None]
    installed: bool = False


class ProcessHooks:
    """The hooks, and the count of live fully_shard'ed modules that keeps them installed."""

    def __init__(self) -> None:
        self._hooks: dict[str, ProcessHook] = {}
        self._live = 0

    def register(self, name: str, install: Callable[[], None], remove: Callable[[], None]) -> None:
        """Own a hook (once per name); installed now if fsdp2 modules exist."""
        if name not in self._hooks:
            self._hooks[name] = ProcessHook(name, install, remove)
            if self._live:
                self._install(self._hooks[name])

    def module_sharded(self, module: nn.Module) -> None:
        """``fully_shard`` made ``module`` an fsdp2 module: every hook is in place until it and
        every other one are freed."""
        self._live += 1
        weakref.finalize(module, self._module_freed)
        for hook in self._hooks.values():
            if not hook.installed:
                self._install(hook)

    def remove(self, name: str) -> None:
        """Take one hook out now (the next ``fully_shard`` puts it back)."""
        hook = self._hooks.get(name)
        if hook is not None and hook.installed:
            hook.remove()
            hook.installed = False

    def installed(self) -> list[str]:
        return [name for name, hook in self._hooks.items() if hook.installed]

    def _install(self, hook: ProcessHook) -> None:
        hook.install()
        hook.installed = True

    def _module_freed(self) -> None:
        self._live -= 1
        if not self._live:
            for name in self._hooks:
                self.remove(name)


PROCESS_HOOKS = ProcessHooks()
