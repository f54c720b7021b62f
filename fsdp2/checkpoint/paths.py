"""The one check every opened checkpoint file goes through: a regular file inside the directory.

A manifest names its files; a checkpoint directory may come from anyone. Reading a FIFO or a
character device (a rank file symlinked to ``/dev/zero``) would block or never end, and a
symlink could make us read (and report on) files elsewhere on the machine. The loader, the
verifier, ``consolidate`` and ``inspect`` all open checkpoint files through ``checkpoint_file``.
"""

from __future__ import annotations

import os
import stat

from .errors import CheckpointError

_KINDS = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]


def _inside(root: str, rel: str, links_may_leave_root: bool) -> tuple[str, str]:
    """(``root/rel``, what it resolves to) after checking it stays inside ``root``."""
    full = os.path.join(root, rel)
    real_root = os.path.realpath(root)
    if links_may_leave_root:  # the name itself must stay inside; a symlink there may point anywhere
        real = os.path.join(os.path.realpath(os.path.dirname(full)), os.path.basename(full))
    else:
        real = os.path.realpath(full)
    if real == real_root or os.path.commonpath([real_root, real]) != real_root:
        raise CheckpointError(f"{full} resolves to {real}, outside the checkpoint directory {root}; "
                              "refusing to read it (restore the real file there)")
    return full, real


def _refuse_irregular(full: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise CheckpointError(f"{full} is {kind}, not a regular file; refusing to read it (restore the real "
                              "file or load an earlier checkpoint)")


def _missing(full: str) -> CheckpointError:
    return CheckpointError(f"{full} is missing; the checkpoint is incomplete, restore the file or load "
                           "an earlier checkpoint")


def checkpoint_file(root: str, rel: str) -> str:
    """``root/rel`` after checking that it resolves inside ``root`` and is a regular file.

    Symlinks are allowed as long as their target is inside ``root`` too (``root`` itself may
    be a symlink, e.g. ``ckpt/latest``). Raises ``CheckpointError`` naming the file otherwise.
    For callers that open the file by name (JSON, ``safe_open``); readers of tensor data use
    :func:`open_checkpoint_file`, which checks the file it actually opened.
    """
    full, real = _inside(root, rel, links_may_leave_root=False)
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        raise _missing(full) from None
    _refuse_irregular(full, mode)
    return full


def open_checkpoint_file(root: str, rel: str, links_may_leave_root: bool = False) -> tuple[int, int]:
    """(fd, size) of ``root/rel``, opened read-only and non-blocking, then checked with ``fstat``:
    a FIFO or device opened this way cannot block, and is refused before any read.

    ``links_may_leave_root``: a symlink may point outside ``root`` (the Hugging Face cache links
    every snapshot file into its blobs/ directory); the name itself never may.
    """
    full, _ = _inside(root, rel, links_may_leave_root)
    try:
        fd = os.open(full, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise _missing(full) from None
    except OSError as e:
        raise CheckpointError(f"{full} cannot be opened ({e})") from None
    st = os.fstat(fd)
    try:
        _refuse_irregular(full, st.st_mode)
    except CheckpointError:
        os.close(fd)
        raise
    return fd, st.st_size
