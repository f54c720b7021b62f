"""``load_hf``: Hugging Face safetensors weights straight into a sharded model.

    with torch.device("meta"):
        model = Llama(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cuda")                 # allocates only this rank's shards
    load_hf("Llama-3-8B/", model, key_map=hf_to_ours)

Each rank parses the safetensors headers (plain JSON) and reads only the byte ranges of the
boxes it holds, on several threads (``tensor_reader.py``), converting floating dtypes on the
fly (bf16 file into fp32 master weights). No rank ever holds a full tensor it does not own:
host memory grows by this rank's shard bytes (the fresh buffers that make a failed load
change nothing) plus one read piece per reader thread.

Everything that can be checked before reading is checked on every rank first -- the index,
the headers, missing and unexpected keys, shapes, dtypes -- and all ranks agree on success
before any parameter is written, so a ``CheckpointError`` leaves the model untouched.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2 import compat
from fsdp2.layout.regions import LayoutError, Region, local_region
from fsdp2.tools.progress import ByteProgress

from . import _dist, fresh_memory, gc_pause
from .errors import CheckpointError
from .paths import read_checkpoint_text
from .reader import LoadStats
from .safetensors_io import StoredTensorInfo
from .tensor_reader import OpenFiles, ReadPass, StoredChunk

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

KeyMap = Mapping[str, str] | Callable[[str], "str | None"]


class HFKeys(NamedTuple):
    """What ``load_hf(..., strict=False)`` left out."""

    missing: list[str]  # model keys the checkpoint has no tensor for (left as they were)
    unexpected: list[str]  # checkpoint tensors the model has no key for (not read)


@dataclass
class _Source:
    """Where a checkpoint tensor lives: file (relative to the root) and header entry."""

    name: str
    file: str
    info: StoredTensorInfo | None = None


@dataclass
class _Target:
    fqn: str
    value: torch.Tensor  # the model's state_dict entry (DTensor or plain)
    source: _Source
    region: Region | None = None
    buffer: torch.Tensor | None = None


def _resolve(path: str) -> tuple[str, str | None, str | None]:
    """(root dir, index file name or None, single file name or None)."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, INDEX_NAME)):
            return path, INDEX_NAME, None
        if os.path.exists(os.path.join(path, SINGLE_NAME)):
            return path, None, SINGLE_NAME
        raise CheckpointError(
            f"{path} holds neither {SINGLE_NAME} nor {INDEX_NAME}; pass the directory of a "
            "Hugging Face checkpoint or one of those files"
        )
    root, name = os.path.split(os.path.abspath(path))
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist")
    if name.endswith(".json"):
        return root, name, None
    if name.endswith(".safetensors"):
        return root, None, name
    raise CheckpointError(f"{path}: expected a directory, a .safetensors file or a safetensors index .json")


def _read_index(root: str, index_name: str) -> dict[str, str]:
    full = os.path.join(root, index_name)
    # Opened as the safetensors files are: a FIFO or /dev/zero there must not block or never end.
    text = read_checkpoint_text(root, index_name, "the index is corrupt, download it again", links_may_leave_root=True)
    try:
        index = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(
            f"{full} is not a readable safetensors index ({e}); the index is corrupt, download it again"
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{full} has no 'weight_map' of tensor name -> file name; the index is corrupt, download it again"
        )
    for name, file in weight_map.items():
        parts = file.replace("\\", "/").split("/")
        if os.path.isabs(file) or ".." in parts or not file:
            raise CheckpointError(
                f"{full} maps {name!r} to {file!r}, outside the checkpoint directory; the index is corrupt"
            )
    return weight_map


def _model_names(names: list[str], key_map: KeyMap | None) -> dict[str, str]:
    """checkpoint name -> model key, for the names ``key_map`` keeps."""
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name in names:
        if key_map is None:
            target = name
        elif callable(key_map):
            target = key_map(name)
        else:
            target = key_map.get(name, name)
        if target is None:
            continue
        if not isinstance(target, str):
            raise CheckpointError(f"key_map returned {target!r} for {name!r}; return a model key (str) or None")
        if target in seen:
            raise CheckpointError(
                f"key_map maps both {seen[target]!r} and {name!r} to {target!r}; map each "
                "model key from one checkpoint tensor"
            )
        seen[target] = name
        out[name] = target
    return out


