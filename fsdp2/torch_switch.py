"""One call that makes code written for PyTorch's FSDP2 (torchtitan, Lightning, accelerate) use fsdp2.

``fsdp2.install_as_torch_fsdp()`` rebinds PyTorch's FSDP2 functions (``fully_shard``,
``register_fsdp_forward_method``, ``share_comm_ctx``) to fsdp2's wherever they are bound at
module level, so ``from torch.distributed.fsdp import fully_shard`` anywhere (before the call
or after it) gives fsdp2's. ``uninstall_as_torch_fsdp()`` (or leaving the ``with`` block) puts
PyTorch's back. The classes need no switch: fsdp2's ``FSDPModule`` and ``UnshardHandle`` derive
from PyTorch's, and the policies are PyTorch's own.

Which names are rebound, decided by identity (``is``), never by name:

- every module-level name, in any module in ``sys.modules`` outside PyTorch, whose value is the
  PyTorch function object itself (a module that did ``from torch.distributed.fsdp import
  fully_shard`` or ``... import fully_shard as fs``);
- the same names in PyTorch's import paths of FSDP2 (``torch.distributed.fsdp``,
  ``torch.distributed.fsdp._fully_shard``, ``torch.distributed._composable.fsdp`` and its
  ``fully_shard`` module).

PyTorch's other modules keep PyTorch's functions: its implementation reads its own global
``fully_shard``, and the rest (pipelining) only calls ``fully_shard.state(m)``, which answers for
fsdp2 modules too. A reference held anywhere but a module's namespace (a class attribute, a
default argument, a dict, a ``functools.partial``) is not found and keeps PyTorch's function:
call ``install_as_torch_fsdp()`` before the framework builds such objects. The switch is per
process: call it on every rank.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Callable

from fsdp2 import compat

# PyTorch's public names of FSDP2's functions, and the modules that re-export them.
SWITCHED_FUNCTIONS = ("fully_shard", "register_fsdp_forward_method", "share_comm_ctx")
TORCH_IMPORT_PATHS = frozenset(
    {
        "torch.distributed.fsdp",
        "torch.distributed.fsdp._fully_shard",
        "torch.distributed._composable.fsdp",
        "torch.distributed._composable.fsdp.fully_shard",
    }
)


def _fsdp2_functions() -> dict[str, Callable[..., Any]]:
    import fsdp2

    return {name: getattr(fsdp2, name) for name in SWITCHED_FUNCTIONS}


def _may_rebind(module_name: str) -> bool:
    in_torch = module_name == "torch" or module_name.startswith("torch.")
    return module_name in TORCH_IMPORT_PATHS or not in_torch


@dataclass
class _Binding:
    """One module-level name that was PyTorch's function and is now fsdp2's."""

    namespace: dict[str, Any]
    name: str
    original: Callable[..., Any]
    replacement: Callable[..., Any]


class SwitchState(Enum):
    OFF = auto()  # PyTorch's functions everywhere
    ON = auto()  # fsdp2's wherever PyTorch's were bound (see the module docstring)


class TorchFSDPSwitch:
    """The process-wide switch; use it through :func:`install_as_torch_fsdp` (also a ``with`` block)."""

    def __init__(self) -> None:
        self.state = SwitchState.OFF
        self._bindings: list[_Binding] = []

    def install(self) -> "TorchFSDPSwitch":
        """Rebind every PyTorch FSDP2 function found; again when ON picks up modules imported
        since (only needed for ones that imported the functions from a private module)."""
        home = compat.torch_fully_shard_home()
        ours = _fsdp2_functions()
        replacement_for = {
            id(original): (original, ours[name])
            for name in SWITCHED_FUNCTIONS
            if (original := getattr(home, name, None)) is not None
        }
        for module_name, module in list(sys.modules.items()):
            if not isinstance(module, types.ModuleType) or not _may_rebind(module_name):
                continue
            namespace = module.__dict__  # not getattr: looking must not import a lazy module
            for name, value in list(namespace.items()):
                found = replacement_for.get(id(value))
                if found is not None and value is found[0]:
                    namespace[name] = found[1]
                    self._bindings.append(_Binding(namespace, name, found[0], found[1]))
        self.state = SwitchState.ON
        return self

    def uninstall(self) -> None:
        """Put PyTorch's functions back where this switch put fsdp2's (a name rebound to
        something else since is left alone)."""
        for binding in reversed(self._bindings):
            if binding.namespace.get(binding.name) is binding.replacement:
                binding.namespace[binding.name] = binding.original
        self._bindings.clear()
        self.state = SwitchState.OFF

    @property
    def installed(self) -> bool:
        return self.state is SwitchState.ON

    def __enter__(self) -> "TorchFSDPSwitch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()


_SWITCH = TorchFSDPSwitch()


def install_as_torch_fsdp() -> TorchFSDPSwitch:
    """Make ``torch.distributed.fsdp.fully_shard`` (and ``register_fsdp_forward_method``,
    ``share_comm_ctx``) fsdp2's in this process, including names modules imported earlier bound.

    Returns the switch, which is also a context manager (``with fsdp2.install_as_torch_fsdp():``
    undoes it on exit). Call it on every rank, before or after importing the framework.
    """
    return _SWITCH.install()


def uninstall_as_torch_fsdp() -> None:
    """Undo :func:`install_as_torch_fsdp`: PyTorch's FSDP2 functions again."""
    _SWITCH.uninstall()
