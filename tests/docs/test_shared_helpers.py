"""Test modules share helpers through tests/support/ (or a folder's own helper module), never by
importing another test module: read from each test file's source with ``ast``, any import, at
module level or inside a function."""

from __future__ import annotations

import ast
import pathlib

TESTS_DIR = pathlib.Path(__file__).resolve().parents[1]


def _imported_test_modules(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [n for n in names if n.startswith("tests.") and n.rpartition(".")[2].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    wrong = {
        str(path.relative_to(TESTS_DIR)): imported
        for path in sorted(TESTS_DIR.rglob("test_*.py"))
        if (imported := _imported_test_modules(path))
    }
    assert not wrong, f"import shared helpers from tests/support/ instead: {wrong}"


def test_the_scan_sees_imports_inside_functions(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text("def f():\n    from tests.runtime.test_dropin import CFG\n")
    assert _imported_test_modules(probe) == ["tests.runtime.test_dropin"]
