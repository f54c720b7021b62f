"""fsdp2.tools.memory_meter.PeakMemory: the CPU peak is exact, storage resizes included."""

import pytest
import torch

from fsdp2.tools.memory_meter import PeakMemory

MiB = 2**20


def test_cpu_peak_of_known_allocations_and_frees():
    with PeakMemory("cpu") as meter:
        a = torch.empty(3 * MiB, dtype=torch.uint8)
        b = torch.empty(MiB // 4, dtype=torch.float32)  # 1 MiB: 4 MiB live
        del a  # 1 MiB live
        c = torch.empty(2 * MiB, dtype=torch.uint8)  # 3 MiB live
        del b, c
    assert meter.peak_bytes == 4 * MiB
    assert meter.net_bytes == 0


def test_cpu_peak_sees_storage_resize():
    # fsdp2 frees and re-allocates unsharded parameters with untyped_storage().resize_(),
    # which does not go through the dispatcher.
    t = torch.empty(MiB, dtype=torch.uint8)
    storage = t.untyped_storage()
    storage.resize_(0)
    with PeakMemory("cpu") as meter:
        storage.resize_(5 * MiB)
        extra = torch.empty(2 * MiB, dtype=torch.uint8)  # 7 MiB live
        del extra
        storage.resize_(0)
        storage.resize_(MiB)
    assert meter.peak_bytes == 7 * MiB
    assert meter.net_bytes == MiB
    assert max(total for _, total in meter.timeline) == 7 * MiB


def test_cpu_peak_is_relative_to_entry_and_covers_autograd():
    held = torch.empty(8 * MiB, dtype=torch.uint8)  # before entry: not part of the peak
    w = torch.zeros(256, 256, requires_grad=True)
    x = torch.zeros(64, 256)
    with PeakMemory("cpu") as meter:
        (x @ w).sum().backward()
    # The output (64x256 fp32) and w.grad (256x256 fp32) must both have been counted.
    assert meter.peak_bytes >= 64 * 256 * 4 + 256 * 256 * 4
    assert meter.net_bytes >= 256 * 256 * 4  # w.grad stays
    assert meter.peak_bytes < 8 * MiB
    del held


def test_meters_do_not_nest_and_devices_are_checked():
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        PeakMemory("meta")
    with PeakMemory("cpu"):
        with pytest.raises(RuntimeError, match="cannot nest"):
            with PeakMemory("cpu"):
                pass
    with PeakMemory("cpu") as meter:  # usable again after the failed nesting
        x = torch.empty(MiB, dtype=torch.uint8)
    assert meter.peak_bytes == MiB
    del x
