"""The module map flows downward: every import of the fsdp2 package goes to a layer below, never
up, and no chain of imports comes back to where it started.

The map (as README's Layout section puts it: the runtime's modules read in the order a training
step uses them; geometry sits below both the runtime and checkpoints; tools, optimizers and models
stand apart; compat.py is the one home of private PyTorch APIs). Each unit may import itself and
the units listed for it, nothing else of fsdp2:

    fsdp2 (__init__.py)  the public API, and the wiring fully_shard calls the upper layers through
                         (fsdp2.runtime.fully_shard.on_fully_shard): anything
    fsdp2.plan           the planner: checkpoint, models, tools, runtime, layout, base
    fsdp2.ft             fault-tolerant HSDP on torchft: runtime, base
    fsdp2.torch_switch   PyTorch's FSDP2 names bound to fsdp2's: runtime, base
    fsdp2.optim          optimizers: runtime, layout, base
    fsdp2.tools          estimator, meters, simulated world: runtime, layout, base
    fsdp2.checkpoint     sharded checkpoints: layout, base; of the tools only progress.py (byte
                         progress bars), of the runtime only fsdp_module.py (FSDPModule: save and
                         load reshard first)
    fsdp2.runtime        the FSDP machinery: layout, base
    fsdp2.layout         shard geometry: base
    fsdp2.models         the example models: nothing of fsdp2
    base                 fsdp2.policies (-> errors, compat), fsdp2.errors, fsdp2.compat (nothing of fsdp2)

So the runtime imports nothing from the optimizers, checkpoints, planner, tools, ft or the torch
switch (the optimizer default and the switch's guards reach fully_shard through the package's
wiring), and nothing inside the package imports the package itself: each module imports a name
from the module that defines it.

An import is an arrow wherever it is written: at module level, inside a function, under ``if
TYPE_CHECKING:`` or in a ``try``. Read from the source with ``ast`` (nothing is imported), relative
imports resolved, ``from pkg import name`` going to ``pkg.name`` where that is a module.
"""

from __future__ import annotations

import ast
import functools
import pathlib

PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[2] / "fsdp2"

BASE = ("fsdp2.policies", "fsdp2.errors", "fsdp2.compat")

# unit -> what its modules may import (module names or prefixes of them), besides the unit itself.
MODULE_MAP: dict[str, tuple[str, ...]] = {
    "fsdp2": ("fsdp2.",),
    "fsdp2.plan": ("fsdp2.checkpoint", "fsdp2.models", "fsdp2.tools", "fsdp2.runtime", "fsdp2.layout", *BASE),
    "fsdp2.ft": ("fsdp2.runtime", *BASE),
    "fsdp2.torch_switch": ("fsdp2.runtime", *BASE),
    "fsdp2.optim": ("fsdp2.runtime", "fsdp2.layout", *BASE),
    "fsdp2.tools": ("fsdp2.runtime", "fsdp2.layout", *BASE),
    "fsdp2.checkpoint": ("fsdp2.layout", "fsdp2.tools.progress", "fsdp2.runtime.fsdp_module", *BASE),
    "fsdp2.runtime": ("fsdp2.layout", *BASE),
    "fsdp2.layout": BASE,
    "fsdp2.models": (),
    "fsdp2.policies": ("fsdp2.errors", "fsdp2.compat"),
    "fsdp2.errors": (),
    "fsdp2.compat": (),
}


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """module name -> (file, is a package's __init__)."""
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


@functools.lru_cache(maxsize=None)  # one scan per session (callers only read it)
def import_graph() -> dict[str, dict[str, int]]:
    """importer -> {imported module of fsdp2: line of the first such import}."""
    modules = _modules()

    def target(name: str) -> str:
        # The deepest module of the package that ``name`` names or lies in.
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, dict[str, int]] = {}
    for module, (path, is_package) in modules.items():
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, is_package, node.level, node.module)
                imported = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names
                ]
            else:
                continue
            for name in imported:
                if name == "fsdp2" or name.startswith("fsdp2."):
                    to = target(name)
                    if to and to != module:
                        edges.setdefault(to, node.lineno)
    return graph


def _unit(module: str) -> str:
    if module == "fsdp2":
        return "fsdp2"
    return max(
        (u for u in MODULE_MAP if u != "fsdp2" and (module == u or module.startswith(u + "."))), key=len, default=""
    )


def _allowed(unit: str, imported: str) -> bool:
    if _unit(imported) == unit:
        return True
    return any(imported == p or imported.startswith(p if p.endswith(".") else p + ".") for p in MODULE_MAP[unit])


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan), as a closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:
        members = set(group)
        start = min(group)
        path, seen = [start], {start}
        while True:  # walk inside the group until a module repeats
            nxt = min(w for w in graph[path[-1]] if w in members)
            if nxt in seen:
                cycles.append(path[path.index(nxt) :] + [nxt])
                break
            path.append(nxt)
            seen.add(nxt)
    return cycles


def test_the_graph_sees_every_kind_of_import():
    """The graph holds the imports a looser reading would miss: relative, inside functions,
    ``from package import module``."""
    graph = import_graph()
    assert "fsdp2.checkpoint.gc_pause" in graph["fsdp2.checkpoint.verify"]  # from . import gc_pause
    assert "fsdp2.runtime.schedule" in graph["fsdp2.runtime.fully_shard"]  # from fsdp2.runtime import schedule
    assert "fsdp2.runtime.fsdp_module" in graph["fsdp2.checkpoint.state"]  # inside reshard_model()
    assert "fsdp2.runtime.sharded_param" in graph["fsdp2.runtime.extensions"]  # under TYPE_CHECKING


def test_no_import_circle():
    cycles = _cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_module_is_on_the_map():
    unplaced = sorted(m for m in _modules() if not _unit(m))
    assert not unplaced, f"modules not on the map (add them to MODULE_MAP and to README's Layout): {unplaced}"


def test_imports_go_down_the_map():
    graph = import_graph()
    wrong = [
        f"{module} -> {imported} (line {line})"
        for module, edges in sorted(graph.items())
        for imported, line in sorted(edges.items())
        if not _allowed(_unit(module), imported)
    ]
    assert not wrong, "imports against the module map:\n" + "\n".join(wrong)


def test_the_runtime_imports_no_layer_above_it():
    """Spelled out, the arrows the runtime must never draw (also inside functions)."""
    above = (
        "fsdp2.optim",
        "fsdp2.checkpoint",
        "fsdp2.plan",
        "fsdp2.tools",
        "fsdp2.ft",
        "fsdp2.torch_switch",
        "fsdp2.models",
    )
    graph = import_graph()
    wrong = [
        f"{module} -> {imported}"
        for module, edges in graph.items()
        if module.startswith("fsdp2.runtime")
        for imported in edges
        if imported == "fsdp2" or imported.startswith(above)
    ]
    assert not wrong, wrong


def test_geometry_sits_below_the_runtime_and_checkpoints():
    graph = import_graph()
    layout = [m for m in graph if m.startswith("fsdp2.layout")]
    assert layout
    for module in layout:
        assert all(not t.startswith(("fsdp2.runtime", "fsdp2.checkpoint")) for t in graph[module]), (
            module,
            graph[module],
        )
    users = {_unit(m) for m, edges in graph.items() for t in edges if t.startswith("fsdp2.layout.")}
    assert {"fsdp2.runtime", "fsdp2.checkpoint"} <= users
