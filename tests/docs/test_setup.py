"""The fresh-machine setup: the pinned set covers every dependency, and the newest tier names drift."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-")


def _pins() -> dict[str, Requirement]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[_normalized(req.name)] = req
    return pins


def test_every_dependency_and_test_extra_is_pinned_at_a_version_pyproject_allows():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    required = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    for req in required:
        pin = pins.get(_normalized(req.name))
        assert pin is not None, f"{req.name} is a dependency but .ci/constraints.txt does not pin it"
        (spec,) = pin.specifier
        assert spec.operator == "==", pin
        assert req.specifier.contains(spec.version, prereleases=True), (str(req), str(pin))


def test_drift_names_each_package_that_differs_from_its_pin(tmp_path):
    pinned = tmp_path / "constraints.txt"
    pinned.write_text(f"# a header\npytest=={pytest.__version__}\nhypothesis==0.0.1\n")
    out = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "drift.py"), str(pinned)], capture_output=True, text=True, check=True
    ).stdout
    assert "hypothesis" in out and "(pinned 0.0.1)" in out, out
    assert "pytest" not in out.replace(".ci/constraints.txt", ""), out
