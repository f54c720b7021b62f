"""Python's cyclic garbage collector kept from running inside a load (and a save, an async save's
call and ``wait()``, a verify: the same kind of work, measured below for the load).

A load allocates thousands of short-lived container objects (plan entries, read tasks, buffer
views, decoded state) that die by reference counting when it returns. With automatic
collection on, they cross the young generations' thresholds dozens of times per load, survivors
are promoted, and every few loads that tips a *full* collection, which walks every object of
the process (~300k in a process that imported torch: 0.14-0.18 s on the 2-core CI machine,
as long as the whole read of a 1.5 GB rank). In a multi-rank
load the other ranks wait for it at the all-ranks agreement. Paused, the load's objects are
freed before any collection sees them: at most one young collection follows, as collection
resumes, and it finds only what the load returned.

Only automatic collection is paused, only if it was on, and it is switched back on however the
load ends; ``gc.collect()`` still works. The switch is process-wide: a thread that allocates
reference cycles during a load has them collected after it.
"""

from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_holders = 0  # calls inside paused() that found automatic collection on, across threads


@contextlib.contextmanager
def paused():
    """Run the body with automatic garbage collection off (if it was on), restoring it on exit."""
    global _holders
    with _lock:
        holding = _holders > 0 or gc.isenabled()
        if holding:
            _holders += 1
            gc.disable()
    try:
        yield
    finally:
        if holding:
            with _lock:
                _holders -= 1
                if _holders == 0:
                    gc.enable()
