"""Load buffers advised as transparent huge pages (``fsdp2/checkpoint/fresh_memory.py``).

The advice must reach only the whole 2 MiB pages inside large fresh buffers, follow the kernel's
THP mode and the ``FSDP2_LOAD_HUGEPAGES`` opt-out, and never change a loaded value. The kernel is
faked where a test is about fsdp2's decisions, so these pass with THP disabled or absent; one test
checks the real kernel's record of the advice, where it is in ``madvise`` mode.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import fsdp2.checkpoint as ck
from fsdp2.checkpoint import fresh_memory
from fsdp2.checkpoint.fresh_memory import aligned_interior
from tests.checkpoint.ckpt_helpers import assert_same_state, full_optim_state, full_state, load_outcome

MiB = 1 << 20


@pytest.fixture
def advice(monkeypatch) -> list[tuple[int, int]]:
    """The (start, length) of every madvise(MADV_HUGEPAGE) fsdp2 makes, with the kernel faked to want them."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(fresh_memory, "HUGE_PAGE", 2 * MiB)  # as on x86-64, whatever this kernel's size
    monkeypatch.setattr(fresh_memory, "_kernel_wants_advice", lambda: True)
    monkeypatch.setattr(fresh_memory, "_madvise_hugepage", lambda start, length: calls.append((start, length)))
    monkeypatch.delenv(fresh_memory.ENV, raising=False)
    return calls


def _big_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(1024, 1280), nn.Linear(1280, 8))  # 5 MiB weight: 2+ whole huge pages
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    return model, opt


def test_aligned_interior_is_the_whole_huge_pages_inside(advice):
    H = fresh_memory.HUGE_PAGE
    assert aligned_interior(0, 2 * H) == (0, 2 * H)
    assert aligned_interior(64, 2 * H) == (H, H)  # the first partial page and the tail stay
    assert aligned_interior(H + 64, 3 * MiB) is None  # [2 MiB + 64, 5 MiB + 64) holds no whole page
    assert aligned_interior(H - 4096, H + 8192) == (H, H)
    assert aligned_interior(64, H - 64) is None
    assert aligned_interior(4096, 100) is None


@pytest.mark.parametrize("nbytes", [1, 4096, MiB, 2 * MiB - 1, 3 * MiB, 16 * MiB, 40 * MiB + 123])
def test_only_whole_huge_pages_inside_a_buffer_are_advised(advice, nbytes):
    buffer = fresh_memory.empty((nbytes,), torch.uint8)
    start, end = buffer.data_ptr(), buffer.data_ptr() + nbytes
    interior = aligned_interior(start, nbytes)
    assert advice == ([] if interior is None else [interior])
    for a, n in advice:
        assert a % (2 * MiB) == 0 and n % (2 * MiB) == 0 and start <= a and a + n <= end
    if nbytes >= 16 * MiB:  # large buffers: all but at most one partial page at each end
        assert sum(n for _, n in advice) >= nbytes - 4 * MiB
    assert buffer.shape == (nbytes,) and buffer.dtype == torch.uint8


def test_buffers_smaller_than_a_huge_page_are_never_advised(advice):
    for shape, dtype in [
        ((255, 1024), torch.float64),
        ((1,), torch.float32),
        ((), torch.int64),
        ((0, 4), torch.bfloat16),
    ]:
        fresh_memory.empty(shape, dtype)
    assert advice == []


def test_opt_out_and_bad_setting(advice, monkeypatch):
    for off in ("0", "false", "off", " NO "):
        monkeypatch.setenv(fresh_memory.ENV, off)
        fresh_memory.empty((8 * MiB,), torch.uint8)
    assert advice == []
    monkeypatch.setenv(fresh_memory.ENV, "1")
    fresh_memory.empty((8 * MiB,), torch.uint8)
    assert len(advice) == 1
    monkeypatch.setenv(fresh_memory.ENV, "sometimes")
    with pytest.raises(ck.CheckpointError, match="FSDP2_LOAD_HUGEPAGES='sometimes': use 1 .* or 0"):
        fresh_memory.empty((8 * MiB,), torch.uint8)


def test_a_bad_setting_fails_the_load_and_changes_nothing(tmp_path, monkeypatch):
    source, _ = _big_model(0)
    ck.save(tmp_path / "c", source)
    target, _ = _big_model(1)
    monkeypatch.setenv(fresh_memory.ENV, "maybe")
    outcome, unchanged = load_outcome(str(tmp_path / "c"), target)
    assert "FSDP2_LOAD_HUGEPAGES='maybe'" in outcome and unchanged


