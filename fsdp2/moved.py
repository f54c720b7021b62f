"""Import paths that moved: the old ``fsdp2.<module>`` names keep working for one release.

The runtime reshape put the FSDP machinery under ``fsdp2.runtime``, shard geometry under
``fsdp2.layout``, the estimator and meters under ``fsdp2.tools`` and gradient clipping under
``fsdp2.optim``. Code written against the previous layout imports through an alias module that
warns once (``DeprecationWarning`` naming the new path) and forwards every attribute to the new
module, so ``import fsdp2.comm_stats`` and ``from fsdp2.estimate import estimate_memory`` still work.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

#: old module -> new module. Removed in the release after next.
MOVED_MODULES: dict[str, str] = {
    "fsdp2.collectives": "fsdp2.runtime.collectives",
    "fsdp2.comm_stats": "fsdp2.tools.comm_stats",
    "fsdp2.dp_mesh": "fsdp2.runtime.dp_mesh",
    "fsdp2.dtensor_spec": "fsdp2.runtime.dtensor_spec",
    "fsdp2.estimate": "fsdp2.tools.estimate",
    "fsdp2.fsdp_module": "fsdp2.runtime.fsdp_module",
    "fsdp2.fully_shard": "fsdp2.runtime.fully_shard",
    "fsdp2.grad_clip": "fsdp2.optim.grad_clip",
    "fsdp2.memory_meter": "fsdp2.tools.memory_meter",
    "fsdp2.meta_step": "fsdp2.tools.meta_step",
    "fsdp2.param_group": "fsdp2.runtime.param_group",
    "fsdp2.shard_layout": "fsdp2.layout.shard_layout",
    "fsdp2.sharded_param": "fsdp2.runtime.sharded_param",
    "fsdp2.streams": "fsdp2.runtime.streams",
}

#: (old module, name) -> new module, for names that left their module when it was split.
MOVED_NAMES: dict[tuple[str, str], str] = {
    ("fsdp2.param_group", "FlatBucket"): "fsdp2.runtime.buckets",
    ("fsdp2.param_group", "PendingGather"): "fsdp2.runtime.gather",
    ("fsdp2.param_group", "PendingReduce"): "fsdp2.runtime.reduce",
}


def _public_names(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items()
                 if not n.startswith("_") and getattr(v, "__module__", module.__name__) == module.__name__
                 and not isinstance(v, types.ModuleType)]
    return sorted(names)


def alias_module(old: str) -> types.ModuleType:
    """A module named ``old`` whose attributes are read from the module it moved to."""
    new = MOVED_MODULES[old]
    target = importlib.import_module(new)
    extra = {name: where for (mod, name), where in MOVED_NAMES.items() if mod == old}
    alias = types.ModuleType(old, f"Deprecated alias of :mod:`{new}`.")

    def __getattr__(name: str):
        if name in extra:
            return getattr(importlib.import_module(extra[name]), name)
        try:
            return getattr(target, name)
        except AttributeError:
            raise AttributeError(f"module {old!r} (moved to {new!r}) has no attribute {name!r}") from None

    def __dir__() -> list[str]:
        return sorted(set(dir(target)) | set(extra))

    alias.__getattr__ = __getattr__  # type: ignore[method-assign]  # PEP 562: consulted for missing names
    alias.__dir__ = __dir__  # type: ignore[method-assign]
    alias.__all__ = sorted(set(_public_names(target)) | set(extra))
    return alias


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of the old paths only; everything else goes to the normal finders."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        # importlib's own frames are skipped by warnings, so stacklevel 2 names the importing line.
        warnings.warn(f"{spec.name} moved to {MOVED_MODULES[spec.name]}; import it from there "
                      f"(the old path is removed in the next release)", DeprecationWarning, stacklevel=2)
        return alias_module(spec.name)

    def exec_module(self, module):
        pass


class _Package(types.ModuleType):
    """``fsdp2`` itself: importing an old path must not replace a name the package exports.

    Python binds every imported submodule as an attribute of its package, so a first
    ``import fsdp2.fully_shard`` would replace the function ``fsdp2.fully_shard`` with the alias
    module. As in the old layout, where ``__init__`` rebound the name to the function, the
    package's own attribute wins; the alias stays reachable through ``sys.modules``.
    """

    def __setattr__(self, name: str, value) -> None:
        if (isinstance(value, types.ModuleType) and value.__name__ in MOVED_MODULES
                and not isinstance(self.__dict__.get(name, value), types.ModuleType)):
            return
        super().__setattr__(name, value)


def install(package: types.ModuleType) -> None:
    """Makes the old paths importable (idempotent; ``fsdp2/__init__.py`` calls it with itself)."""
    if not isinstance(package, _Package):
        package.__class__ = _Package
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
