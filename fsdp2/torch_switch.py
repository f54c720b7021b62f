"""One call that makes code written for PyTorch's FSDP2 (torchtitan, Lightning, accelerate) use fsdp2.

``fsdp2.install_as_torch_fsdp()`` rebinds PyTorch's FSDP2 functions (``fully_shard``,
``register_fsdp_forward_method``, ``share_comm_ctx``) to fsdp2's wherever they are bound at
module level, so ``from torch.distributed.fsdp import fully_shard`` anywhere (before the call
or after it) gives fsdp2's. ``uninstall_as_torch_fsdp()`` puts PyTorch's back; leaving a
``with install_as_torch_fsdp():`` block restores what the block found, so blocks nest (an inner
one leaves the switch on for the outer one). The classes need no switch: fsdp2's ``FSDPModule``,
``UnshardHandle`` and ``GradientReductionHandle`` derive from PyTorch's, and the policies are
PyTorch's own.

One model, one implementation: fsdp2's ``fully_shard`` refuses a module that PyTorch's
``fully_shard`` sharded, or one holding such a submodule, and once fsdp2 has sharded a module
PyTorch's ``fully_shard`` refuses, with the same clear error, a module holding fsdp2's (see
:func:`refuse_mixed_implementations`). fsdp2's ``register_fsdp_forward_method`` and
``share_comm_ctx`` hand modules PyTorch sharded (before the switch, say) to PyTorch's own.

Which names are rebound, decided by identity (``is``), never by name:

- every module-level name, in any module in ``sys.modules`` outside PyTorch, whose value is the
  PyTorch function object itself (a module that did ``from torch.distributed.fsdp import
  fully_shard`` or ``... import fully_shard as fs``);
- the same names in PyTorch's import paths of FSDP2 (``torch.distributed.fsdp``,
  ``torch.distributed.fsdp._fully_shard``, ``torch.distributed._composable.fsdp`` and its
  ``fully_shard`` module).

PyTorch's other modules keep PyTorch's functions: its implementation reads its own global
``fully_shard``, and the others that bind it (pipelining's stage, up to torch 2.14) only call
``fully_shard.state(m)``, which answers for fsdp2 modules too. A reference held anywhere but a
module's namespace (a class attribute, a default argument, a dict, a ``functools.partial``) is not
found and keeps PyTorch's function: call ``install_as_torch_fsdp()`` before the framework builds
such objects. The switch is per process: call it on every rank.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Callable

import torch.nn as nn

from fsdp2 import compat
from fsdp2.runtime.process_hooks import PROCESS_HOOKS

# PyTorch's public names of FSDP2's functions, and the modules that re-export them.
SWITCHED_FUNCTIONS = ("fully_shard", "register_fsdp_forward_method", "share_comm_ctx")
TORCH_IMPORT_PATHS = frozenset({"torch.distributed.fsdp", *compat.TORCH_FSDP2_PRIVATE_IMPORT_PATHS})


def _fsdp2_functions() -> dict[str, Callable[..., Any]]:
    from fsdp2.runtime import fsdp_module
    from fsdp2.runtime.fully_shard import fully_shard

    return {
        "fully_shard": fully_shard,
        "register_fsdp_forward_method": fsdp_module.register_fsdp_forward_method,
        "share_comm_ctx": fsdp_module.share_comm_ctx,
    }


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
        self._found_on_enter: list[bool] = []  # per open ``with switch:`` block: was it on already?

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
        """On for the block; leaving it turns the switch off only if it was off on entry."""
        self._found_on_enter.append(self.installed)
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._found_on_enter.pop():
            self.uninstall()


class SwitchInstallation:
    """What :func:`install_as_torch_fsdp` returns: the switch (``installed``, ``state``), and as a
    ``with`` block, the scope of that call: leaving it turns the switch off only if this call
    turned it on, so an inner block leaves the enclosing block's switch on."""

    def __init__(self, switch: TorchFSDPSwitch, was_installed: bool) -> None:
        self.switch = switch
        self._was_installed = was_installed

    @property
    def installed(self) -> bool:
        return self.switch.installed

    @property
    def state(self) -> SwitchState:
        return self.switch.state

    def __enter__(self) -> TorchFSDPSwitch:
        return self.switch

    def __exit__(self, *exc: Any) -> None:
        if not self._was_installed:
            self.switch.uninstall()


_SWITCH = TorchFSDPSwitch()


def install_as_torch_fsdp() -> SwitchInstallation:
    """Make ``torch.distributed.fsdp.fully_shard`` (and ``register_fsdp_forward_method``,
    ``share_comm_ctx``) fsdp2's in this process, including names modules imported earlier bound.

    The result is also a context manager: ``with fsdp2.install_as_torch_fsdp():`` undoes the call
    on exit if the switch was off before it, so nested blocks keep the outer block's switch on.
    Call it on every rank, before or after importing the framework.
    """
    was_installed = _SWITCH.installed
    _SWITCH.install()
    return SwitchInstallation(_SWITCH, was_installed)


