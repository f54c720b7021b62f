"""Progress of long byte-moving work (checkpoint save, load, verify, export, Hugging Face import).

A :class:`ByteProgress` is a tqdm bar of bytes done, rate and time left, shown on rank 0 when
stderr is a terminal, or when asked (``FSDP2_PROGRESS=1``, or ``show=True``), and silent in logs,
pipes and tests otherwise (``FSDP2_PROGRESS=0`` silences it everywhere). Code that moves bytes
opens one over the total it will move and calls :meth:`ByteProgress.advance` as it goes; a silent
one costs one attribute check per call.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading

import torch.distributed as dist
from tqdm import tqdm

ENV = "FSDP2_PROGRESS"
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def wanted() -> bool:
    """Whether progress is shown here: ``FSDP2_PROGRESS`` if set, else on rank 0 with a terminal on stderr."""
    setting = os.environ.get(ENV, "").strip().lower()
    if setting in _OFF or not _rank_zero():
        return False
    if setting in _ON:
        return True
    if setting:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: use 1 (show progress) or 0 (never show it)")
    return sys.stderr is not None and hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


class ByteProgress:
    """A bar over ``total`` bytes, labelled ``verb`` and the last part of ``path`` (``save step-100``); a context manager.

    ``show=None`` decides with :func:`wanted`. :meth:`advance` may be called from several threads.
    """

    def __init__(self, verb: str, path: str, total: int, show: bool | None = None):
        self._bar = None
        if total > 0 and (wanted() if show is None else show):
            # tqdm hides its bar on a terminal that reports 0 rows or columns (a fresh pseudo-terminal
            # does); shutil falls back to $COLUMNS/$LINES, then 80x24.
            size = shutil.get_terminal_size()
            # Decimal units so the rate reads as GB/s, as disks and networks are quoted.
            self._bar = tqdm(total=total, desc=_label(verb, path), unit="B", unit_scale=True, unit_divisor=1000,
                             file=sys.stderr, mininterval=0.5, ncols=size.columns, nrows=size.lines)
        self._lock = threading.Lock()
        self.done = 0

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def advance(self, nbytes: int) -> None:
        if self._bar is not None:
            with self._lock:
                self.done += nbytes
                self._bar.update(nbytes)

    def advance_to(self, done: int) -> None:
        """Counts everything up to ``done`` bytes as done (e.g. the parts of a file not read byte by byte)."""
        self.advance(max(0, done - self.done))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "ByteProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _label(verb: str, path: str, width: int = 32) -> str:
    """Short enough that the bytes, rate and time left fit on the line after it."""
    name = os.path.basename(os.path.normpath(os.fspath(path))) if path else ""
    if len(name) > width:
        name = "..." + name[-(width - 3):]
    return f"{verb} {name}".rstrip()


#: For code paths that take a progress and have none to report to.
SILENT = ByteProgress("", "", 0, show=False)
