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


def checkpoint_file(root: str, rel: str) -> str:
    """``root/rel`` after checking that it resolves inside ``root`` and is a regular file.

    Symlinks are allowed as long as their target is inside ``root`` too (``root`` itself may
    be a symlink, e.g. ``ckpt/latest``). Raises ``CheckpointError`` naming the file otherwise.
    """
    full = os.path.join(root, rel)
    real_root = os.path.realpath(root)
    real = os.path.realpath(full)
    if real == real_root or os.path.commonpath([real_root, real]) != real_root:
        raise CheckpointError(f"{full} resolves to {real}, outside the checkpoint directory {root}; "
                              "refusing to read it (restore the real file there)")
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{full} is missing; the checkpoint is incomplete, restore the file or load "
                              "an earlier checkpoint") from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise CheckpointError(f"{full} is {kind}, not a regular file; refusing to read it (restore the real "
                              "file or load an earlier checkpoint)")
    return full