@pytest.mark.parametrize(
    "text, mode",
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
        ("garbled\n", None),
    ],
)
def test_advice_follows_the_kernel_mode(tmp_path, monkeypatch, text, mode):
    (tmp_path / "enabled").write_text(text)
    monkeypatch.setattr(fresh_memory, "THP_ENABLED", str(tmp_path / "enabled"))
    assert fresh_memory.thp_mode() == mode
    # Only "madvise" mode needs advice: "always" gives huge pages unasked (advice would only add
    # direct compaction), "never" and no THP give none.
    assert fresh_memory._kernel_wants_advice.__wrapped__() == (mode == "madvise" and sys.platform.startswith("linux"))


def test_no_transparent_huge_pages_at_all(tmp_path, monkeypatch):
    monkeypatch.setattr(fresh_memory, "THP_ENABLED", str(tmp_path / "absent"))
    assert fresh_memory.thp_mode() is None
    assert not fresh_memory._kernel_wants_advice.__wrapped__()


def test_huge_page_size_is_the_kernels(tmp_path, monkeypatch):
    (tmp_path / "size").write_text("33554432\n")  # arm64 with 16 KiB base pages
    monkeypatch.setattr(fresh_memory, "THP_PMD_SIZE", str(tmp_path / "size"))
    assert fresh_memory._pmd_size() == 32 * MiB
    monkeypatch.setattr(fresh_memory, "THP_PMD_SIZE", str(tmp_path / "absent"))
    assert fresh_memory._pmd_size() == 2 * MiB


def test_load_advises_its_large_buffers_and_values_are_bitwise_equal(tmp_path, monkeypatch, advice):
    source, source_opt = _big_model(0)
    ck.save(tmp_path / "c", source, source_opt)
    loaded = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(fresh_memory.ENV, setting)
        advice.clear()
        target, target_opt = _big_model(1)
        ck.load(tmp_path / "c", target, target_opt)
        loaded[setting] = (full_state(target), full_optim_state(target, target_opt), list(advice))
    weight, exp_avg, exp_avg_sq = 3 * [1280 * 1024 * 4]
    assert len(loaded["1"][2]) == 3 and all(n >= weight - 4 * MiB for _, n in loaded["1"][2])
    assert loaded["0"][2] == []
    for state, optim_state, _ in loaded.values():
        assert_same_state(state, full_state(source))
        assert_same_state(optim_state, full_optim_state(source, source_opt))


def test_load_hf_advises_its_large_buffers(tmp_path, advice):
    source, _ = _big_model(0)
    save_file(source.state_dict(), str(tmp_path / "model.safetensors"))
    target, _ = _big_model(1)
    ck.load_hf(tmp_path, target)
    assert len(advice) == 1  # the 5 MiB weight; the bias and the small layer are not advised
    assert_same_state(full_state(target), full_state(source))


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address`` in this process."""
    flags, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    assert flags is not None, f"no mapping holds {address:#x}"
    return flags


def _kernel_records_the_advice_on_the_interior_only() -> None:
    """Run in a fresh process (below): in this one, memory that earlier tests' loads advised and
    freed may be handed out again with the advice still on its mapping."""
    import os

    os.environ.pop(fresh_memory.ENV, None)
    buffer = fresh_memory.empty((12 * MiB + 4096,), torch.uint8)
    start, length = aligned_interior(buffer.data_ptr(), buffer.numel())
    assert "hg" in _vm_flags(start) and "hg" in _vm_flags(start + length - 1)
    if buffer.data_ptr() < start:  # the partial page at the head shares its mapping with other memory
        assert "hg" not in _vm_flags(buffer.data_ptr())
    os.environ[fresh_memory.ENV] = "0"
    plain = fresh_memory.empty((12 * MiB + 4096,), torch.uint8)
    start, _ = aligned_interior(plain.data_ptr(), plain.numel())
    assert "hg" not in _vm_flags(start)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or fresh_memory.thp_mode() != "madvise" or fresh_memory.HUGE_PAGE > 2 * MiB,
    reason="needs Linux with 2 MiB transparent huge pages in madvise mode",
)
def test_the_kernel_records_the_advice_on_the_interior_only():
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (
        "from tests.checkpoint.test_checkpoint_fresh_memory import "
        "_kernel_records_the_advice_on_the_interior_only as check; "
        "check()"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
