"""Exact peak of allocator bytes over a block of code, on CUDA and on CPU.

    with PeakMemory("cpu") as meter:
        loss = model(x).sum(); loss.backward(); opt.step()
    print(meter.peak_bytes)   # highest (allocated - allocated at entry) inside the block

CUDA: ``torch.cuda.reset_peak_memory_stats`` / ``max_memory_allocated`` (the caching allocator's
own counters; bytes handed to tensors, not reserved segments).

CPU: PyTorch's CPU allocator reports every allocation and free to the profiler when memory
profiling is on (``c10::ProfiledCPUMemoryReporter``); that includes storage resizes
(``untyped_storage().resize_()`` reallocates through the allocator without passing the
dispatcher, so a TorchDispatchMode alone would miss it). We run ``torch.profiler.profile``
with ``profile_memory=True`` over the block, read the ``[memory]`` events (signed byte
counts) from the raw kineto results, and take the highest running sum in time order.

Limits of the CPU measurement:
- a free of memory allocated *before* entry is not reported (the reporter does not know its
  size), so the measurement is an upper bound if the block frees older tensors; measure from
  a quiet point (e.g. after ``zero_grad(set_to_none=True)``), where this is exact;
- only allocations through PyTorch's CPU allocator count: oneDNN/BLAS scratch buffers and
  Python objects do not; nor do allocations on threads the profiler does not follow (other
  Python threads);
- the profiler records every op too, so the block runs slower (timing inside it is off);
- it is not reentrant (one profiler per process): nesting raises;
- torch 2.13's kineto prints two "USDT ... profiler_start/stop" lines to stderr per block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_MEMORY_EVENT = "[memory]"
_active = False  # one meter at a time per process (see PeakMemory.__enter__)


@dataclass
class PeakMemory:
    """Context manager measuring the allocation peak of its block, relative to entry."""

    device: torch.device | str = "cpu"
    peak_bytes: int = field(default=0, init=False)  # max over the block of (allocated - at entry)
    net_bytes: int = field(default=0, init=False)  # allocated at exit - at entry
    # CPU only: (ns, running bytes) after each allocation/free, for finding where the peak is.
    timeline: list[tuple[int, int]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"PeakMemory: device must be 'cpu' or 'cuda', got {str(self.device)!r}")
        self._profiler = None
        self._entry_bytes = 0

    def __enter__(self) -> "PeakMemory":
        global _active
        if _active:
            raise RuntimeError("PeakMemory: another PeakMemory is already measuring in this process; they cannot nest")
        _active = True
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                self._entry_bytes = torch.cuda.memory_allocated(self.device)
            else:
                self._profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
                )
                self._profiler.__enter__()
        except BaseException:
            _active = False
            raise
        return self

    def __exit__(self, *exc) -> None:
        global _active
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                self.peak_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._entry_bytes)
                self.net_bytes = torch.cuda.memory_allocated(self.device) - self._entry_bytes
            else:
                self._profiler.__exit__(*exc)
                self._fold(self._profiler.profiler.kineto_results.events())
                self._profiler = None
        finally:
            _active = False

    def _fold(self, events) -> None:
        """Running sum of the CPU allocator's signed byte counts, in time order."""
        deltas = sorted(
            (
                (e.start_ns(), e.nbytes())
                for e in events
                if e.name() == _MEMORY_EVENT and e.device_type() == torch.autograd.DeviceType.CPU
            ),
            key=lambda d: d[0],  # stable: same-timestamp events keep the order they were recorded in
        )
        running = peak = 0
        self.timeline = []
        for ns, nbytes in deltas:
            running += nbytes
            peak = max(peak, running)
            self.timeline.append((ns, running))
        self.peak_bytes, self.net_bytes = peak, running
