"""A plan as a plot of memory and step time per strategy: text (``ascii_plot``) or an image
(``save_plot``, matplotlib). Its table and JSON are fsdp2.plan.results's."""

from __future__ import annotations

from fsdp2.plan.results import GiB, Plan, _ms
from fsdp2.tools.plotting import pyplot


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f}"


def ascii_plot(plan: "Plan", width: int = 40) -> str:
    """Bars of peak memory (against usable memory) and step time per strategy."""
    done = [r for r in plan.results if r.skipped is None]
    if not done:
        return "(nothing to plot)"
    name_w = max(len(r.name) for r in done)
    top_mem = max(max(r.memory.peak for r in done), plan.cluster.usable_bytes)
    top_time = max(r.time.seconds for r in done)
    limit = round(plan.cluster.usable_bytes / top_mem * width)
    lines = [
        f"{'':{name_w}}  peak memory per GPU ('|' = {plan.cluster.usable_bytes / GiB:.0f} GiB usable)".ljust(
            name_w + width + 6
        )
        + "  step time"
    ]
    for r in done:
        bar = "#" * max(1, round(r.memory.peak / top_mem * width))
        bar = (bar[:limit] + "|" + bar[limit:]) if len(bar) > limit else bar.ljust(limit) + "|"
        time_bar = "=" * max(1, round(r.time.seconds / top_time * width))
        mark = "*" if plan.recommended is r else " "
        lines.append(
            f"{r.name:{name_w}}{mark} {bar.ljust(width + 1)} {_gib(r.memory.peak):>6}  "
            f"{time_bar} {_ms(r.time.seconds)} ms"
        )
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
    ax_mem.axvline(
        plan.cluster.usable_bytes / GiB,
        color="black",
        linestyle="--",
        label=f"usable ({plan.cluster.usable_bytes / GiB:.0f} GiB)",
    )
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
