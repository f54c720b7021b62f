"""compat.py is the one home of private PyTorch APIs: no other module of fsdp2 names one.

What counts as naming a private PyTorch API, read from each module's source with ``ast``
(nothing is imported):

- an import, or an attribute path, rooted at ``torch`` with a component that starts with ``_``:
  ``torch._dynamo.disable``, ``torch.ops._c10d_functional``, ``from torch.utils._pytree import
  tree_map``, ``from torch.distributed.tensor import _Foo``. Names bound by imports and by plain
  assignments (``_aten = torch.ops.aten``) are followed, also into ``getattr`` / ``hasattr`` /
  ``setattr`` with a constant name;
- a string that spells a private torch module (``"torch.distributed.fsdp._fully_shard"``, looked
  up in ``sys.modules`` or imported by name);
- a private member of a torch object (a DTensor's ``._local_tensor``, a module's
  ``._parameters``) reached through any expression. No static path tells those apart from
  fsdp2's own attributes, so they are listed by name in PRIVATE_MEMBERS and found wherever they
  are read, written, or named by a constant string (``getattr(m, "_parameters")``).

Dunder names (``__torch_function__``, ``__torch_dispatch__``) are public protocol. Defining a
name that PyTorch calls is not a use either: a ``def _apply`` override on FSDPModule, the
``_start_coalescing`` / ``_allgather_base`` virtuals of tools/noop_pg.py's process group, and
runtime/torch_view.py, which mimics PyTorch's private FSDP2 state (``_fsdp_param_groups``,
``_state_ctx``, ...) for the PyTorch code that reads it from an fsdp2 module. There fsdp2 answers
PyTorch's private reads; it calls nothing private, so those definitions pass (what they answer is
documented in torch_view.py).

On hot paths compat binds the private accessor itself (``operator.attrgetter``, or the torch
function object), so moving a use there adds no Python call to a training step.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[2] / "fsdp2"
HOME = "fsdp2/compat.py"

# Private members of torch objects, by the class they belong to.
PRIVATE_MEMBERS = {
    **dict.fromkeys(("_local_tensor", "_spec"), "DTensor"),
    **dict.fromkeys(
        ("_base", "_typed_storage", "_cdata", "_version", "_is_view", "_post_accumulate_grad_hooks"), "Tensor"
    ),
    **dict.fromkeys(
        (
            "_parameters",
            "_buffers",
            "_modules",
            "_apply",
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_non_persistent_buffers_set",
            "_state_dict_hooks",
            "_load_state_dict_pre_hooks",
            "_register_state_dict_hook",
            "_register_load_state_dict_pre_hook",
        ),
        "nn.Module",
    ),
    **dict.fromkeys(("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"), "torch.optim.Optimizer"),
    **dict.fromkeys(("_get_root_mesh", "_flatten", "_concatenate", "_dim_group_names"), "DeviceMesh"),
    **dict.fromkeys(("_opname", "_schema", "_overloadpacket", "_overloadname"), "OpOverload"),
    **dict.fromkeys(
        ("_register_backend", "_get_backend", "_plugins", "_get_default_group", "_create_internal"), "c10d"
    ),
    "_execution_engine": "autograd",
    **dict.fromkeys(("_mp_policy", "_get_modules_and_states"), "PyTorch's FSDP2"),
}


_TORCH_PATH = re.compile(r"torch(\.\w+)+")
_ATTRIBUTE_BUILTINS = ("getattr", "hasattr", "setattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _first_private(path: list[str]) -> str | None:
    """``path`` up to its first private component, or None if it has none."""
    for i, part in enumerate(path):
        if _private(part):
            return ".".join(path[: i + 1])
    return None


def _attribute_path(node: ast.expr) -> tuple[str, list[str]] | None:
    """``a.b.c`` -> ("a", ["b", "c"]); None for anything but a chain of attributes on a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return (node.id, parts[::-1]) if isinstance(node, ast.Name) else None


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of every private PyTorch API ``source`` names (see the module docstring)."""
    tree = ast.parse(source)
    torch_names: dict[str, list[str]] = {}  # a name bound to a torch object -> its dotted path
    found: list[tuple[int, str]] = []

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                path = alias.name.split(".")
                if path[0] == "torch":
                    torch_names[alias.asname or "torch"] = path if alias.asname else ["torch"]
                    if (hit := _first_private(path)) is not None:
                        found.append((node.lineno, hit))
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == "torch"
        ):
            for alias in node.names:
                path = node.module.split(".") + [alias.name]
                torch_names[alias.asname or alias.name] = path
                if (hit := _first_private(path)) is not None:
                    found.append((node.lineno, hit))

    def torch_path(node: ast.expr) -> list[str] | None:
        chain = _attribute_path(node)
        if chain is None or chain[0] not in torch_names:
            return None
        return torch_names[chain[0]] + chain[1]

    # Plain assignments of torch objects to names (``_aten = torch.ops.aten``), to a fixed point.
    changed = True
    while changed:
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                path = torch_path(node.value)
                if path is not None and torch_names.get(node.targets[0].id) != path:
                    torch_names[node.targets[0].id] = path
                    changed = True

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            path = torch_path(node)
            hit = _first_private(path) if path is not None else None
            if hit is not None:
                found.append((node.lineno, hit))
            elif node.attr in PRIVATE_MEMBERS:
                found.append((node.lineno, "." + node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTRIBUTE_BUILTINS:
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                path = torch_path(node.args[0])
                hit = _first_private(path + [node.args[1].value]) if path is not None else None
                if hit is not None:
                    found.append((node.lineno, hit))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in PRIVATE_MEMBERS:
                found.append((node.lineno, "." + node.value))
            elif _TORCH_PATH.fullmatch(node.value) and (hit := _first_private(node.value.split("."))) is not None:
                found.append((node.lineno, hit))
    return sorted(set(found))


@functools.lru_cache(maxsize=None)  # one scan per session (callers only read it)
def _package_uses() -> dict[str, dict[str, list[int]]]:
    """file (relative to the repository) -> name -> lines, for every module but compat.py."""
    uses: dict[str, dict[str, list[int]]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR.parent).as_posix()
        if rel == HOME:
            continue
        for line, name in private_uses(path.read_text()):
            uses.setdefault(rel, {}).setdefault(name, []).append(line)
    return uses


def test_private_pytorch_apis_are_named_only_in_compat():
    outside = [
        f"{file}:{lines[0]}: {name}" + (f" (also lines {', '.join(map(str, lines[1:]))})" if lines[1:] else "")
        for file, names in _package_uses().items()
        for name, lines in sorted(names.items())
    ]
    assert not outside, "private PyTorch APIs outside fsdp2/compat.py (give each a named home there):\n" + "\n".join(
        outside
    )


def test_compat_is_where_they_are():
    """The scan finds compat's own uses (so an empty result elsewhere means something)."""
    names = {name for _, name in private_uses((PACKAGE_DIR / "compat.py").read_text())}
    assert {"._local_tensor", "._spec", "torch.distributed.tensor._dtensor_spec", "torch._C"} <= names


