"""``load_hf``: Hugging Face safetensors checkpoints into sharded models, each rank reading its shards."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

import fsdp2.checkpoint as ck
from fsdp2.checkpoint import cli
from fsdp2.models import GPT, GPTConfig, Llama, LlamaConfig, tensor_parallel_plan
from tests.checkpoint.ckpt_helpers import (
    assert_same_state,
    exact_tree,
    full_state,
    isolated,
    make_model,
    mesh_1d,
    shard,
)

CFG = LlamaConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4, hidden_dim=48)


def _hf_name(fqn: str) -> str:
    return f"model.{fqn}"


def _our_name(name: str) -> str | None:
    return None if name.endswith(".rotary.inv_freq") else name.removeprefix("model.")


def write_hf(directory, tensors: dict[str, torch.Tensor], files: int = 2) -> None:
    """A Hugging Face style checkpoint: ``files`` shards and model.safetensors.index.json."""
    os.makedirs(directory, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(files):
        fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = names[i::files]
        save_file({n: tensors[n].contiguous() for n in part}, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def _reference() -> dict[str, torch.Tensor]:
    """The weights the HF checkpoint holds: a seed-1 Llama in bf16 (and one tensor to skip)."""
    torch.manual_seed(1)
    sd = {_hf_name(k): v.to(torch.bfloat16) for k, v in Llama(CFG).state_dict().items()}
    sd["model.blocks.0.attn.rotary.inv_freq"] = torch.ones(4)  # HF buffers a key_map drops
    return sd


def _expected_state() -> dict[str, torch.Tensor]:
    """What a float32 model holds after loading the bf16 checkpoint."""
    return {_our_name(k): v.float() for k, v in _reference().items() if _our_name(k) is not None}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("hf") / "llama")
    write_hf(directory, _reference())
    return directory


def _build(mesh_kind: str, ws: int, on_meta: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fsdp2 import fully_shard

    torch.manual_seed(2)
    with torch.device("meta") if on_meta else torch.device("cpu"):
        model = Llama(CFG)
    if mesh_kind == "1d":
        mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    elif mesh_kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        if mesh_kind == "tp":
            parallelize_module(block, mesh["tp"], tensor_parallel_plan())
        fully_shard(block, mesh=mesh["dp"] if mesh_kind == "tp" else mesh)
    fully_shard(model, mesh=mesh["dp"] if mesh_kind == "tp" else mesh)
    if on_meta:
        model.to_empty(device="cpu")
    return model


def _load_into(rank, ws, path, mesh_kind, on_meta, key_map_kind):
    model = _build(mesh_kind, ws, on_meta)
    if key_map_kind == "dict":
        key_map = {k: _our_name(k) for k in _reference()}  # a dict cannot drop: inv_freq maps to None...
        key_map = {k: v for k, v in key_map.items() if v is not None}
        keys = ck.load_hf(path, model, key_map=key_map, strict=False)
        assert keys.unexpected == ["model.blocks.0.attn.rotary.inv_freq"] and keys.missing == []
    else:
        ck.load_hf(path, model, key_map=_our_name, stats=(stats := ck.LoadStats()))
    state = full_state(model)
    placements = sorted({str(v.placements) for v in model.state_dict().values()})
    read = None if key_map_kind == "dict" else (stats.bytes_read, stats.bytes_owned)
    return state if rank == 0 else None, placements, read


@pytest.mark.parametrize(
    "mesh_kind,ws,on_meta,key_map_kind",
    [
        ("1d", 1, False, "fn"),
        ("1d", 2, True, "fn"),
        ("1d", 3, False, "dict"),
        ("hsdp", 4, False, "fn"),
        ("tp", 4, True, "fn"),
    ],
)
def test_load_hf_into_sharded_models(worlds, hf_dir, mesh_kind, ws, on_meta, key_map_kind):
    results = worlds.run(ws, _load_into, hf_dir, mesh_kind, on_meta, key_map_kind)
    assert_same_state(results[0][0], _expected_state())
    if mesh_kind == "hsdp":
        assert any("Replicate" in p for p in results[0][1])
    if mesh_kind == "tp":
        assert any("Shard(dim=1)" in p for p in results[0][1])
    if key_map_kind == "fn":  # each rank reads exactly its rows (TP: its column runs of them)
        assert all(r[2][0] == r[2][1] > 0 for r in results)
        if ws > 1 and mesh_kind != "tp":  # (TP peers each hold the norms: no clean split)
            total = sum(v.numel() * 2 for v in _expected_state().values())
            replicas = 2 if mesh_kind == "hsdp" else 1
            assert sum(r[2][1] for r in results) == total * replicas  # the ranks split the bytes


# ---------------------------------------------------------------- single process: files and errors


def _expect_error(path, model, match, **kw):
    before = full_state(model)
    with pytest.raises(ck.CheckpointError, match=match):
        ck.load_hf(path, model, **kw)
    assert_same_state(full_state(model), before)  # nothing was modified


def test_single_file_and_explicit_paths(tmp_path):
    source = make_model(0)
    save_file(source.state_dict(), str(tmp_path / "model.safetensors"))
    snapshot = tmp_path / "snapshots" / "abc"  # the Hugging Face cache: files link into blobs/
    snapshot.mkdir(parents=True)
    os.symlink(tmp_path / "model.safetensors", snapshot / "model.safetensors")
    for path in (tmp_path, tmp_path / "model.safetensors", snapshot):
        target = make_model(1)
        ck.load_hf(path, target)
        assert_same_state(full_state(target), full_state(source))
    write_hf(tmp_path / "sharded", source.state_dict(), files=3)
    target = make_model(1)
    ck.load_hf(tmp_path / "sharded" / "model.safetensors.index.json", target)
    assert_same_state(full_state(target), full_state(source))


def test_tied_weights_need_one_name(tmp_path):
    cfg = GPTConfig(vocab_size=32, seq_len=8, dim=16, n_layers=1, n_heads=2, tie_weights=True)
    torch.manual_seed(0)
    source = GPT(cfg)
    weights = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}  # HF drops the tie
    save_file(weights, str(tmp_path / "model.safetensors"))
    torch.manual_seed(1)
    target = GPT(cfg)
    ck.load_hf(tmp_path, target)
    assert target.lm_head.weight is target.tok_emb.weight
    assert_same_state(full_state(target), full_state(source))


def test_missing_and_unexpected_keys(tmp_path):
    source = make_model(0)
    weights = dict(source.state_dict())
    weights.pop("2.bias")
    weights["extra.weight"] = torch.zeros(2)
    save_file(weights, str(tmp_path / "model.safetensors"))
    target = make_model(1)
    _expect_error(tmp_path, target, r"missing from the checkpoint: \['2.bias'\].*the model lacks: \['extra.weight'\]")
    keys = ck.load_hf(tmp_path, target, strict=False)
    assert keys == ck.HFKeys(missing=["2.bias"], unexpected=["extra.weight"])
    assert torch.equal(target[0].weight, source[0].weight)
    assert torch.equal(target[2].bias, make_model(1)[2].bias)  # left as it was


def test_key_map_collision_and_bad_return(tmp_path):
    save_file(make_model(0).state_dict(), str(tmp_path / "model.safetensors"))
    _expect_error(
        tmp_path, make_model(1), r"maps both '0.bias' and '0.weight' to '0.weight'", key_map={"0.bias": "0.weight"}
    )
    _expect_error(tmp_path, make_model(1), r"key_map returned 3 for", key_map=lambda name: 3)


def test_shape_and_dtype_mismatch(tmp_path):
    weights = dict(make_model(0).state_dict())
    weights["0.weight"] = torch.zeros(8, 16)
    save_file(weights, str(tmp_path / "shape.safetensors"))
    _expect_error(
        tmp_path / "shape.safetensors",
        make_model(1),
        r"'0.weight' has shape \[8, 16\] but the model's '0.weight' is \[7, 16\]",
    )
    weights = dict(make_model(0).state_dict())
    weights["2.bias"] = torch.arange(5)
    save_file(weights, str(tmp_path / "dtype.safetensors"))
    _expect_error(
        tmp_path / "dtype.safetensors", make_model(1), r"'2.bias' is I64 but the model's '2.bias' is torch.float32"
    )


@pytest.mark.parametrize(
    "damage,match",
    [
        ("not json", r"not a readable safetensors index .*corrupt"),
        ('{"metadata": {}}', r"has no 'weight_map'"),
        ('{"weight_map": {"0.weight": "../../etc/passwd"}}', r"outside the checkpoint directory"),
        ('{"weight_map": {"0.weight": "gone.safetensors"}}', r"gone\.safetensors is missing"),
    ],
)
def test_corrupt_index(tmp_path, damage, match):
    write_hf(tmp_path, make_model(0).state_dict())
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        f.write(damage)
    _expect_error(tmp_path, make_model(1), match, strict=False)


def test_truncated_shard_and_missing_key_in_shard(tmp_path):
    write_hf(tmp_path, make_model(0).state_dict())
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    assert index["weight_map"]["0.bias"] == "model-00001-of-00002.safetensors"
    index["weight_map"]["0.bias"] = "model-00002-of-00002.safetensors"  # the index lies
    index_path.write_text(json.dumps(index))
    _expect_error(tmp_path, make_model(1), r"model-00002-of-00002\.safetensors, key '0\.bias': missing from the file")
    write_hf(tmp_path / "t", make_model(0).state_dict())
    shard_file = tmp_path / "t" / "model-00001-of-00002.safetensors"
    os.truncate(shard_file, os.path.getsize(shard_file) - 10)
    _expect_error(tmp_path / "t", make_model(1), r"not a readable safetensors file")


def test_meta_model_must_be_materialized(tmp_path):
    save_file(make_model(0).state_dict(), str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))
    with pytest.raises(ck.CheckpointError, match=r"on the meta device: call model.to_empty"):
        ck.load_hf(tmp_path, model)


# ---------------------------------------------------------------- save -> consolidate -> load_hf


def _train_and_save(rank, ws, path):
    model = shard(make_model(0), mesh_1d(ws))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(rank)
    model(torch.randn(2, 16)).square().sum().backward()
    opt.step()
    ck.save(path, model, opt)
    return full_state(model)


def _load_hf_sharded(rank, ws, path):
    model = shard(make_model(5), mesh_1d(ws))
    ck.load_hf(path, model)
    return full_state(model)


def test_save_consolidate_load_hf_on_another_world_size(worlds, tmp_path):
    path, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    saved = worlds.run(2, _train_and_save, path)[0]
    cli.consolidate(path, out, max_shard_size=300)
    assert len(json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())["weight_map"]) == 6
    for state in worlds.run(3, _load_hf_sharded, out):
        assert_same_state(state, saved)


# ---------------------------------------------------------------- untrusted files

_LOAD_HF_IN_A_SUBPROCESS = """
import json
import fsdp2.checkpoint as ck
from tests.checkpoint.ckpt_helpers import load_outcome, make_model
outcomes = [list(load_outcome(path, make_model(1), ck.load_hf)) for path in {paths!r}]
print(json.dumps(outcomes))
"""


@pytest.mark.parametrize(
    "kind,match",
    [
        ("fifo", "index.json is a FIFO, not a regular file"),
        ("link_to_dev_zero", "index.json is a character device, not a regular file"),
    ],
)
def test_index_that_is_a_fifo_or_dev_zero_is_refused(tmp_path, kind, match):
    write_hf(tmp_path, make_model(0).state_dict())
    index = tmp_path / "model.safetensors.index.json"
    index.unlink()
    if kind == "fifo":
        os.mkfifo(index)
    else:
        os.symlink("/dev/zero", index)  # the HF cache links files out of the folder: allowed, then refused
    before = exact_tree(tmp_path)
    result = isolated(_LOAD_HF_IN_A_SUBPROCESS.format(paths=[str(tmp_path), str(index)]), timeout=90)
    assert result.returncode == 0, result.stderr[-2000:]
    for outcome, untouched in json.loads(result.stdout.splitlines()[-1]):  # the folder, then the index itself
        assert match in outcome and untouched, outcome
    assert exact_tree(tmp_path) == before


def _weights_file(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)


def _crafted(case: str) -> tuple[dict | str, bytes]:
    """A header and data for make_model's 6 tensors (fp32), damaged as ``case`` says."""
    sd = make_model(0).state_dict()
    header, data, offset = {"__metadata__": {"format": "pt"}}, b"", 0
    for name, t in sd.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    w0, b0 = header["0.weight"]["data_offsets"], header["0.bias"]["data_offsets"]
    if case == "overlap":  # 2.bias (5 floats) reads the first 20 bytes of 0.bias (7 floats): same length
        header["2.bias"]["data_offsets"] = [b0[0], b0[0] + 20]
    elif case == "fractional_shape":
        header["0.bias"]["shape"] = [7.0]
    elif case == "fractional_shape_8_7":
        header["0.bias"]["shape"] = [7.7]
    elif case == "fractional_offset":
        header["0.bias"]["data_offsets"] = [float(b0[0]), b0[1]]
    elif case == "negative_shape":
        header["0.bias"]["shape"] = [-7]
    elif case == "bool_shape":
        header["4.bias"]["shape"] = [True, 3]
    elif case == "gap":
        data += b"\0" * 8
        header["4.bias"]["data_offsets"] = [x + 8 for x in header["4.bias"]["data_offsets"]]
    elif case == "trailing_bytes":
        data += b"\0" * 8
    elif case == "unknown_dtype":
        header["0.bias"]["dtype"] = "F128"
    elif case == "metadata_not_strings":
        header["__metadata__"] = {"format": 1}
    elif case == "three_offsets":
        header["0.bias"]["data_offsets"] = [*b0, b0[1]]
    elif case == "shape_disagrees_with_bytes":
        header["0.weight"]["shape"] = [16, 7, 2]
    elif case == "duplicate_key":  # 0.bias twice, the second (json keeps the last) over 0.weight's first bytes
        entry = '"0.bias": ' + json.dumps(header["0.bias"])
        twin = '"0.bias": ' + json.dumps({"dtype": "F32", "shape": [7], "data_offsets": [w0[0], w0[0] + 28]})
        text = json.dumps(header)
        assert entry in text
        return text.replace(entry, f"{entry}, {twin}", 1), data
    elif case == "nan_dimension":
        return json.dumps(header).replace('"shape": [7]', '"shape": [NaN]', 1), data
    return header, data


