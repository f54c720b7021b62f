"""The documentation runs: every Python and shell snippet of README.md and docs/*.md, every link.

Each page's fenced blocks run in document order in one fresh working directory (``examples/`` and
``benchmarks/`` linked into it), so a later block may use what an earlier one wrote or defined:

- ```python blocks run on every rank of a 2-rank gloo world (the default process group is up, as
  under ``torchrun --nproc-per-node 2``), in one namespace per page on each rank;
- ```bash blocks run with ``bash -e -o pipefail`` in that directory, this venv's ``python`` and
  ``torchrun`` first on PATH;
- an HTML comment on the line right before a fence changes that, visibly, in the markdown:
  ``<!-- not run: REASON -->`` skips the block (REASON required),
  ``<!-- file: NAME -->`` writes the block to NAME in the working directory (a later bash block of
  the page must run it), ``<!-- run: own process -->`` runs a python block alone in a fresh
  ``python`` process (code that makes its own process group).

Every fence names its language, so no command hides in an untagged block. Relative links (and
their ``#anchors``, as GitHub makes them from headings) must resolve. No tracker numbers or
session diary in the repository's text.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import socket
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every snippet of the docs, some under torchrun

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "RESULTS.md"]
WORLD_SIZE = 2
BLOCK_TIMEOUT_S = 300
LINKED_INTO_WORKDIR = ("examples", "benchmarks")

FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*(.*?)\s*-->\s*$")
MARKER_KINDS = {"not run": "reason", "file": "name", "run": "own process"}


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the first code line
    lang: str
    code: str
    marker: str | None  # "not run", "file", "run" or None
    arg: str  # the marker's reason / file name / mode

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, each with the marker comment right before its fence."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: unclosed code fence"
        marker, arg = None, ""
        comment = MARKER.match(lines[i - 1]) if i > 0 else None
        if comment:
            kind, _, arg = comment.group(1).partition(":")
            marker, arg = kind.strip(), arg.strip()
        found.append(Block(page, i + 2, match.group(1), "\n".join(lines[i + 1 : end]) + "\n", marker, arg))
        i = end + 1
    return found


def runnable(block: Block) -> bool:
    return block.lang in ("python", "bash") and block.marker != "not run"


# ------------------------------------------------------------------ what runs on the ranks

_namespaces: dict[str, dict] = {}


def _run_python(rank: int, world_size: int, page: str, source: str, first_line: int, workdir: str) -> str:
    """Run one snippet on this rank in the page's namespace; its printed output, or raise with it."""
    namespace = _namespaces.setdefault(page, {"__name__": "__main__"})
    code = compile("\n" * (first_line - 1) + source, page, "exec")  # tracebacks give the page's line numbers
    out = io.StringIO()
    here = os.getcwd()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(out):
            exec(code, namespace)
    except BaseException:
        raise RuntimeError(f"{traceback.format_exc()}\n--- printed on rank {rank} ---\n{out.getvalue()}") from None
    finally:
        os.chdir(here)
    return out.getvalue()


def _end_page(rank: int, world_size: int, page: str) -> None:
    """Forget the page's namespace; leave the world as the next page expects it."""
    import gc

    import torch.distributed as dist

    import fsdp2

    _namespaces.pop(page, None)
    fsdp2.uninstall_as_torch_fsdp()
    gc.collect()
    dist.barrier()


@pytest.fixture(scope="module")
def world():
    """A 2-rank gloo world of this module's own (so that no snippet's state reaches other tests)."""
    from tests.harness import WorldPool

    pool = WorldPool()
    yield pool
    for ranks in pool._worlds.values():  # nothing to keep: do not wait for their orderly exit
        for proc in ranks._procs:
            proc.kill()
    pool.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        FSDP2_PROGRESS="0",
        MPLBACKEND="Agg",
        PET_MASTER_PORT=str(_free_port()),
    )  # torchrun's --master-port, so parallel runs do not collide
    return env


