"""The inspect / verify / consolidate command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import fsdp2.checkpoint as ck
from fsdp2.checkpoint import cli
from tests.checkpoint.ckpt_helpers import full_state, make_model, mesh_1d, shard


def _save_sharded(rank, ws, path):
    model = shard(make_model(0), mesh_1d(ws))
    opt = torch.optim.AdamW(model.parameters())
    ck.save(path, model, opt, extra={"step": 3})
    state = full_state(model)
    return state if rank == 0 else None


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "c")
    return path, worlds.run(3, _save_sharded, path)[0]


def test_inspect_lists_tensors_and_chunks(saved, capsys):
    path, _ = saved
    assert cli.main(["inspect", path, "--chunks"]) == 0
    out = capsys.readouterr().out
    assert "saved by 3 rank(s)" in out
    assert "model/2.weight  float32[5, 7]  140 B  mesh [3] S(0)  3 chunk(s)" in out
    assert "gen-000001/rank-00002.safetensors[model/2.weight] offsets=[4, 0] shape=[1, 7]" in out
    assert "optimizer: 1 param group(s)" in out and '"step": 3' in out


def test_verify_ok_then_detects_corruption(saved, tmp_path, capsys):
    path, _ = saved
    assert cli.main(["verify", path]) == 0
    assert capsys.readouterr().out.strip().endswith("OK")
    broken = tmp_path / "broken"
    ck.save(str(broken), make_model(1))
    data = next((broken / "gen-000001").glob("*.safetensors"))
    with open(data, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"xyz")
    assert cli.main(["verify", str(broken)]) == 1
    assert "(corrupted)" in capsys.readouterr().out
    os.remove(broken / "manifest.json")
    assert cli.main(["verify", str(broken)]) == 1


def test_verify_detects_a_file_that_disagrees_with_the_layout(tmp_path, capsys):
    path = str(tmp_path / "c")
    ck.save(path, make_model(0))
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["tensors"]["model/0.weight"]["shape"] = [8, 16]
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    assert cli.main(["verify", path]) == 1
    assert "key 'model/0.weight': file holds F32[7, 16], manifest says float32[8, 16]" in capsys.readouterr().out


def test_consolidate_writes_hf_layout_with_full_tensors(saved, tmp_path):
    path, reference = saved
    out = tmp_path / "hf"
    assert cli.main(["consolidate", path, str(out), "--max-shard-size", "600B"]) == 0
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded = {}
    for name in files:
        loaded.update(load_file(out / name))
    assert loaded.keys() == reference.keys() == index["weight_map"].keys()
    for k, v in reference.items():
        assert torch.equal(loaded[k], v), k
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in reference.values())


@pytest.mark.slow  # a fresh interpreter that imports torch
def test_module_entry_point_runs_as_subprocess(saved, tmp_path):
    path, reference = saved
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(ck.__file__))}
    result = subprocess.run(
        [sys.executable, "-m", "fsdp2.checkpoint", "consolidate", path, str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "wrote 6 tensors" in result.stdout
    loaded = load_file(tmp_path / "o" / "model-00001-of-00001.safetensors")
    assert torch.equal(loaded["0.weight"], reference["0.weight"])


def test_parse_size():
    assert cli.parse_size("2GB") == 2 * 10**9 and cli.parse_size("1GiB") == 2**30
    assert cli.parse_size("123") == 123
    with pytest.raises(Exception):
        cli.parse_size("lots")


def _tree(root) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, n), root): open(os.path.join(d, n), "rb").read()
        for d, _, names in os.walk(root)
        for n in names
    }


@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "overwrite"])
def test_consolidate_onto_a_full_disk_leaves_the_destination_as_it_was(tmp_path, monkeypatch, capsys, existing):
    """The disk fills while the 4th of 6 files is written: one error line, no half export in OUT
    (the old one intact with --overwrite), no temporary folder left, and a retry succeeds."""
    import errno

    from fsdp2.checkpoint import consolidate as consolidate_module

    path, out = str(tmp_path / "c"), tmp_path / "hf"
    ck.save(path, make_model(0))
    if existing:
        assert cli.main(["consolidate", path, str(out), "--max-shard-size", "1B"]) == 0
        ck.save(path, make_model(1))
    capsys.readouterr()
    before = _tree(tmp_path)
    real_writer, opened = consolidate_module.SafetensorsStreamWriter, []

    class FillsTheDisk(real_writer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(self)

        def _write(self, data):
            if len(opened) == 4 and self.size > 0:  # the header fits, then the disk is full
                raise OSError(errno.ENOSPC, "No space left on device")
            return super()._write(data)

    monkeypatch.setattr(consolidate_module, "SafetensorsStreamWriter", FillsTheDisk)
    argv = ["consolidate", path, str(out), "--max-shard-size", "1B", *(["--overwrite"] if existing else [])]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "No space left on device" in err[0], err
    assert len(opened) == 4 and _tree(tmp_path) == before  # OUT untouched
    assert sorted(os.listdir(tmp_path)) == (["c", "hf"] if existing else ["c"])  # no temporary folder left

    monkeypatch.setattr(consolidate_module, "SafetensorsStreamWriter", real_writer)
    if existing:  # the previous export is still whole: replacing it still takes --overwrite
        assert cli.main(argv[:-1]) == 2 and "already holds weight files" in capsys.readouterr().err
    assert cli.main(argv) == 0
    with open(out / "model.safetensors.index.json") as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    assert sorted(os.listdir(out)) == sorted([*files, "model.safetensors.index.json"]) and len(files) == 6
    loaded = {}
    for name in files:
        loaded.update(load_file(out / name))
    reference = full_state(make_model(1 if existing else 0))
    assert loaded.keys() == reference.keys() and all(torch.equal(loaded[k], v) for k, v in reference.items())