def test_the_scan_finds_each_kind_of_use():
    source = """
import torch
import torch.distributed as dist
import torch._dynamo
from torch.utils._pytree import tree_map
from torch.distributed import _functional_collectives
from torch.distributed.device_mesh import DeviceMesh
_aten = torch.ops.aten

@torch._dynamo.disable
def f(x, m):
    torch.ops._c10d_functional.all_reduce
    _aten._scaled_dot_product_flash_attention_for_cpu
    dist.distributed_c10d._get_default_group()
    hasattr(DeviceMesh, "_concatenate")
    m._parameters["w"] = x._local_tensor
    getattr(m, "_buffers")
    sys_modules.get("torch.distributed.fsdp._fully_shard._fully_shard")

class Mode:
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return torch.Tensor.__torch_function__
    def _apply(self, fn):  # an override PyTorch calls: not a use
        return self._own_thing, torch.ops.aten.add
"""
    assert {name for _, name in private_uses(source)} == {
        "torch._dynamo",
        "torch.utils._pytree",
        "torch.distributed._functional_collectives",
        "torch.ops._c10d_functional",
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        "torch.distributed.distributed_c10d._get_default_group",
        "torch.distributed.device_mesh.DeviceMesh._concatenate",
        "._concatenate",
        "._parameters",
        "._local_tensor",
        "._buffers",
        "torch.distributed.fsdp._fully_shard",
    }
