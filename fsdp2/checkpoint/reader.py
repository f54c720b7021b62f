"""``load``: each rank reads just the byte ranges its target shards need.

Reshard-on-load works because both sides are described as boxes in the global
tensor: the manifest lists the saved chunks, and each rank computes the box it owns
from its *target* DTensors (any mesh, any world size, or a plain tensor = the
whole box). A rank reads ``chunk ∩ box`` for every overlapping chunk, widened to the
edges of the checksummed blocks it touches (``tensor_reader.py``, several threads, checked
in the same pass), so bytes read ≈ bytes owned.

Failure safety: everything is read into fresh tensors and all ranks agree that
reading succeeded before any model parameter or optimizer state is overwritten.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import _dist
from .errors import CheckpointError
from fsdp2 import compat
from fsdp2.layout.regions import LayoutError, Region, local_region

from .format import MANIFEST_NAME, Chunk, Manifest, TensorEntry, safetensors_dtype
from .integrity import checksum
from .safetensors_io import file_crc32
from .tensor_reader import OpenFiles, ReadPass, StoredChunk
from .state import decode, model_key, optimizer_param_fqns, tensor_refs


@dataclass
class LoadStats:
    """What one rank's ``load`` did; pass one in to have it filled."""

    bytes_read: int = 0       # tensor bytes read from checkpoint files (whole checksum blocks)
    bytes_owned: int = 0      # bytes of the target shards this rank filled
    bytes_verified: int = 0   # bytes checksummed: those read (format 2), whole files (format 1)
    files_read: list[str] = field(default_factory=list)
    seconds: float = 0.0


def read_manifest(path: str) -> Manifest:
    manifest_path = os.path.join(path, MANIFEST_NAME)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not os.path.exists(manifest_path):
        partial = sorted(n for n in os.listdir(path) if n.endswith(".partial"))
        hint = f" (found unfinished save data {partial})" if partial else ""
        raise CheckpointError(
            f"{manifest_path} is missing: {path} is not a complete checkpoint{hint}. A save was "
            "probably interrupted before it was published; load an earlier checkpoint or save again.")
    with open(manifest_path) as f:
        return Manifest.from_json(f.read(), manifest_path)


@dataclass
class _Target:
    """A box of one saved tensor that this rank needs, and the fresh buffer for it."""

    key: str
    entry: TensorEntry
    region: Region
    buffer: torch.Tensor
    # True when the buffer is only copied into an existing tensor afterwards. Such a
    # buffer may alias the file's memory map; kept tensors (optimizer state) must not.
    transient: bool = False


def _target_region(value: torch.Tensor) -> Region | None:
    try:
        return local_region(value)
    except LayoutError as e:
        raise CheckpointError(f"cannot load into a DTensor: {e}") from None


class _Plan:
    """Everything one rank will read, decided before touching any file."""

    def __init__(self, path: str, manifest: Manifest):
        self.path, self.manifest = path, manifest
        self.targets: dict[str, _Target] = {}
        # optimizer state keys to rebuild as DTensors laid out like these templates
        self.dtensor_templates: dict[str, DTensor] = {}

    def entry(self, key: str, hint: str) -> TensorEntry:
        entry = self.manifest.tensors.get(key)
        if entry is None:
            raise CheckpointError(f"{self.path}: checkpoint has no tensor {key!r}. {hint}")
        return entry

    def add(self, key: str, entry: TensorEntry, region: Region | None, transient: bool = False) -> None:
        if region is None:
            return
        buffer = torch.empty(region.shape, dtype=entry.torch_dtype)
        self.targets[key] = _Target(key, entry, region, buffer, transient)

    def needed_files(self) -> list[str]:
        files = set()
        for t in self.targets.values():
            for c in t.entry.chunks:
                if t.region.numel and c.region.intersect(t.region) is not None:
                    files.add(c.file)
        return sorted(files)


def _check_like(path: str, key: str, entry: TensorEntry, value: torch.Tensor) -> None:
    if tuple(value.shape) != entry.shape:
        raise CheckpointError(
            f"{path}: {key!r} has shape {list(entry.shape)} in the checkpoint but {list(value.shape)} in "
            "the model; build the model with the same configuration as the saved one")
    if value.dtype != entry.torch_dtype:
        raise CheckpointError(
            f"{path}: {key!r} has dtype {entry.dtype} in the checkpoint but {value.dtype} in the model; "
            f"convert the model (e.g. model.to({entry.torch_dtype})) before loading, then cast")


