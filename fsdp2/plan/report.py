"""A plan as a table, as JSON, and as a plot of memory and step time per strategy."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from fsdp2.tools.plotting import pyplot

if TYPE_CHECKING:
    from fsdp2.plan.planner import Plan, StrategyResult

GiB = 2**30


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f}"


def _memory_unit(plan: "Plan") -> tuple[str, float]:
    """GiB, or MiB for models whose peaks are all below 1 GiB."""
    peaks = [r.memory.peak for r in plan.results if r.memory is not None]
    return ("GiB", GiB) if not peaks or max(peaks) >= GiB else ("MiB", 2**20)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.2f}"


def _tokens(rate: float) -> str:
    return f"{rate / 1e3:.1f}k" if rate < 1e6 else f"{rate / 1e6:.2f}M"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _header(plan: "Plan") -> list[str]:
    w = plan.workload
    ac = ", activation checkpointing" if w.activation_checkpointing else ""
    return [
        f"fsdp2 plan: {plan.model}, {_params(plan.num_params)} params",
        f"workload: global batch {w.global_batch} x {w.seq_len} tokens, micro-batch {w.micro_batch} per data-parallel rank, "
        f"{w.optimizer}, {w.precision.describe()}{ac}",
        f"cluster: {plan.cluster.describe()}",
    ]


def _columns(unit: str) -> tuple[str, ...]:
    return ("strategy", "fits", f"peak {unit}", "params", "grads", "optim", "gathered", "activ.", "NVLink GB", "network GB",
            "compute+TP ms", "exposed comm ms", "step ms", "tokens/s")


def _row(r: "StrategyResult", scale: float, width: int) -> tuple[str, ...]:
    if r.skipped is not None:
        return (r.name, "-", "skipped: " + r.skipped) + ("",) * (width - 3)
    m, c, t = r.memory, r.comm, r.time
    mem = lambda nbytes: f"{nbytes / scale:.1f}"  # noqa: E731
    return (
        r.name, "yes" if r.fits else "NO", mem(m.peak), mem(m.params), mem(m.grads + m.extra), mem(m.optimizer),
        mem(m.gathered_peak), mem(m.activations), _gb(c.wire.get("intra", 0)), _gb(c.wire.get("inter", 0)),
        _ms(t.compute + t.tensor_parallel), _ms(t.exposed_comm), _ms(t.seconds), _tokens(r.tokens_per_second),
    )


def render_table(plan: "Plan") -> str:
    unit, scale = _memory_unit(plan)
    columns = _columns(unit)
    rows = [columns] + [_row(r, scale, len(columns)) for r in plan.results]
    skipped = [r for r in rows[1:] if r[2].startswith("skipped")]
    shown = [rows[0]] + [r for r in rows[1:] if r not in skipped]
    widths = [max(len(r[i]) for r in shown) for i in range(len(columns))]
    lines = _header(plan) + [""]
    for index, row in enumerate(shown):
        cells = [cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells))
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [f"{r[0]}: {r[2]}" for r in skipped]
    lines.append("")
    if plan.recommended is not None:
        lines.append(f"verdict: {plan.recommended.name}. {plan.reason}.")
    else:
        lines.append(f"verdict: {plan.reason}.")
    lines += [
        "",
        "peak = predicted allocator peak per GPU (fsdp2.tools.estimate's meta dry run: params, grads, optimizer state, "
        "gathered params, activations, buffers); grads include DDP's buckets; NVLink/network GB = bytes through one "
        "GPU's link per step (ring collectives); exposed comm = time compute waits for collectives under fsdp2's "
        "schedule; step = micro-batches x (compute + TP all-reduces + exposed comm) + optimizer step.",
        "DDP is torch DDP (modelled); TP all-reduce bytes are modelled (count_comm counts fsdp2's collectives only).",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _plain(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if hasattr(value, "name") and "name" not in out:
            out["name"] = value.name
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)  # dtypes


def to_json(plan: "Plan") -> dict:
    out = _plain(plan)
    out["recommended"] = plan.recommended.name if plan.recommended is not None else None
    out["units"] = {"memory": "bytes per GPU", "comm": "bytes per step per GPU", "time": "seconds per step",
                    "tokens_per_second": "whole cluster"}
    return out


def ascii_plot(plan: "Plan", width: int = 40) -> str:
    """Bars of peak memory (against usable memory) and step time per strategy."""
    done = [r for r in plan.results if r.skipped is None]
    if not done:
        return "(nothing to plot)"
    name_w = max(len(r.name) for r in done)
    top_mem = max(max(r.memory.peak for r in done), plan.cluster.usable_bytes)
    top_time = max(r.time.seconds for r in done)
    limit = round(plan.cluster.usable_bytes / top_mem * width)
    lines = [f"{'':{name_w}}  peak memory per GPU ('|' = {plan.cluster.usable_bytes / GiB:.0f} GiB usable)".ljust(name_w + width + 6)
             + "  step time"]
    for r in done:
        bar = "#" * max(1, round(r.memory.peak / top_mem * width))
        bar = (bar[:limit] + "|" + bar[limit:]) if len(bar) > limit else bar.ljust(limit) + "|"
        time_bar = "=" * max(1, round(r.time.seconds / top_time * width))
        mark = "*" if plan.recommended is r else " "
        lines.append(f"{r.name:{name_w}}{mark} {bar.ljust(width + 1)} {_gib(r.memory.peak):>6}  {time_bar} {_ms(r.time.seconds)} ms")
    lines.append("* = verdict")
    return "\n".join(lines)


def save_plot(plan: "Plan", path: str) -> str:
    """Writes the plot to ``path``: the text chart for ``.txt``, else an image in the format its suffix names
    (PNG, SVG, PDF) with matplotlib. Raises :class:`~fsdp2.tools.plotting.PlotUnavailable` (naming the
    ``[plot]`` extra) when an image is asked for without matplotlib. Returns ``path``."""
    if path.endswith(".txt"):
        with open(path, "w") as f:
            f.write(ascii_plot(plan) + "\n")
        return path
    plt = pyplot(f"plot {path}")
    done = [r for r in plan.results if r.skipped is None]
    names = [r.name + ("  (verdict)" if plan.recommended is r else "") for r in done]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, max(3, 0.35 * len(done) + 1.5)), sharey=True)
    colors = ["tab:green" if r.fits else "tab:red" for r in done]
    edges = ["black" if plan.recommended is r else "none" for r in done]
    ax_mem.barh(names, [r.memory.peak / GiB for r in done], color=colors, edgecolor=edges, linewidth=2)
    ax_mem.axvline(plan.cluster.usable_bytes / GiB, color="black", linestyle="--",
                   label=f"usable ({plan.cluster.usable_bytes / GiB:.0f} GiB)")
    ax_mem.set_xlabel("predicted peak memory per GPU (GiB)")
    ax_mem.invert_yaxis()
    ax_mem.legend(loc="lower right")
    ax_time.barh(names, [r.time.seconds * 1e3 for r in done], color=colors, edgecolor=edges, linewidth=2)
    ax_time.set_xlabel("predicted step time (ms)")
    for label in ax_mem.get_yticklabels():
        if label.get_text().endswith("(verdict)"):
            label.set_fontweight("bold")
    title = f"{plan.model} on {plan.cluster.gpus} GPUs (red: does not fit)"
    if plan.recommended is not None:
        title += f"; verdict: {plan.recommended.name}"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
