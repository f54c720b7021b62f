"""Progress of long byte-moving work (checkpoint save, load, verify, export, Hugging Face import).

A :class:`ByteProgress` is a tqdm bar of bytes done, rate and time left, shown on rank 0 when
stderr is a terminal, or when asked (``FSDP2_PROGRESS=1``, or ``show=True``), and silent in logs,
pipes and tests otherwise (``FSDP2_PROGRESS=0`` silences it everywhere). Code that moves bytes
opens one over the total it will move and calls :meth:`ByteProgress.advance` as it goes; a silent
one costs one attribute check per call.

Progress is a courtesy: it never fails the work it reports on. A save that raised on rank 0
alone, over a bar it could not draw, would leave the other ranks waiting in a collective. So an
unknown ``FSDP2_PROGRESS`` value is warned about once and ignored, and a stream that cannot be
written (closed, ``None``, a broken pipe) silences the bar.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import warnings

import torch.distributed as dist
from tqdm import tqdm

ENV = "FSDP2_PROGRESS"
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")
_warned: set[str] = set()  # unknown settings already warned about


def _rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def wanted() -> bool:
    """Whether progress is shown here: ``FSDP2_PROGRESS`` if set, else on rank 0 with a terminal on stderr."""
    setting = os.environ.get(ENV, "").strip().lower()
    if setting in _OFF or not _rank_zero():
        return False
    if setting in _ON:
        return True
    if setting and setting not in _warned:
        _warned.add(setting)
        warnings.warn(
            f"{ENV}={os.environ[ENV]!r} is not a setting, so it is ignored: use 1 (show progress) or 0 (never show it)",
            RuntimeWarning,
            stacklevel=2,
        )
    try:
        return bool(sys.stderr.isatty())
    except Exception:  # None, closed, or a stand-in without isatty: not a terminal
        return False


class ByteProgress:
    """A bar over ``total`` bytes, labelled ``verb`` and the last part of ``path`` (``save step-100``);
    a context manager.

    ``show=None`` decides with :func:`wanted`. :meth:`advance` may be called from several threads.
    """

    def __init__(self, verb: str, path: str, total: int, show: bool | None = None):
        self._bar = None
        self._lock = threading.Lock()
        self.done = 0
        if total > 0 and (wanted() if show is None else show) and sys.stderr is not None:
            # tqdm hides its bar on a terminal that reports 0 rows or columns (a fresh pseudo-terminal
            # does); shutil falls back to $COLUMNS/$LINES, then 80x24.
            size = shutil.get_terminal_size()
            self._stream = _Guarded(sys.stderr)
            try:
                # Decimal units so the rate reads as GB/s, as disks and networks are quoted.
                self._bar = tqdm(
                    total=total,
                    desc=_label(verb, path),
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1000,
                    file=self._stream,
                    mininterval=0.5,
                    ncols=size.columns,
                    nrows=size.lines,
                )
            except Exception:
                self._bar = None
            if self._stream.broken:  # tqdm draws the empty bar at once
                self.close()

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def advance(self, nbytes: int) -> None:
        if self._bar is not None:
            with self._lock:
                self.done += nbytes
                if self._bar is not None:
                    try:
                        self._bar.update(nbytes)
                    except Exception:
                        self.close()
                    if self._stream.broken:  # a closed pipe, a full disk: stop drawing
                        self.close()

    def advance_to(self, done: int) -> None:
        """Counts everything up to ``done`` bytes as done (e.g. the parts of a file not read byte by byte)."""
        self.advance(max(0, done - self.done))

    def close(self) -> None:
        if self._bar is not None:
            bar, self._bar = self._bar, None
            try:
                bar.close()  # draws the final bar
            except Exception:
                pass  # a broken stream: the work goes on (or is done), only its progress is lost

    def __enter__(self) -> "ByteProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Guarded:
    """The stream tqdm writes to: once a write or flush fails, later ones do nothing.

    tqdm also writes outside our calls (its monitor thread, its finalizer), where an error
    could not be caught; this way none is raised at all.
    """

    def __init__(self, stream):
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> None:
        if not self.broken:
            try:
                self._stream.write(text)
            except Exception:
                self.broken = True

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except Exception:
                self.broken = True

    @property
    def encoding(self) -> str | None:
        try:
            return self._stream.encoding
        except Exception:
            return None


def _label(verb: str, path: str, width: int = 32) -> str:
    """Short enough that the bytes, rate and time left fit on the line after it."""
    name = os.path.basename(os.path.normpath(os.fspath(path))) if path else ""
    if len(name) > width:
        name = "..." + name[-(width - 3) :]
    return f"{verb} {name}".rstrip()


#: For code paths that take a progress and have none to report to.
SILENT = ByteProgress("", "", 0, show=False)
