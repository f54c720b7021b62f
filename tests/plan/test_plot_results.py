"""benchmarks/plot_results.py draws its charts from RESULTS.md's tables (written and decodable; pixels unchecked)."""

import contextlib
import io
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import plot_results  # noqa: E402


def _main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plot_results.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_charts_from_the_committed_results_are_written_and_decode(tmp_path):
    pytest.importorskip("matplotlib", reason="the [plot] extra (in the test extra, so CI runs this)")
    import matplotlib.image

    code, out, err = _main("--out", str(tmp_path))
    assert code == 0, err
    for name in plot_results.SOURCES:
        assert name in out and (BENCHMARKS / name).exists(), f"{name} is not committed beside RESULTS.md"
        pixels = matplotlib.image.imread(tmp_path / name)
        assert pixels.ndim == 3 and min(pixels.shape[:2]) > 100
        assert f"({name})" in (BENCHMARKS / "RESULTS.md").read_text(), f"RESULTS.md does not show {name}"


def test_a_missing_table_names_the_heading(tmp_path):
    pytest.importorskip("matplotlib")
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nnothing measured yet\n")
    code, _, err = _main("--results", str(results), "--out", str(tmp_path))
    assert code == 2 and "no heading" in err and "SOURCES" in err
    assert not list(tmp_path.glob("*.png"))


def test_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = _main("--out", str(tmp_path))
    assert code == 2 and 'pip install "fsdp2[plot]"' in err and len(err.splitlines()) == 1
