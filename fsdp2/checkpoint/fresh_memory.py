"""Fresh buffers that a load fills before it may modify anything, made cheap to fault.

A load reads every value into new tensors, checks them and only then, once every rank agrees,
copies or swaps them in (failure safety, ``reader.py``). The first write to each 4 KiB page of
new memory is a page fault that also zeroes the page; in a VM that costs more than the copy from
the page cache itself (``bench_checkpoint.py --first-touch``: 2.3 GiB/s into fresh memory,
17 GiB/s into touched memory, 12 GiB/s into fresh memory advised as huge pages). So on Linux,
when transparent huge pages are in ``madvise`` mode, :func:`empty` asks for them on the part of
each buffer that can hold them: its interior aligned to huge pages (2 MiB on x86-64). Its ends
share pages with other allocations, so they stay as they are; a buffer with no whole huge page
inside is not advised.
The memory is still allocated by torch (memory meters and estimates see it); only the kernel's
choice of page size changes, never a value.

Not advised: in THP mode ``always`` (the kernel already uses huge pages, and advice would add
direct compaction under ``defrag=madvise``), ``never``, without THP, off Linux, or with
``FSDP2_LOAD_HUGEPAGES=0``: the opt-out for hosts where a huge page's first touch stalls longer
than the faults it saves (direct compaction of fragmented memory; on VMs that hand free memory
back to their host, the host's fault: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

from .errors import CheckpointError

ENV = "FSDP2_LOAD_HUGEPAGES"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
THP_PMD_SIZE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
MADV_HUGEPAGE = 14  # Linux uapi value (mmap.MADV_HUGEPAGE where Python exposes it)


def _pmd_size() -> int:
    """The kernel's transparent huge page size: 2 MiB on x86-64 and 4 KiB-page arm64, more with larger base pages."""
    try:
        with open(THP_PMD_SIZE) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE = _pmd_size()


def wanted() -> bool:
    """``FSDP2_LOAD_HUGEPAGES``: unset or 1: advise when the kernel's mode calls for it; 0: never."""
    setting = os.environ.get(ENV, "").strip().lower()
    if setting in ("", "1", "true", "yes", "on"):
        return True
    if setting in ("0", "false", "no", "off"):
        return False
    raise CheckpointError(
        f"{ENV}={os.environ[ENV]!r}: use 1 (advise load buffers as transparent huge pages, the default) or 0 (never)"
    )


def thp_mode() -> str | None:
    """The selected transparent-huge-page mode (``always``, ``madvise``, ``never``), or None without THP."""
    try:
        with open(THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def aligned_interior(address: int, nbytes: int) -> tuple[int, int] | None:
    """``(start, length)`` of the whole huge pages inside ``[address, address + nbytes)``, or None if none fits."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return (start, end - start) if end > start else None


@functools.cache
def _libc_madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _madvise_hugepage(start: int, length: int) -> None:
    # Advice only: a kernel that refuses it (EINVAL without THP support) leaves 4 KiB pages.
    _libc_madvise()(start, length, MADV_HUGEPAGE)


@functools.cache
def _kernel_wants_advice() -> bool:
    return sys.platform.startswith("linux") and thp_mode() == "madvise"


def advise(buffer: torch.Tensor) -> bool:
    """Advise the aligned interior of ``buffer``'s (untouched) memory as huge pages; whether it did."""
    if buffer.device.type != "cpu" or not _kernel_wants_advice() or not wanted():
        return False
    interior = aligned_interior(buffer.data_ptr(), buffer.numel() * buffer.element_size())
    if interior is None:
        return False
    _madvise_hugepage(*interior)
    return True


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor for a load to fill, its whole huge pages advised before anything touches them."""
    buffer = torch.empty(shape, dtype=dtype)
    advise(buffer)
    return buffer