_CRAFTED_HEADERS = [
    "overlap",
    "fractional_shape",
    "fractional_shape_8_7",
    "fractional_offset",
    "negative_shape",
    "bool_shape",
    "gap",
    "trailing_bytes",
    "unknown_dtype",
    "metadata_not_strings",
    "three_offsets",
    "shape_disagrees_with_bytes",
    "duplicate_key",
    "nan_dimension",
]


@pytest.mark.parametrize("case", _CRAFTED_HEADERS)
def test_headers_the_safetensors_library_rejects_are_refused(tmp_path, case):
    header, data = _crafted(case)
    path = tmp_path / "model.safetensors"
    if isinstance(header, str):
        blob = header.encode() + b" " * (-len(header.encode()) % 8)
        path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    else:
        _weights_file(path, header, data)
    with pytest.raises(Exception):  # the reference: the library refuses every one of these files
        with safe_open(str(path), framework="pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    before = exact_tree(tmp_path)
    _expect_error(tmp_path, make_model(1), r"model\.safetensors is not a readable safetensors file")
    assert exact_tree(tmp_path) == before


def test_header_limits_and_encoding(tmp_path):
    header, data = _crafted("none")
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    cases = {
        "too_large": struct.pack("<Q", 100_000_001) + b"{}",  # over the library's 100,000,000 bytes
        "not_utf8": struct.pack("<Q", len(blob)) + blob.replace(b'"format"', b'"f\xffrmat"') + data,
        "utf16": struct.pack("<Q", 2 * len(blob)) + blob.decode().encode("utf-16-le") + data,
        "a_list": struct.pack("<Q", 8) + b"[]      ",
    }
    for case, content in cases.items():
        path = tmp_path / case / "model.safetensors"
        path.parent.mkdir()
        path.write_bytes(content)
        _expect_error(path, make_model(1), r"not a readable safetensors file")
    good = tmp_path / "good" / "model.safetensors"
    good.parent.mkdir()
    good.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    target = make_model(1)
    ck.load_hf(good, target)  # the uncrafted file loads
    assert_same_state(full_state(target), full_state(make_model(0)))
