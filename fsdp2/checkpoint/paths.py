"""The one check every opened checkpoint file goes through: a regular file inside the directory.

A manifest names its files; a checkpoint directory may come from anyone. Reading a FIFO or a
character device (a rank file symlinked to ``/dev/zero``) would block or never end, and a
symlink could make us read (and report on) files elsewhere on the machine. The loader, the
verifier, ``consolidate`` and ``inspect`` open checkpoint files through ``checkpoint_file`` or
``open_checkpoint_file``, JSON files (manifest, Hugging Face index) through
``read_checkpoint_text``, and the save lock through ``open_regular``: every file we read is
opened non-blocking and checked with ``fstat`` before its first byte is read.
"""

from __future__ import annotations

import os
import stat

from .errors import CheckpointError

_KINDS = [
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
]


def _inside(root: str, rel: str, links_may_leave_root: bool) -> tuple[str, str]:
    """(``root/rel``, what it resolves to) after checking it stays inside ``root``."""
    full = os.path.join(root, rel)
    real_root = os.path.realpath(root)
    if links_may_leave_root:  # the name itself must stay inside; a symlink there may point anywhere
        real = os.path.join(os.path.realpath(os.path.dirname(full)), os.path.basename(full))
    else:
        real = os.path.realpath(full)
    if real == real_root or os.path.commonpath([real_root, real]) != real_root:
        raise CheckpointError(
            f"{full} resolves to {real}, outside the checkpoint directory {root}; "
            "refusing to read it (restore the real file there)"
        )
    return full, real


_RESTORE = "refusing to read it (restore the real file or load an earlier checkpoint)"


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages: "a FIFO", "a directory", ..."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refuse_irregular(full: str, mode: int, fix: str = _RESTORE) -> None:
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{full} is {file_kind(mode)}, not a regular file; {fix}")


def _missing(full: str) -> CheckpointError:
    return CheckpointError(
        f"{full} is missing; the checkpoint is incomplete, restore the file or load an earlier checkpoint"
    )


def open_regular(full: str, fix: str = _RESTORE, follow_links: bool = True) -> tuple[int, os.stat_result]:
    """(fd, its ``fstat``) of the regular file ``full``, opened read-only and non-blocking.

    A FIFO or device opened this way cannot block, and is refused (``CheckpointError`` ending in
    ``fix``) before any read. ``follow_links=False`` refuses a symlink too, dangling or not.
    ``FileNotFoundError`` is left to the caller: what a missing file means depends on the file.
    """
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(full, flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        if not follow_links and os.path.islink(full):  # O_NOFOLLOW on a symlink: ELOOP
            raise CheckpointError(
                f"{full} is a symbolic link (to {os.readlink(full)}), not a regular file; {fix}"
            ) from None
        raise CheckpointError(f"{full} cannot be opened ({e}); {fix}") from None
    try:
        st = os.fstat(fd)
        _refuse_irregular(full, st.st_mode, fix)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_text(fd: int, full: str, fix: str, limit: int | None = None) -> str:
    """The UTF-8 text of the open regular file ``fd`` (at most ``limit`` bytes), or a ``CheckpointError``."""
    parts, total = [], 0
    while limit is None or total < limit:
        part = os.read(fd, 1 << 20 if limit is None else min(1 << 20, limit - total))
        if not part:
            break
        parts.append(part)
        total += len(part)
    try:
        return b"".join(parts).decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{full} is not UTF-8 text ({e.reason} at byte {e.start}); {fix}") from None


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
        fd, st = open_regular(full)
    except FileNotFoundError:
        raise _missing(full) from None
    return fd, st.st_size


def read_checkpoint_text(
    root: str,
    rel: str,
    fix: str = "the file is damaged: restore it or load an earlier checkpoint",
    links_may_leave_root: bool = False,
) -> str:
    """The UTF-8 text of the JSON file ``root/rel`` (a manifest, an index), checked as
    :func:`open_checkpoint_file` checks data files: never a FIFO or device, never outside ``root``."""
    fd, _ = open_checkpoint_file(root, rel, links_may_leave_root)
    try:
        return read_text(fd, os.path.join(root, rel), fix)
    finally:
        os.close(fd)