def _plan_model(plan: _Plan, model: nn.Module, strict: bool) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    for fqn, value in sd.items():
        key = model_key(fqn)
        entry = plan.entry(key, "Is it the checkpoint of this model?")
        _check_like(plan.path, key, entry, value)
        plan.add(key, entry, _target_region(value), transient=True)
    if strict:
        expected = {model_key(f) for f in sd}
        unexpected = sorted(k for k in plan.manifest.tensors if k.startswith("model/") and k not in expected)
        if unexpected:
            raise CheckpointError(f"{plan.path}: checkpoint has tensors the model lacks: {unexpected[:10]}; "
                                  "pass strict=False to ignore them")
    return sd


def _plan_optimizer(plan: _Plan, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    saved = plan.manifest.objects.get("optimizer")
    if saved is None:
        raise CheckpointError(f"{plan.path} holds no optimizer state; load it with optimizer=None")
    current = optimizer_param_fqns(model, optimizer)
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(current) or any(
            sorted(g["params"]) != sorted(c) for g, c in zip(saved_groups, current)):
        raise CheckpointError(
            f"{plan.path}: optimizer param groups differ from the saved ones (saved "
            f"{[len(g['params']) for g in saved_groups]} params per group, now {[len(c) for c in current]}); "
            "create the optimizer with the same param groups as when saving")
    params = dict(model.named_parameters())
    for fqn, encoded in saved["state"].items():
        if fqn not in params:
            raise CheckpointError(f"{plan.path}: optimizer state for unknown parameter {fqn!r}")
        param = params[fqn]
        prefix = f"optim/state/{fqn}/"
        for key in tensor_refs(encoded):
            entry = plan.entry(key, "The manifest is inconsistent; re-save the checkpoint.")
            name = key[len(prefix):]
            existing = optimizer.state.get(param, {}).get(name)
            # Lay the state out like the optimizer already has it, else like its parameter
            # when the shapes agree (exp_avg, exp_avg_sq), else whole (step, scalars).
            template = existing if isinstance(existing, torch.Tensor) else None
            if template is None and isinstance(param, DTensor) and tuple(param.shape) == entry.shape:
                template = param
            if isinstance(template, DTensor):
                if tuple(template.shape) != entry.shape:
                    raise CheckpointError(f"{plan.path}: optimizer state {key!r} has shape {list(entry.shape)}, "
                                          f"the optimizer's is {list(template.shape)}")
                plan.add(key, entry, _target_region(template))
                plan.dtensor_templates[key] = template
            else:
                plan.add(key, entry, Region.whole(entry.shape))
    for group in saved_groups:
        for key in tensor_refs(group):
            entry = plan.entry(key, "The manifest is inconsistent; re-save the checkpoint.")
            plan.add(key, entry, Region.whole(entry.shape))
    return saved


def _plan_extra(plan: _Plan) -> Any:
    encoded = plan.manifest.objects.get("extra")
    for key in tensor_refs(encoded):
        entry = plan.entry(key, "The manifest is inconsistent; re-save the checkpoint.")
        plan.add(key, entry, Region.whole(entry.shape))
    return encoded


def _verify_files(plan: _Plan, files: list[str], verify: bool, stats: LoadStats) -> None:
    """Cheap checks of every file before reading; format 1 also checks whole-file CRC-32s here
    (format 2 checks each block as it is read, in ``_read_targets``)."""
    for rel in files:
        full = os.path.join(plan.path, rel)
        expected = plan.manifest.files[rel]
        if not os.path.exists(full):
            raise CheckpointError(f"{full} is missing; the checkpoint is incomplete, restore the file or "
                                  "load an earlier checkpoint")
        size = os.path.getsize(full)
        if size != expected.size:
            raise CheckpointError(f"{full} is {size} bytes but the manifest says {expected.size}: the file "
                                  "is truncated or was replaced; restore it or load an earlier checkpoint")
        if verify and plan.manifest.version == 1:
            crc, n = file_crc32(full)
            stats.bytes_verified += n
            if crc != expected.crc32:
                raise CheckpointError(f"{full} is corrupted (crc32 {crc}, manifest says {expected.crc32}); "
                                      "restore the file or load an earlier checkpoint")


def stored_chunk(manifest: Manifest, files: OpenFiles, entry: TensorEntry, chunk: Chunk,
                 verify: bool) -> StoredChunk:
    """Where ``chunk``'s bytes are, after checking the file's header against the manifest."""
    full = files.full_path(chunk.file)
    header = files.header(chunk.file)
    expected_crc = manifest.files[chunk.file].header_crc32c
    if verify and expected_crc is not None and f"{checksum(header.raw):08x}" != expected_crc:
        raise CheckpointError(f"{full} is corrupted (crc32c of its header {checksum(header.raw):08x}, manifest "
                              f"says {expected_crc}); restore the file or load an earlier checkpoint")
    info = header.info(chunk.key)
    if info.shape != chunk.shape or info.dtype_name != safetensors_dtype(entry.torch_dtype):
        raise CheckpointError(f"{full}, key {chunk.key!r}: file holds {info.dtype_name}{list(info.shape)}, "
                              f"manifest says {entry.dtype}{list(chunk.shape)}; the checkpoint is damaged")
    dtype = entry.torch_dtype
    checked = verify and chunk.crc32c is not None
    return StoredChunk(full, files.open(chunk.file)[0], info.begin, chunk.region, dtype, f"key {chunk.key!r}",
                       chunk.grid(dtype.itemsize) if checked else None, chunk.checksums() if checked else None)


def _read_targets(plan: _Plan, verify: bool, stats: LoadStats) -> None:
    """One pass: each rank reads the blocks holding its boxes, checks them, fills its buffers."""
    with OpenFiles(plan.path) as files:
        reads = ReadPass(verify=verify)
        for t in plan.targets.values():
            for chunk in t.entry.chunks:
                part = chunk.region.intersect(t.region) if t.region.numel else None
                if part is None:
                    continue
                source = stored_chunk(plan.manifest, files, t.entry, chunk, verify)
                reads.add(source, part, t.buffer[part.slices_within(t.region)])
            stats.bytes_owned += t.buffer.numel() * t.buffer.element_size()
        counts = reads.run()
    stats.bytes_read += counts.bytes_read
    stats.bytes_verified += counts.bytes_verified


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         verify: bool = True, strict: bool = True, stats: LoadStats | None = None) -> Any:
    """Load a checkpoint into ``model`` (and ``optimizer``); returns the saved ``extra``.

    Works for any saving/loading world sizes and meshes (reshard on load) and for
    plain unsharded models. Collective when torch.distributed is initialized.
    ``verify`` checks the checksum of every block this rank reads, as it reads it, before
    anything is modified (``verify=False`` skips the hashing). On any ``CheckpointError`` the
    model and optimizer are unchanged. Pass a ``LoadStats`` to get byte counts.
    """
    path = os.fspath(path)
    stats = stats if stats is not None else LoadStats()
    start = time.perf_counter()
    error: BaseException | None = None
    try:
        manifest = read_manifest(path)
        plan = _Plan(path, manifest)
        model_sd = _plan_model(plan, model, strict)
        saved_optim = _plan_optimizer(plan, model, optimizer) if optimizer is not None else None
        encoded_extra = _plan_extra(plan)
        manifest.validate(plan.targets.keys())
        files = plan.needed_files()
        stats.files_read = files
        _verify_files(plan, files, verify, stats)
        _read_targets(plan, verify, stats)
    except CheckpointError as e:
        error = e
    except Exception as e:  # anything unforeseen still goes through the all-ranks agreement
        error = CheckpointError(f"loading {path} failed: {e!r}")
        error.__cause__ = e
    # Nobody modifies anything unless every rank read everything it needs.
    if not _dist.all_ok(error is None):
        stats.seconds = time.perf_counter() - start
        if error is not None:
            raise error
        raise CheckpointError(f"loading {path} failed on another rank (see its error); nothing was changed")

    tensors = {}
    for key, t in plan.targets.items():
        template = plan.dtensor_templates.get(key)
        tensors[key] = compat.dtensor_like(template, t.buffer.to(compat.local_tensor(template).device)) if template is not None else t.buffer
    with torch.no_grad():
        for fqn, value in model_sd.items():
            target = plan.targets.get(model_key(fqn))
            if target is None:
                continue
            dest = value.to_local() if isinstance(value, DTensor) else value
            dest.copy_(target.buffer)
    if optimizer is not None:
        _load_optimizer(optimizer, model, saved_optim, tensors)
    stats.seconds = time.perf_counter() - start
    return decode(encoded_extra, tensors.__getitem__)


def _load_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, saved: dict,
                    tensors: dict[str, torch.Tensor]) -> None:
    current = optimizer.state_dict()["param_groups"]
    fqn_groups = optimizer_param_fqns(model, optimizer)
    fqn_to_id = {fqn: pid for g, fqns in zip(current, fqn_groups) for pid, fqn in zip(g["params"], fqns)}
    state = {fqn_to_id[fqn]: decode(s, tensors.__getitem__) for fqn, s in saved["state"].items()}
    groups = []
    for g, now in zip(saved["param_groups"], current):
        hyper = decode({k: v for k, v in g.items() if k != "params"}, tensors.__getitem__)
        # State is keyed by the current ids, so keep the current order (same set, checked).
        groups.append({**hyper, "params": now["params"]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
