"""Models, sharding and comparison helpers shared by the checkpoint tests.

Rank functions live in test modules; this module holds what both sides use.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys

import torch
import torch.nn as nn


DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
# Saved by the code of format 1 (whole-file CRC-32s) and of format 2 (chunks and block checksums listed
# in the manifest), on 2 ranks; each with ``<name>.expected.safetensors``, the full tensors.
V1_FIXTURE = os.path.join(DATA, "ckpt_v1")
V2_FIXTURE = os.path.join(DATA, "ckpt_v2")


def make_model(seed: int = 0) -> nn.Module:
    """Small MLP whose dims (7, 5) shard unevenly, with empty shards on 4+ ranks."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))
    with torch.no_grad():  # make every value depend on the seed in a recognisable way
        for i, p in enumerate(model.parameters()):
            p.add_(seed * 10 + i)
    return model


def matrices(*names: str, seed: int | None = 0) -> nn.Module:
    """A plain module of 1024 x 1024 fp32 parameters ``names`` (4 MiB each, 4 KiB rows): drawn from
    ``seed``, or zeros (a load target) when ``seed`` is None."""
    if seed is not None:
        torch.manual_seed(seed)
    module = nn.Module()
    for name in names:
        values = torch.zeros(1024, 1024) if seed is None else torch.randn(1024, 1024)
        module.register_parameter(name, nn.Parameter(values))
    return module


def shard(model: nn.Module, mesh) -> nn.Module:
    """fsdp2.runtime.fully_shard each Linear, then the root (Shard(0), or (Replicate, Shard(0)) for HSDP)."""
    from fsdp2 import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def wide_module(ws, seed, rows=4096):
    """One (rows, 64) parameter sharded on dim 0 over ``ws`` ranks, drawn from ``seed``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(seed)
    module = nn.Module()
    module.register_parameter("w", nn.Parameter(distribute_tensor(torch.randn(rows, 64), mesh_1d(ws), [Shard(0)])))
    return module


def flip_byte(path, offset):
    """Flip one bit of the byte at ``offset`` of file ``path``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def stored_chunks(path, key):
    """``[(file, offsets, shape)]`` of every stored chunk of ``key``, as the manifest places them
    (listed, or by the tensor's rule)."""
    from fsdp2.checkpoint.reader import read_manifest

    return [(c.file, list(c.offsets), list(c.shape)) for c in read_manifest(path).chunks_of(key)]


def file_header(full):
    """The parsed safetensors header of ``full``: ``(tensors, metadata)``."""
    from fsdp2.checkpoint.safetensors_io import read_header

    fd = os.open(full, os.O_RDONLY)
    try:
        header = read_header(fd, full, os.path.getsize(full))
    finally:
        os.close(fd)
    return header.tensors, header.metadata


def file_index(full) -> dict:
    """The fsdp2 index a format-3 rank file carries in its header, as JSON."""
    return json.loads(file_header(full)[1]["fsdp2.index"])


def rewrite_rank_file(full, edit) -> None:
    """Rewrite the format-3 rank file ``full`` with ``edit(tensors, index)`` applied to its header's JSON
    (tensor entries and the fsdp2 index, in place; a string it returns replaces the index's text),
    then sealed with a correct header checksum: a crafted file, as someone who knows the format
    could make one."""
    import struct

    from fsdp2.checkpoint.file_index import seal

    with open(full, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    metadata = header.pop("__metadata__")
    index = json.loads(metadata["fsdp2.index"])
    text = edit(header, index)
    metadata["fsdp2.index"] = text if isinstance(text, str) else json.dumps(index, separators=(",", ":"))
    blob = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(full, "wb") as f:
        f.write(seal(struct.pack("<Q", len(blob)) + blob) + data[8 + length :])


def byte_of(path, key, row):
    """File and absolute offset of the first byte of ``row`` of the chunk of ``key`` holding it."""
    for file, offsets, shape in stored_chunks(path, key):
        if offsets[0] <= row < offsets[0] + shape[0]:
            full = os.path.join(path, file)
            info = file_header(full)[0][key]
            row_bytes = (info.end - info.begin) // shape[0]
            return full, info.begin + (row - offsets[0]) * row_bytes
    raise AssertionError(key)


def mesh_1d(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))


def mesh_2d(rows: int, cols: int, names=("replicate", "shard")):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (rows, cols), mesh_dim_names=names)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of a model's state; collective for DTensor models."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def full_optim_state(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    """Full copies of an optimizer's state as ``<param fqn>/<name>``; collective for DTensor state."""
    from torch.distributed.tensor import DTensor

    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, s in opt.state.items():
        for k, v in s.items():
            out[f"{names[id(p)]}/{k}"] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    return out


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


@contextlib.contextmanager
def checksum_blocks(nbytes: int):
    """Save with checksum blocks of about ``nbytes`` (1: one element, so every row edge is a block edge)."""
    from fsdp2.checkpoint import integrity

    old = integrity.BLOCK_BYTES
    integrity.BLOCK_BYTES = nbytes
    try:
        yield
    finally:
        integrity.BLOCK_BYTES = old


def load_outcome(path: str, model: nn.Module, load=None) -> tuple[str, bool]:
    """("loaded" or the CheckpointError's message, whether the model is unchanged) of ``load``
    (default ``fsdp2.checkpoint.load``; e.g. ``load_hf``)."""
    import fsdp2.checkpoint as ck

    before = full_state(model)
    try:
        (load or ck.load)(path, model)
        outcome = "loaded"
    except ck.CheckpointError as e:
        outcome = str(e)
    return outcome, all(torch.equal(v, before[k]) for k, v in full_state(model).items())


# ---------------------------------------------------------------- untrusted files

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def isolated(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with at most 4 GiB of data (heap, anonymous maps) and a deadline.

    For calls that hung or read without limit before their fix: the test fails (a timeout or
    a MemoryError) instead of hanging the suite or filling the machine's memory.
    """
    import resource

    import pytest

    def limit_memory():
        # RLIMIT_DATA, not RLIMIT_AS: a CUDA build of torch maps large libraries but allocates little.
        resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30))

    try:
        return subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO},
            preexec_fn=limit_memory,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s: it hangs")


def exact_tree(path) -> dict:
    """Every entry under ``path``: a file's bytes, a link's target, or its kind (not followed)."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                value = ("link", os.readlink(full))
            elif stat.S_ISREG(mode):
                with open(full, "rb") as f:
                    value = f.read()
            else:
                value = ("kind", stat.S_IFMT(mode))
            out[os.path.relpath(full, path)] = value
    return out