def _run_process(block: Block, cmd: list[str], workdir: Path) -> None:
    result = subprocess.run(cmd, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, (
        f"{block.where}: exit {result.returncode}\n{block.code}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_snippet_of_the_page_runs(page, world, tmp_path):
    for name in LINKED_INTO_WORKDIR:
        (tmp_path / name).symlink_to(ROOT / name)
    used_python = False
    try:
        for block in blocks(page):
            if block.marker == "file":
                (tmp_path / block.arg).write_text(block.code)
            elif not runnable(block):
                continue
            elif block.lang == "bash":
                _run_process(block, ["bash", "-e", "-o", "pipefail", "-c", block.code], tmp_path)
            elif block.marker == "run":
                script = tmp_path / f"snippet_{block.line}.py"
                script.write_text("\n" * (block.line - 1) + block.code)
                _run_process(block, [sys.executable, script.name], tmp_path)
            else:
                used_python = True
                world.run(
                    WORLD_SIZE,
                    _run_python,
                    str(page.relative_to(ROOT)),
                    block.code,
                    block.line,
                    str(tmp_path),
                    timeout=BLOCK_TIMEOUT_S,
                )
    finally:
        if used_python:
            world.run(WORLD_SIZE, _end_page, str(page.relative_to(ROOT)))


# ------------------------------------------------------------------ markers and fences


def test_markers_are_well_formed_and_say_why():
    not_run = []
    for page in PAGES:
        names_run = " ".join(b.code for b in blocks(page) if runnable(b))
        for block in blocks(page):
            assert block.lang, f"{block.where}: a fence without a language (python, bash, text, ...)"
            if block.marker is None:
                continue
            assert block.marker in MARKER_KINDS, (
                f"{block.where}: unknown marker {block.marker!r} (one of {sorted(MARKER_KINDS)})"
            )
            if block.marker == "not run":
                assert len(block.arg) >= 10, f"{block.where}: '<!-- not run: REASON -->' needs its reason"
                assert block.lang in ("python", "bash"), f"{block.where}: only python and bash blocks run"
                not_run.append(block)
            elif block.marker == "file":
                assert re.fullmatch(r"[\w.-]+", block.arg), f"{block.where}: file name {block.arg!r}"
                assert block.arg in names_run, f"{block.where}: no block of the page runs {block.arg}"
            else:
                assert block.arg == "own process" and block.lang == "python", (
                    f"{block.where}: '<!-- run: own process -->'"
                )
    # A few, each for a reason a test cannot meet here (setup from nothing, a cluster, a GPU, minutes).
    assert len(not_run) <= 20, "\n".join(f"{b.where}: {b.arg}" for b in not_run)


def test_readme_keeps_the_two_commands_and_the_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "bash examples/main.sh" in readme and "bash .ci/run" in readme
    assert "`python -m pytest tests` is the test command" in readme
    assert len(readme.splitlines()) <= 300


# ------------------------------------------------------------------ links

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _anchors(page: Path) -> set[str]:
    """The heading anchors GitHub makes: lowercased, punctuation dropped, spaces to hyphens, -N for repeats."""
    seen: dict[str, int] = {}
    anchors = set()
    in_fence = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        if in_fence or not re.match(r"#{1,6} ", line):
            continue
        text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", line.lstrip("#").strip())
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # not inside code blocks
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading makes #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


# ------------------------------------------------------------------ no tracker numbers

TRACKER = re.compile(r"issue [0-9]|stop [0-9]|#[0-9]{2,}", re.I)
UPSTREAM = re.compile(r"github\.com/[\w.-]+/[\w.-]+/(issues|pull)/[0-9]+")


def test_no_tracker_numbers_in_the_repository():
    """Text says why, not which ticket: no 'issue N', 'stop N' or '#NN' outside links to public upstream issues."""
    # CI's venvs (.venv/, .venv-newest/ for the newest torch) hold other projects' text: not walked.
    skip = {".git", ".venv", ".venv-newest", "node_modules", "build", "dist", ".hypothesis", ".pytest_cache"}
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if d not in skip and not d.endswith(".egg-info")]
        for path in (Path(folder, name) for name in files):
            if path.suffix in (".py", ".md", ".toml", ".sh"):
                found += _tracker_numbers_in(path)
    assert not found, "\n".join(found)


def _tracker_numbers_in(path: Path) -> list[str]:
    found = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if TRACKER.search(UPSTREAM.sub("", line)):
            found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    return found
