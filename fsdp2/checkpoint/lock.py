"""``SaveLock``: one save at a time into a checkpoint directory, across jobs.

Two jobs saving into one directory would compute the same next generation, delete each
other's staging data and fail with low-level ENOENT/EEXIST errors (or worse, publish a mix).
Rank 0 of a saving job holds ``PATH/.fsdp2-save.lock`` from preparing the save until its
commit finished or failed. The file is created with ``O_CREAT | O_EXCL`` (atomic, NFS
included) and says who holds it: host, pid, the process's start time and a random token.

A saver killed mid-save leaves its lock behind, so a lock is *stale*, and taken over, when:

- it was taken on this host and that process is gone (pid not running, a zombie, or a pid
  reused by a process that started at another time); or
- it was taken on another host and its holder stopped refreshing it: while a save is in
  progress (an async save until ``wait()``) a heartbeat thread touches the file every
  ``LEASE_S / 4`` seconds, and a lock untouched for ``LEASE_S`` is stale (this assumes the
  hosts' clocks agree to well within ``LEASE_S``, as NTP keeps them).

Only the holder's token releases a lock, so a job never deletes a lock it does not hold.
The lock is read like any untrusted file (never followed through a symlink, never a FIFO or a
device, at most ``_MAX_RECORD`` bytes): anything but a regular file there is refused with a
message saying what it is, since fsdp2 did not put it there.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass

from .errors import CheckpointError
from .paths import open_regular, read_text

LOCK_NAME = ".fsdp2-save.lock"
LEASE_S = 120.0
_MAX_RECORD = 64 << 10  # a record is ~150 bytes; a bigger file is garbage, not something to read whole


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]  # state, ..., starttime (field 22)


def _process_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, run by someone else
    except OSError:
        return False
    if os.path.exists("/proc/self/stat"):
        now = _process_start(pid)
        return now is not None and (start is None or now == start)
    return True


class SaveLock:
    """The lock of one save; ``acquire`` then ``release`` (rank 0 of the saving job only)."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_NAME)
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock (taking over a stale one) or raise ``CheckpointError`` naming the holder."""
        pid = os.getpid()
        record = {
            "host": socket.gethostname(),
            "pid": pid,
            "start": _process_start(pid),
            "token": self.token,
            "since": time.time(),
        }
        for _ in range(2):  # a second try after removing a stale lock
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and not holder.is_stale():
                    raise CheckpointError(holder.held_message(self.path)) from None
                if holder is not None and self._holder() == holder:  # unchanged since we judged it
                    _remove(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            self._heartbeat = threading.Thread(target=self._beat, name="fsdp2-checkpoint-lock", daemon=True)
            self._heartbeat.start()
            return
        raise CheckpointError(
            f"{self.path}: another job took the save lock at the same moment; "
            "is a second job saving into this directory?"
        )

    def release(self) -> None:
        """Stop the heartbeat and delete the lock file if it is still ours."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        try:
            holder = self._holder()
        except CheckpointError:
            return  # replaced by something that is not a lock: not ours to delete
        if holder is not None and holder.record.get("token") == self.token:
            _remove(self.path)

    def _beat(self) -> None:
        while not self._stop.wait(LEASE_S / 4):
            try:
                os.utime(self.path, follow_symlinks=False)
            except OSError:
                pass  # a vanished lock is reported by the next acquire of whoever took it

    def _holder(self) -> "_Holder | None":
        """Who holds the lock now; None if nobody. ``CheckpointError`` if it is not a regular file."""
        fix = (
            f"fsdp2 did not make it and nothing was changed. If no save into {os.path.dirname(self.path)} "
            "is running, delete it and save again"
        )
        try:
            fd, st = open_regular(self.path, fix, follow_links=False)
        except FileNotFoundError:
            return None
        try:
            text = read_text(fd, self.path, fix, limit=_MAX_RECORD)
            record = json.loads(text)
        except (ValueError, CheckpointError):
            record = None  # being written right now, or garbage
        finally:
            os.close(fd)
        return _Holder(record if isinstance(record, dict) else {}, st.st_mtime)


@dataclass(frozen=True)
class _Holder:
    record: dict
    mtime: float

    def is_stale(self) -> bool:
        pid = self.record.get("pid")
        if self.record.get("host") == socket.gethostname() and isinstance(pid, int):
            return not _process_alive(pid, self.record.get("start"))
        return time.time() - self.mtime > LEASE_S

    def held_message(self, lock_path: str) -> str:
        who = (
            f"pid {self.record.get('pid')} on host {self.record.get('host')}"
            if self.record
            else "a process that left an unreadable lock file"
        )
        return (
            f"another save into {os.path.dirname(lock_path)} is in progress ({who}, lock refreshed "
            f"{time.time() - self.mtime:.0f} s ago): two jobs cannot save into one checkpoint directory. "
            f"Save into another directory; if no such job is running, delete {lock_path} (a lock from "
            f"another host also expires {LEASE_S:.0f} s after its holder stopped)"
        )


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
