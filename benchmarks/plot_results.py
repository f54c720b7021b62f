"""Draw the charts benchmarks/RESULTS.md shows, from the numbers in RESULTS.md itself.

    pip install "fsdp2[plot]"
    PYTHONPATH=. python benchmarks/plot_results.py             # writes benchmarks/chart_*.png

Every number plotted is read from a table of RESULTS.md, found by its heading (``SOURCES`` below
names each one), so a chart cannot drift from the table it illustrates: re-run this script after
a table changes and commit the PNGs with it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "RESULTS.md")

# Where each chart's numbers come from: RESULTS.md headings (a section, then a sub-heading in it).
STEP_SECTION = "## Training step on CPU: fsdp2 vs PyTorch FSDP2 vs unsharded"
STEP_TABLE = "### fake process group, world size {n}"  # column "step ms (median)", rows fsdp2/torch/unsharded
HOST_SECTION = "## CPU time per step by world size"
HOST_TABLE = "### Scaling with N, small GPT (4.24M params), CPU ms per step, paired"  # rows "N, noop"
CKPT_SECTION = "## Checkpoint throughput against size"
CKPT_TABLE = "### GiB/s of state saved or loaded, 2 ranks, warm page cache"
SOURCES = {
    "chart_scaling.png": [f"{STEP_SECTION} / {STEP_TABLE}", f"{HOST_SECTION} / {HOST_TABLE}"],
    "chart_checkpoint.png": [f"{CKPT_SECTION} / {CKPT_TABLE}"],
}
WORLD_SIZES = (8, 64, 1024)
IMPLEMENTATIONS = {"fsdp2": "fsdp2", "torch": "PyTorch FSDP2", "unsharded": "unsharded"}


class ResultsError(ValueError):
    """RESULTS.md does not hold a table a chart is drawn from."""


def _level(line: str) -> int:
    return len(line) - len(line.lstrip("#")) if line.startswith("#") else 0


def section(lines: list[str], heading: str) -> list[str]:
    """The lines under the first heading that starts with ``heading``, up to the next heading of its level or above."""
    level = _level(heading)
    for i, line in enumerate(lines):
        if _level(line) == level and line.startswith(heading):
            end = next((j for j in range(i + 1, len(lines)) if 0 < _level(lines[j]) <= level), len(lines))
            return lines[i + 1 : end]
    raise ResultsError(f"RESULTS.md has no heading {heading!r}; update {os.path.basename(__file__)}'s SOURCES")


def table(lines: list[str], heading: str) -> list[dict[str, str]]:
    """The first markdown table under ``heading``, as one dict per row keyed by the header cells."""
    body = section(lines, heading)
    start = next((i for i, line in enumerate(body) if line.startswith("|")), len(body))
    end = next((i for i in range(start, len(body)) if not body[i].startswith("|")), len(body))
    rows = body[start:end]  # the first table only
    cells = [[c.strip().strip("*") for c in row.strip().strip("|").split("|")] for row in rows]
    cells = [c for c in cells if not all(re.fullmatch(r":?-+:?", x) for x in c)]  # the |---| line
    if len(cells) < 2:
        raise ResultsError(f"no table under {heading!r} in RESULTS.md")
    header, body = cells[0], cells[1:]
    return [dict(zip(header, row)) for row in body]


def _number(text: str) -> float:
    match = re.search(r"-?\d+(\.\d+)?", text)
    if match is None:
        raise ResultsError(f"expected a number in RESULTS.md, found {text!r}")
    return float(match.group())


def scaling_data(lines: list[str]) -> dict[str, dict[str, list[float]]]:
    """{"step ms": {impl: [per world size]}, "host CPU ms": {...}}."""
    step_section = section(lines, STEP_SECTION)
    step = {impl: [] for impl in IMPLEMENTATIONS}
    for n in WORLD_SIZES:
        rows = {r["impl"]: r for r in table(step_section, STEP_TABLE.format(n=n))}
        for impl in IMPLEMENTATIONS:
            step[impl].append(_number(rows[impl]["step ms (median)"]))
    host_rows = {r["N, process group"]: r for r in table(section(lines, HOST_SECTION), HOST_TABLE)}
    host = {
        impl: [_number(host_rows[f"{n}, noop"][label]) for n in WORLD_SIZES] for impl, label in IMPLEMENTATIONS.items()
    }
    return {"step ms": step, "host CPU ms": host}


def checkpoint_data(lines: list[str]) -> list[dict[str, float]]:
    rows = table(section(lines, CKPT_SECTION), CKPT_TABLE)
    return [{k: _number(v) for k, v in r.items() if k != "model"} for r in rows]


def plot_scaling(plt, data, path: str) -> None:
    fig, (ax_step, ax_host) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl, label in IMPLEMENTATIONS.items():
        ax_step.plot(WORLD_SIZES, data["step ms"][impl], marker="o", label=label)
        ax_host.plot(WORLD_SIZES, data["host CPU ms"][impl], marker="o", label=label)
    ax_step.set_title("step time (wall ms, median of 45 steps)")
    ax_host.set_title("host work (process CPU ms per step, paired)")
    ax_step.set_xlabel("world size (PyTorch's fake process group, rank 0 simulated)")
    ax_host.set_xlabel("world size (no-op process group, rank 0 simulated)")
    for ax in (ax_step, ax_host):
        ax.set_xscale("log", base=2)
        ax.set_xticks(WORLD_SIZES, [str(n) for n in WORLD_SIZES])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    ax_step.set_ylabel("ms per step")
    ax_host.legend()
    fig.suptitle("small GPT (4.24M params) on a 2-core CPU: RESULTS.md, training step and CPU time by world size")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


CKPT_SERIES = {  # column of the RESULTS.md table -> label, line style
    "fsdp2 save": ("fsdp2 save", "-"),
    "DCP save": ("DCP save", ":"),
    "fsdp2 load, verified": ("fsdp2 load, verified (default)", "-"),
    "fsdp2 load, verify=False": ("fsdp2 load, unverified", "--"),
    "DCP load": ("DCP load (verifies nothing)", ":"),
}


def plot_checkpoint(plt, rows, path: str) -> None:
    fig, (ax_save, ax_load) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    sizes = [r["state GiB"] for r in rows]
    for column, (label, style) in CKPT_SERIES.items():
        ax = ax_save if "save" in column else ax_load
        ax.plot(sizes, [r[column] for r in rows], marker="o", linestyle=style, label=label)
    ax_save.set_title("save (write + fsync + commit)")
    ax_load.set_title("load (warm page cache)")
    for ax in (ax_save, ax_load):
        ax.set_xscale("log")
        ax.set_xlabel("model + AdamW state (GiB)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_save.set_ylabel("GiB/s (slowest rank)")
    ax_save.set_ylim(bottom=0)
    fig.suptitle("checkpoint throughput, 2 CPU ranks, shared 2-core machine: RESULTS.md, throughput against size")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=RESULTS, help="the RESULTS.md to read (default: beside this script)")
    parser.add_argument("--out", default=HERE, help="folder for the PNGs (default: beside RESULTS.md)")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(HERE))  # fsdp2, when run from a checkout without PYTHONPATH
    from fsdp2.tools.plotting import PlotUnavailable, pyplot

    try:
        plt = pyplot("benchmarks/plot_results.py")
        with open(args.results) as f:
            lines = f.read().splitlines()
        charts = {
            "chart_scaling.png": (plot_scaling, scaling_data(lines)),
            "chart_checkpoint.png": (plot_checkpoint, checkpoint_data(lines)),
        }
    except (PlotUnavailable, ResultsError, OSError) as e:
        print(f"plot_results: {e}", file=sys.stderr)
        return 2
    for name, (draw, data) in charts.items():
        path = os.path.join(args.out, name)
        draw(plt, data, path)
        print(f"{path}  (from {'; '.join(SOURCES[name])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