def _alias_groups(model: nn.Module) -> dict[str, list[str]]:
    """Each state_dict key -> every key of the same tensor (tied weights), itself first."""
    by_id: dict[int, list[str]] = {}
    for fqn, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        by_id.setdefault(id(t), []).append(fqn)
    groups = {}
    for fqns in by_id.values():
        for fqn in fqns:
            groups[fqn] = [fqn] + [f for f in fqns if f != fqn]
    return groups


def _check_target(where: str, fqn: str, value: torch.Tensor, source: _Source) -> None:
    info = source.info
    if info.dtype is None:
        raise CheckpointError(
            f"{where}: tensor {source.name!r} has dtype {info.dtype_name}, which this torch cannot hold"
        )
    if tuple(value.shape) != info.shape:
        raise CheckpointError(
            f"{where}: tensor {source.name!r} has shape {list(info.shape)} but the model's "
            f"{fqn!r} is {list(value.shape)}; build the model with the checkpoint's config"
        )
    same_kind = info.dtype.is_floating_point and value.dtype.is_floating_point
    if info.dtype != value.dtype and not same_kind:
        raise CheckpointError(
            f"{where}: tensor {source.name!r} is {info.dtype_name} but the model's {fqn!r} is "
            f"{value.dtype}; only floating-point dtypes are converted on load"
        )
    local = compat.local_tensor(value) if isinstance(value, DTensor) else value
    if local.is_meta:
        raise CheckpointError(
            f"model key {fqn!r} is on the meta device: call model.to_empty(device=...) after "
            "fully_shard (it allocates only this rank's shards), then load_hf"
        )


def _plan(
    path: str,
    index_name: str | None,
    single: str | None,
    model: nn.Module,
    key_map: KeyMap | None,
    strict: bool,
    files: OpenFiles,
) -> tuple[list[_Target], HFKeys]:
    if index_name is not None:
        weight_map = _read_index(files.root, index_name)
    else:
        weight_map = {name: single for name in files.header(single).tensors}
    mapped = _model_names(sorted(weight_map), key_map)
    by_model_key = {target: name for name, target in mapped.items()}
    sd = model.state_dict()
    groups = _alias_groups(model)
    targets, missing, loaded_ids = [], [], set()
    for fqn, value in sd.items():
        if not isinstance(value, torch.Tensor):
            continue
        names = [by_model_key[a] for a in groups.get(fqn, [fqn]) if a in by_model_key]
        if not names:
            missing.append(fqn)
            continue
        alias_key = tuple(sorted(groups.get(fqn, [fqn])))
        if alias_key in loaded_ids:
            continue  # a tied weight: one read fills every name
        loaded_ids.add(alias_key)
        source = _Source(names[0], weight_map[names[0]])
        source.info = files.header(source.file).info(source.name)
        _check_target(path, fqn, value, source)
        targets.append(_Target(fqn, value, source))
    model_keys = set(sd)
    unexpected = sorted(name for name, target in mapped.items() if target not in model_keys)
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"model keys missing from the checkpoint: {missing[:10]}")
        if unexpected:
            parts.append(f"checkpoint tensors the model lacks: {unexpected[:10]}")
        raise CheckpointError(
            f"{path}: {'; '.join(parts)}. Pass key_map= to rename (a dict or a function "
            "returning None to skip a tensor) or strict=False to ignore them"
        )
    return targets, HFKeys(missing, unexpected)


