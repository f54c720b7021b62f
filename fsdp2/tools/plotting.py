"""matplotlib, when the ``[plot]`` extra is installed: one place that imports it and says how to get it."""

from __future__ import annotations

INSTALL_HINT = 'pip install "fsdp2[plot]"'


class PlotUnavailable(ImportError):
    """A picture was asked for and matplotlib is not installed."""


def pyplot(what: str):
    """``matplotlib.pyplot`` on the file-only Agg backend; :class:`PlotUnavailable` names the extra if missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed, none opened
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable(f"{what} needs matplotlib: {INSTALL_HINT}") from e
    return plt