def uninstall_as_torch_fsdp() -> None:
    """Undo :func:`install_as_torch_fsdp`: PyTorch's FSDP2 functions again. The guard on PyTorch's
    ``fully_shard`` stays while fsdp2 modules exist (a model with fsdp2's modules cannot take
    PyTorch's around them), and goes with the last of them, as every process hook does."""
    _SWITCH.uninstall()


# -- one model, one implementation ------------------------------------------------------------------

_ONE_IMPLEMENTATION = (
    "one model must be sharded by one implementation: shard every module with fsdp2's fully_shard "
    "(call fsdp2.install_as_torch_fsdp() before the framework shards the model, so "
    "torch.distributed.fsdp.fully_shard is fsdp2's), or every module with PyTorch's"
)


def _fqn_in(root: nn.Module, module: nn.Module) -> str:
    return next((name or "<root>" for name, m in root.named_modules() if m is module), "?")


def refuse_mixed_implementations(modules: tuple[nn.Module, ...], name: str) -> None:
    """fsdp2's ``fully_shard(modules)``: refuse modules PyTorch's ``fully_shard`` already sharded
    (each module itself, or a submodule), before anything is changed. PyTorch's sharded
    parameters are DTensors, which fsdp2 would take for tensor-parallel ones."""
    from fsdp2.errors import FSDPUsageAssertionError, FSDPUsageError
    from fsdp2.runtime.fsdp_module import managed_by_pytorch

    for root in modules:
        if managed_by_pytorch(root):
            raise FSDPUsageAssertionError(
                f"fully_shard({name}): this {type(root).__name__} was already sharded by PyTorch's "
                f"torch.distributed.fsdp.fully_shard, and this call is fsdp2's; {_ONE_IMPLEMENTATION}."
            )
        for fqn, sub in root.named_modules():
            if managed_by_pytorch(sub):
                raise FSDPUsageError(
                    f"fully_shard({name}): its submodule {fqn!r} ({type(sub).__name__}) was sharded by PyTorch's "
                    f"torch.distributed.fsdp.fully_shard, and this call on {type(root).__name__} is fsdp2's; "
                    f"{_ONE_IMPLEMENTATION}."
                )


class _PyTorchFullyShardGuard:
    """PyTorch's ``fully_shard`` refuses, naming both modules, a module that holds modules or
    parameters fsdp2 manages (it would take fsdp2's shards for tensor-parallel parameters and fail
    inside with ``Invariant encountered``): the helper it looks its modules up with is wrapped, in
    PyTorch's implementation module only; the answer for any other model is unchanged. A process
    hook (fsdp2.runtime.process_hooks): in place while fsdp2 modules exist, switch installed or not."""

    def __init__(self) -> None:
        self._original = None

    def install(self) -> None:
        original = compat.torch_fully_shard_module_lookup()
        if original is None or getattr(original, "__wrapped__", None) is not None:
            return  # another torch layout (PyTorch's own error stands), or in place already

        def _get_modules_and_states(module: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(module, *args, **kwargs)
            _refuse_fsdp2_inside(module, result[2], result[3])
            return result

        _get_modules_and_states.__wrapped__ = original  # type: ignore[attr-defined]
        self._original = original
        compat.set_torch_fully_shard_module_lookup(_get_modules_and_states)

    def remove(self) -> None:
        if self._original is not None:
            compat.set_torch_fully_shard_module_lookup(self._original)
            self._original = None


GUARD_HOOK = "PyTorch fully_shard guard"
_guard = _PyTorchFullyShardGuard()
PROCESS_HOOKS.register(GUARD_HOOK, _guard.install, _guard.remove)


def _refuse_fsdp2_inside(arg: Any, managed_modules: list[nn.Module], params: list[nn.Parameter]) -> None:
    from fsdp2.errors import FSDPUsageError
    from fsdp2.runtime.fsdp_module import FSDPModule
    from fsdp2.runtime.sharded_param import managed_by

    roots = [arg] if isinstance(arg, nn.Module) else list(arg)
    root_name = "+".join(type(r).__name__ for r in roots)
    ours = next((m for m in managed_modules if isinstance(m, FSDPModule)), None)
    owner = next((o for p in params if (o := managed_by(p)) is not None), None)
    if ours is None and owner is None:
        return
    if ours is not None:
        where = next((f"{_fqn_in(r, ours)!r}" for r in roots if any(m is ours for m in r.modules())), "?")
        what = f"its submodule {where} ({type(ours).__name__}) is sharded by fsdp2's fully_shard"
    else:
        what = f"its parameters are already sharded by fsdp2's fully_shard({owner})"
    raise FSDPUsageError(f"PyTorch's torch.distributed.fsdp.fully_shard({root_name}): {what}; {_ONE_IMPLEMENTATION}.")
