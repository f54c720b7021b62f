"""Kernel scratch: bytes an op allocates through PyTorch's allocator only while it runs.

A meta dry run (fsdp2/tools/meta_step.py) sees every op's outputs, but not the workspace its
real kernel allocates and frees inside: oneDNN's reorders around a bfloat16 matmul, the CPU
flash-attention backward's per-thread buffers, a CUDA kernel's temporaries. Which kernel runs,
and so how much scratch it takes, depends on the machine: oneDNN takes CPU bfloat16 matmuls
only where the CPU has AVX-512 (BF16) or AMX, attention buffers grow with the thread count, and
a GPU has kernels of its own. So scratch is measured, never assumed: each distinct op of the dry
run (the op, its arguments' shapes, strides and dtypes, its other arguments) runs once on the
real device, on zero-filled inputs, under :class:`fsdp2.tools.memory_meter.PeakMemory`; its
scratch is its peak minus the bytes of the outputs it returns. Results are kept per process,
keyed by the settings that pick kernels (thread count, oneDNN and cuDNN switches, ...).

Measured with the process's current thread count and on the given device: a prediction made
this way holds for a training process on the same machine with the same thread count.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from fsdp2.compat import tree_flatten, tree_map
from fsdp2.tools.memory_meter import PeakMemory

# (device, settings that pick kernels, op, argument signature) -> scratch bytes, for every op
# measured in this process.
_MEASURED: dict[tuple, int] = {}


def _kernel_settings() -> tuple:
    """The process settings that change which kernel an op runs (and so its scratch)."""
    return (
        torch.get_num_threads(),
        torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled,
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.enabled,
        torch.backends.cudnn.allow_tf32,
    )


class KernelScratch:
    """Measures, on ``device``, the scratch of the ops a meta dry run dispatches."""

    def __init__(self, device: torch.device | str):
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:  # torch's own message lists every device type it knows
            raise ValueError(f"kernel scratch: {device!r} is not a device ({e}); use e.g. 'cpu' or 'cuda'") from None
        if self.device.type == "meta":
            raise ValueError("kernel scratch is measured on a real device (e.g. 'cpu' or 'cuda'), not 'meta'")
        try:
            torch.empty(0, device=self.device)
        except (RuntimeError, AssertionError) as e:
            raise ValueError(
                f"kernel scratch: device {str(self.device)!r} is not usable on this machine ({e}); "
                "measure on a device this machine has, or leave kernel_scratch unset"
            ) from e

    def bytes_of(self, func, args: tuple, kwargs: dict) -> int:
        """Scratch bytes of ``func(*args, **kwargs)`` (meta arguments) on this device."""
        if func.is_view:
            return 0  # a view allocates nothing
        key = (self.device, _kernel_settings(), func, _signature(args, kwargs))
        if key not in _MEASURED:
            _MEASURED[key] = self._measure(func, args, kwargs)
        return _MEASURED[key]

    def _measure(self, func, args: tuple, kwargs: dict) -> int:
        real_args, real_kwargs = tree_map(self._materialize, (args, kwargs))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((real_args, real_kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        devices = [self.device] if self.device.type != "cpu" else []
        try:
            # Ops that draw random numbers must not move the caller's generator.
            with torch.random.fork_rng(devices=devices, device_type=self.device.type), PeakMemory(self.device) as meter:
                out = func(*real_args, **real_kwargs)
        except Exception as e:  # noqa: BLE001 - e.g. a data-dependent op that rejects zeros
            warnings.warn(
                f"kernel scratch: {func} could not run on {self.device} with zero-filled inputs "
                f"({type(e).__name__}: {e}); its scratch is not counted",
                stacklevel=2,
            )
            return 0
        outputs = {
            s.data_ptr(): s.nbytes()
            for s in (t.untyped_storage() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        }
        new_outputs = sum(n for ptr, n in outputs.items() if ptr not in inputs)
        return max(0, meter.peak_bytes - new_outputs)

    def _materialize(self, leaf: Any) -> Any:
        """A meta tensor as a zero-filled tensor of the same storage size, view and dtype on the device."""
        if isinstance(leaf, torch.Tensor):
            storage_elems = -(-leaf.untyped_storage().nbytes() // leaf.element_size())
            base = torch.zeros(storage_elems, dtype=leaf.dtype, device=self.device)
            return base.as_strided(leaf.shape, leaf.stride(), leaf.storage_offset())
        if isinstance(leaf, torch.device) and leaf.type == "meta":
            return self.device
        return leaf


def _signature(args: tuple, kwargs: dict) -> tuple:
    leaves, spec = tree_flatten((args, kwargs))
    described = tuple(
        (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype) if isinstance(x, torch.Tensor) else _hashable(x)
        for x in leaves
    )
    return str(spec), described


def _hashable(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)