def load_hf(
    path: str | os.PathLike,
    model: nn.Module,
    *,
    key_map: KeyMap | None = None,
    strict: bool = True,
    stats: LoadStats | None = None,
) -> HFKeys:
    """Load a Hugging Face safetensors checkpoint into ``model``, each rank reading only its shards.

    ``path``: a directory with ``model.safetensors`` or ``model.safetensors.index.json`` (+ its
    shards), or one of those files. ``model``: any module, typically built on the meta device,
    sharded with ``fully_shard`` (1-D, HSDP or TP + FSDP meshes) and materialized with
    ``model.to_empty(device=...)``. ``key_map`` renames checkpoint tensors to model keys: a
    dict (names not in it are kept) or a function returning the model key, or None to skip
    that tensor. Floating-point tensors are converted to the model's dtype. ``strict``: every
    model key must be loaded and every checkpoint tensor used (tied weights need one of their
    names). Collective when torch.distributed is initialized. On ``CheckpointError`` nothing
    was modified. Returns the keys left out (all empty when ``strict``).
    """
    with gc_pause.paused():  # as load's: its objects die by refcount; a full collection would stall every rank
        return _load_hf(os.fspath(path), model, key_map, strict, stats)


def _load_hf(path: str, model: nn.Module, key_map: KeyMap | None, strict: bool, stats: LoadStats | None) -> HFKeys:
    stats = stats if stats is not None else LoadStats()
    start = time.perf_counter()
    targets: list[_Target] = []
    keys = HFKeys([], [])
    files: OpenFiles | None = None
    try:
        error = None
        try:
            root, index_name, single = _resolve(path)
            files = OpenFiles(root, links_may_leave_root=True)  # the HF cache links files to blobs/
            targets, keys = _plan(path, index_name, single, model, key_map, strict, files)
        except Exception as e:
            error = _as_checkpoint_error(e, f"loading {path} failed")
        # Nothing is read unless every rank's checks passed, nothing written unless every read did.
        failure = _dist.first_failure(error)
        if failure is not None:
            raise error or CheckpointError(
                f"loading {path} failed on rank {failure[0]}: {failure[1]}; nothing was changed"
            )
        try:
            _read(files, targets, stats)
        except Exception as e:
            error = _as_checkpoint_error(e, f"reading {path} failed")
    finally:
        if files is not None:
            files.__exit__(None, None, None)
    failure = _dist.first_failure(error)
    if failure is not None:
        raise error or CheckpointError(f"reading {path} failed on rank {failure[0]}: {failure[1]}; nothing was changed")
    with torch.no_grad():
        for t in targets:
            if t.buffer is not None:
                dest = compat.local_tensor(t.value) if isinstance(t.value, DTensor) else t.value
                dest.copy_(t.buffer)
    stats.seconds = time.perf_counter() - start
    return keys


def _as_checkpoint_error(e: Exception, what: str) -> CheckpointError:
    if isinstance(e, CheckpointError):
        return e
    error = CheckpointError(f"{what}: {e!r}")
    error.__cause__ = e
    return error


def _read(files: OpenFiles, targets: list[_Target], stats: LoadStats) -> None:
    reads = ReadPass(verify=False)  # Hugging Face files carry no checksums
    for t in targets:
        try:
            t.region = local_region(t.value)
        except LayoutError as e:
            raise CheckpointError(f"cannot load {t.fqn!r} into a DTensor: {e}") from None
        if t.region is None:
            continue
        info = t.source.info
        t.buffer = fresh_memory.empty(t.region.shape, t.value.dtype)
        fd, _ = files.open(t.source.file)
        chunk = StoredChunk(
            files.full_path(t.source.file),
            fd,
            info.begin,
            Region.whole(info.shape),
            info.dtype,
            f"tensor {t.source.name!r}",
        )
        reads.add(chunk, t.region, t.buffer)
        stats.bytes_owned += t.buffer.numel() * info.dtype.itemsize  # as stored: comparable to bytes_read
    with ByteProgress("load_hf", files.root, reads.nbytes) as progress:
        counts = reads.run(progress)
    stats.bytes_read += counts.bytes_read
    stats.files_read = sorted({t.source.file for t in targets if t.buffer is not None})
