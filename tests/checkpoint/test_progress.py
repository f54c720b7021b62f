"""Progress of checkpoint work: shown on a terminal (or when asked), silent in pipes, logs and tests.

Each case runs save, load, verify, consolidate and load_hf in a fresh process whose stderr is a
pseudo-terminal or a pipe, and looks for each operation's bar (its name and a byte rate).
"""

import os
import pty
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from fsdp2.tools.progress import ENV, ByteProgress, wanted

ROOT = str(Path(__file__).resolve().parents[2])
OPERATIONS = ("save", "load", "verify", "consolidate", "load_hf")

SCRIPT = """
import sys, torch
from fsdp2.checkpoint import load, load_hf, save, verify_checkpoint
from fsdp2.checkpoint.consolidate import consolidate

d = sys.argv[1]
model = torch.nn.Linear(256, 256)
save(d + "/ckpt", model)
load(d + "/ckpt", model)
assert verify_checkpoint(d + "/ckpt") == []
consolidate(d + "/ckpt", d + "/hf")
load_hf(d + "/hf", model)
print("done")
"""


def _run(tmp_path: Path, stderr_is_terminal: bool, setting: str | None = None) -> str:
    """stderr of the script, read from the terminal's master side or from a pipe."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "120"
    if setting is not None:
        env[ENV] = setting
    argv = [sys.executable, "-c", SCRIPT, str(tmp_path)]
    if not stderr_is_terminal:
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and "done" in result.stdout, result.stderr
        return result.stderr
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:  # read while it runs, so a full terminal buffer cannot block the child
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child side closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        result = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=slave, text=True, timeout=120)
    finally:
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    err = b"".join(chunks).decode(errors="replace")
    assert result.returncode == 0 and "done" in result.stdout, err
    return err


def _bars(err: str) -> dict[str, bool]:
    lines = err.replace("\r", "\n").splitlines()
    return {
        op: any(line.startswith(f"{op} ") and "B/s" in line and "100%" in line for line in lines) for op in OPERATIONS
    }


@pytest.mark.slow  # a subprocess on a pseudo-terminal
def test_progress_appears_on_a_terminal(tmp_path):
    bars = _bars(_run(tmp_path, stderr_is_terminal=True))
    assert all(bars.values()), bars


@pytest.mark.slow  # a subprocess on a pseudo-terminal
def test_progress_is_silent_when_stderr_is_not_a_terminal(tmp_path):
    err = _run(tmp_path, stderr_is_terminal=False)
    assert not any(_bars(err).values()) and "B/s" not in err, err


@pytest.mark.slow  # a subprocess on a pseudo-terminal
def test_progress_when_asked_and_never_when_refused(tmp_path):
    err = _run(tmp_path / "asked", stderr_is_terminal=False, setting="1")
    assert all(_bars(err).values()), err
    err = _run(tmp_path / "refused", stderr_is_terminal=True, setting="0")
    assert "B/s" not in err, err


def test_bad_setting_warns_once_and_is_ignored(monkeypatch):
    monkeypatch.setenv(ENV, "loud")
    with pytest.warns(RuntimeWarning, match=f"{ENV}='loud' is not a setting, so it is ignored: use 1") as caught:
        assert wanted() is False  # as if unset: pytest's stderr is not a terminal
        assert wanted() is False
    assert len(caught) == 1


class _BrokenPipe:
    """A stderr whose reader went away: every write (after the first ``good_writes``) raises EPIPE."""

    def __init__(self, good_writes: int = 0):
        self.good_writes = good_writes

    def write(self, text: str) -> int:
        if self.good_writes <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.good_writes -= 1
        return len(text)

    def flush(self) -> None:
        if self.good_writes <= 0:
            raise BrokenPipeError(32, "Broken pipe")

    def isatty(self) -> bool:
        return False


@pytest.mark.parametrize(
    "trigger", ["unknown-setting", "stderr-is-none", "broken-pipe", "pipe-breaks-after-the-first-bar"]
)
def test_progress_that_cannot_be_shown_never_fails_a_save(tmp_path, monkeypatch, trigger):
    """Progress output failing on rank 0 alone used to raise out of save after the lock was taken:
    the lock and gen-N.partial stayed, and every later save to the path was refused."""
    import fsdp2.checkpoint as ck
    from fsdp2.checkpoint.lock import LOCK_NAME
    from tests.checkpoint.ckpt_helpers import assert_same_state, full_state, make_model

    monkeypatch.setenv(ENV, "maybe" if trigger == "unknown-setting" else "1")
    if trigger == "stderr-is-none":
        monkeypatch.setattr(sys, "stderr", None)
    elif trigger != "unknown-setting":
        monkeypatch.setattr(sys, "stderr", _BrokenPipe(good_writes=0 if trigger == "broken-pipe" else 2))
    path = tmp_path / "c"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the unknown setting's one warning
        ck.save(str(path), make_model(0))
        assert sorted(os.listdir(path)) == ["gen-000001", "manifest.json"]  # no lock, no .partial left
        ck.save(str(path), make_model(1))
    assert sorted(os.listdir(path)) == ["gen-000002", "manifest.json"] and not (path / LOCK_NAME).exists()
    target = make_model(5)
    ck.load(str(path), target)
    assert_same_state(full_state(target), full_state(make_model(1)))


@pytest.mark.parametrize("good_writes", [0, 1, 2], ids=["fails-at-once", "fails-on-first-flush", "fails-mid-way"])
def test_unwritable_stream_silences_the_bar(monkeypatch, good_writes):
    monkeypatch.setattr(sys, "stderr", _BrokenPipe(good_writes))
    with ByteProgress("save", "x", 100, show=True) as progress:
        progress.advance(10)
        time.sleep(0.6)  # past tqdm's 0.5 s between redraws
        progress.advance(10)
        assert not progress.shown  # dropped as soon as the stream failed
        progress.advance(80)
    monkeypatch.setattr(sys, "stderr", None)
    with ByteProgress("save", "x", 100, show=True) as progress:
        assert not progress.shown
        progress.advance(100)


def test_silent_progress_counts_nothing_and_writes_nothing(capsys):
    with ByteProgress("save", "x", 100) as progress:  # pytest's stderr is not a terminal
        progress.advance(60)
        progress.advance_to(100)
    assert not progress.shown and capsys.readouterr().err == ""


def _wanted_when_asked(rank: int, world_size: int) -> bool:
    os.environ[ENV] = "1"
    try:
        return wanted()
    finally:
        del os.environ[ENV]


def test_only_rank_zero_shows_progress(worlds):
    assert worlds.run(2, _wanted_when_asked) == [True, False]
