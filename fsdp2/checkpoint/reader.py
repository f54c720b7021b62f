"""``load``: each rank reads just the byte ranges its target shards need.

Reshard-on-load works because both sides are described as boxes in the global
tensor: the manifest gives the saved chunks (format 3: by each tensor's rule,
``chunk_rule.py``; earlier formats list them), and each rank computes the box it owns
from its *target* DTensors (any mesh, any world size, or a plain tensor = the
whole box). A rank reads ``chunk ∩ box`` for every overlapping chunk, widened to the
edges of the checksummed blocks it touches (``tensor_reader.py``, several threads, checked
in the same pass), so bytes read ≈ bytes owned.

A load plans from metadata alone (:func:`plan_load`): the manifest, then the headers of the
files holding the chunks it needs, whose indexes give those chunks' block checksums
(``file_index.py``). So the metadata a rank reads grows with what it loads, not with the
number of ranks that saved.

Failure safety: everything is checked, read into fresh tensors and decoded (optimizer
state, ``extra``) first, and all ranks agree that this succeeded, before any model
parameter or optimizer state is overwritten. Gathered (unsharded) fsdp2 groups are
resharded before planning, as PyTorch's ``load_state_dict`` does; that changes no value.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import _dist, fresh_memory, gc_pause
from .errors import CheckpointError
from fsdp2 import compat
from fsdp2.layout.regions import LayoutError, Region, local_region
from fsdp2.tools.progress import ByteProgress

from .directory import CheckpointDir
from .file_index import FileIndex, check_seal, chunk_record
from .format import MANIFEST_NAME, Chunk, Manifest, TensorEntry, dtype_name, safetensors_dtype
from .integrity import checksum
from .paths import checkpoint_file
from .safetensors_io import file_crc32
from .state import (
    decode,
    first_meta_tensor,
    model_key,
    optimizer_param_fqns,
    optimizer_type,
    reshard_model,
    tensor_refs,
)
from .tensor_reader import OpenFiles, ReadPass, StoredChunk


@dataclass
class LoadStats:
    """What one rank's ``load`` did; pass one in to have it filled."""

    bytes_read: int = 0  # tensor bytes read from checkpoint files (whole checksum blocks)
    bytes_owned: int = 0  # bytes of the target shards this rank filled
    bytes_verified: int = 0  # bytes checksummed: those read (format 2), whole files (format 1)
    files_read: list[str] = field(default_factory=list)
    metadata_bytes: int = 0  # manifest.json and the headers of the files read
    seconds: float = 0.0
    # With strict=False: model keys the checkpoint lacks (left as they were) and checkpoint
    # keys the model lacks (ignored), as nn.Module.load_state_dict reports them.
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)


def read_manifest(path: str) -> Manifest:
    """The published manifest of the checkpoint at ``path``, or a ``CheckpointError`` saying why not."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    directory = CheckpointDir(path)
    manifest = directory.manifest()
    if manifest is not None:
        return manifest
    manifest_path = os.path.join(path, MANIFEST_NAME)
    leftovers = directory.leftovers()
    if leftovers:
        raise CheckpointError(
            f"{manifest_path} is missing: {path} is not a complete checkpoint (found save data {leftovers} "
            "without a manifest). A save was probably interrupted before it was published; load an earlier "
            "checkpoint or save again."
        )
    names = os.listdir(path)
    hint = (
        " It holds safetensors files: if it is a consolidated or Hugging Face folder, read it with "
        "safetensors or transformers."
        if any(n.endswith(".safetensors") for n in names)
        else ""
    )
    raise CheckpointError(f"{path} is not an fsdp2 checkpoint: it has no {MANIFEST_NAME} and no fsdp2 save data.{hint}")


@dataclass
class _Target:
    """A box of one saved tensor that this rank needs, the stored chunks that hold it and, once
    planned, where their bytes are; the fresh buffer comes only when reading."""

    key: str
    entry: TensorEntry
    region: Region
    chunks: list[Chunk]
    sources: list[tuple[StoredChunk, Region]] = field(default_factory=list)
    buffer: torch.Tensor | None = None


def _target_region(value: torch.Tensor) -> Region | None:
    try:
        return local_region(value)
    except LayoutError as e:
        raise CheckpointError(f"cannot load into a DTensor: {e}") from None


class _Plan:
    """Everything one rank will read, decided from metadata before any tensor byte is read."""

    def __init__(self, path: str, manifest: Manifest, files: OpenFiles, verify: bool):
        self.path, self.manifest, self.files, self.verify = path, manifest, files, verify
        self.targets: dict[str, _Target] = {}
        # optimizer state keys to rebuild as DTensors laid out like these templates
        self.dtensor_templates: dict[str, DTensor] = {}
        self._indexes: dict[str, FileIndex] = {}
        manifest.validate_files()

    def entry(self, key: str, hint: str) -> TensorEntry:
        entry = self.manifest.tensors.get(key)
        if entry is None:
            raise CheckpointError(f"{self.path}: checkpoint has no tensor {key!r}. {hint}")
        return entry

    def add(self, key: str, entry: TensorEntry, region: Region | None) -> None:
        if region is None:
            return
        if key in self.manifest.tensors:
            self.manifest.validate_entry(key)  # a rule or chunk list is trusted only once checked
        chunks = self.manifest.chunks_in(key, region) if region.numel else []
        self.targets[key] = _Target(key, entry, region, chunks)

    def needed_files(self) -> list[str]:
        return sorted({c.file for t in self.targets.values() for c in t.chunks})

    def index(self, rel: str) -> FileIndex:
        """Format 3: the index in ``rel``'s header, checked (once per file) against the header's own
        checksum (when verifying) and the manifest's save id."""
        index = self._indexes.get(rel)
        if index is None:
            header = self.files.header(rel)
            if self.verify:
                check_seal(header)
            index = FileIndex.of_header(header)
            if index.save_id != self.manifest.save_id:
                raise CheckpointError(
                    f"{header.path} belongs to another save (id {index.save_id}, the manifest's is "
                    f"{self.manifest.save_id}); restore this save's file or load an earlier checkpoint"
                )
            self._indexes[rel] = index
        return index

    def with_checksums(self, chunk: Chunk) -> Chunk:
        """Format 3: ``chunk`` (placed by its tensor's rule) with the block checksums its file's index
        lists, after checking that the file holds that box."""
        full = self.files.full_path(chunk.file)
        record = chunk_record(self.index(chunk.file), full, chunk.key, chunk.offsets, chunk.shape)
        return chunk.with_checksums(record.block_elems, record.crc32c, record.grid)


def _check_like(path: str, key: str, entry: TensorEntry, value: torch.Tensor) -> None:
    if tuple(value.shape) != entry.shape:
        raise CheckpointError(
            f"{path}: {key!r} has shape {list(entry.shape)} in the checkpoint but {list(value.shape)} in "
            "the model; build the model with the same configuration as the saved one"
        )
    if value.dtype != entry.torch_dtype:
        raise CheckpointError(
            f"{path}: {key!r} has dtype {entry.dtype} in the checkpoint but {value.dtype} in the model; "
            f"convert the model (e.g. model.to({entry.torch_dtype})) before loading, then cast"
        )


def _refuse_meta(path: str, model: nn.Module) -> None:
    name = first_meta_tensor(model)
    if name is not None:
        raise CheckpointError(
            f"{path}: cannot load into {name}: it is on the meta device (it has no storage), so nothing would "
            "be loaded. Call model.to_empty(device=...) first (and initialize what the checkpoint does not "
            "hold, e.g. non-persistent buffers), then load"
        )


def _plan_model(plan: _Plan, model: nn.Module, strict: bool, stats: LoadStats) -> dict[str, torch.Tensor]:
    """The model's state dict entries to fill (strict=False: those the checkpoint has)."""
    sd = model.state_dict()
    missing = [fqn for fqn in sd if model_key(fqn) not in plan.manifest.tensors]
    if missing and strict:
        raise CheckpointError(
            f"{plan.path}: checkpoint has no tensor {model_key(missing[0])!r}"
            f"{f' (and {len(missing) - 1} more model keys)' if len(missing) > 1 else ''}. Is it the checkpoint "
            "of this model? Pass strict=False to load the rest and keep these as they are"
        )
    expected = {model_key(f) for f in sd}
    unexpected = sorted(
        k.removeprefix("model/") for k in plan.manifest.tensors if k.startswith("model/") and k not in expected
    )
    if unexpected and strict:
        raise CheckpointError(
            f"{plan.path}: checkpoint has tensors the model lacks: {unexpected[:10]}; pass strict=False to ignore them"
        )
    stats.missing_keys, stats.unexpected_keys = missing, unexpected
    loaded, skip = {}, set(missing)
    for fqn, value in sd.items():
        if fqn in skip:
            continue
        key = model_key(fqn)
        entry = plan.manifest.tensors[key]
        _check_like(plan.path, key, entry, value)
        region = _target_region(value)
        if region is None:
            continue  # a DTensor on a mesh without this rank: it holds nothing of it
        plan.add(key, entry, region)
        loaded[fqn] = value
    return loaded


def _malformed(path: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: {what} in the manifest is malformed; the checkpoint is damaged or was "
        "not written by fsdp2, load an earlier one"
    )


def _check_optimizer_layout(path: str, saved: Any) -> None:
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not (
        isinstance(groups, list)
        and isinstance(saved.get("state"), dict)
        and all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and all(isinstance(p, str) for p in g["params"])
            for g in groups
        )
    ):
        raise _malformed(path, "the optimizer state")
    for fqn, state in saved["state"].items():
        if not isinstance(state, dict):
            raise _malformed(path, f"the optimizer state of {fqn!r}")


def _few(names: list[str], shown: int = 3) -> str:
    listed = [repr(name) for name in names[:shown]] + (["..."] if len(names) > shown else [])
    return f"({', '.join(listed)})"


def _group_difference(saved: list[list[str]], now: list[list[str]]) -> str:
    """Which parameter names differ between the saved param groups and the optimizer's, a few of
    each kind with their counts."""
    saved_names = {name for group in saved for name in group}
    now_names = {name for group in now for name in group}
    only_saved, only_now = sorted(saved_names - now_names), sorted(now_names - saved_names)
    if only_saved or only_now:
        parts = []
        if only_saved:
            parts.append(f"{len(only_saved)} saved parameters are in none of the optimizer's groups {_few(only_saved)}")
        if only_now:
            parts.append(f"{len(only_now)} of the optimizer's parameters are not in the checkpoint {_few(only_now)}")
        return ", ".join(parts)
    groups = f"saved {len(saved)} param group{'s' * (len(saved) != 1)}, now {len(now)}"
    saved_in = {name: index for index, group in enumerate(saved) for name in group}
    now_in = {name: index for index, group in enumerate(now) for name in group}
    moved = sorted(name for name in saved_names if saved_in[name] != now_in[name])
    if moved:
        shown = ", ".join(f"{name!r} (saved in group {saved_in[name]}, now in {now_in[name]})" for name in moved[:3])
        return f"{groups}: {shown}{', ...' if len(moved) > 3 else ''} ({len(moved)} in other groups)"
    if len(saved) != len(now):
        return groups  # empty groups added or left out
    return "the same parameters in the same groups, some listed more than once"


def _plan_optimizer(plan: _Plan, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    saved = plan.manifest.objects.get("optimizer")
    if saved is None:
        raise CheckpointError(f"{plan.path} holds no optimizer state; load it with optimizer=None")
    _check_optimizer_layout(plan.path, saved)
    saved_type, now_type = saved.get("type"), optimizer_type(optimizer)
    if saved_type is not None and saved_type != now_type:
        raise CheckpointError(
            f"{plan.path} holds {saved_type} state but the optimizer is a {now_type}; create a {saved_type}, or "
            "load the model alone (optimizer=None) and start the new optimizer from scratch"
        )
    current = optimizer_param_fqns(model, optimizer)
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(current) or any(
        sorted(g["params"]) != sorted(c) for g, c in zip(saved_groups, current)
    ):
        raise CheckpointError(
            f"{plan.path}: optimizer param groups differ from the saved ones: "
            f"{_group_difference([g['params'] for g in saved_groups], current)}; "
            "create the optimizer with the same param groups as when saving (to fine-tune with new "
            "parameters, load the model with strict=False and optimizer=None)"
        )
    in_groups = {fqn for group in current for fqn in group}
    params = dict(model.named_parameters())
    for fqn, encoded in saved["state"].items():
        if fqn not in in_groups:
            where = "a parameter of none of the optimizer's param groups" if fqn in params else "an unknown parameter"
            raise CheckpointError(
                f"{plan.path}: optimizer state for {where}, {fqn!r}; the checkpoint is damaged, load an earlier one"
            )
        param = params[fqn]
        prefix = f"optim/state/{fqn}/"
        for key in tensor_refs(encoded, f"{plan.path}: optimizer state of {fqn!r}"):
            entry = plan.entry(key, "The manifest is inconsistent; re-save the checkpoint.")
            name = key[len(prefix) :]
            existing = optimizer.state.get(param, {}).get(name)
            # Lay the state out like the optimizer already has it, else like its parameter
            # when the shapes agree (exp_avg, exp_avg_sq), else whole (step, scalars).
            template = existing if isinstance(existing, torch.Tensor) else None
            if template is None and isinstance(param, DTensor) and tuple(param.shape) == entry.shape:
                template = param
            if isinstance(template, DTensor):
                if tuple(template.shape) != entry.shape:
                    raise CheckpointError(
                        f"{plan.path}: optimizer state {key!r} has shape {list(entry.shape)}, "
                        f"the optimizer's is {list(template.shape)}"
                    )
                plan.add(key, entry, _target_region(template))
                plan.dtensor_templates[key] = template
            else:
                plan.add(key, entry, Region.whole(entry.shape))
    for gi, group in enumerate(saved_groups):
        for key in tensor_refs(group, f"{plan.path}: optimizer param group {gi}"):
            entry = plan.entry(key, "The manifest is inconsistent; re-save the checkpoint.")
            plan.add(key, entry, Region.whole(entry.shape))
    return saved


def _plan_objects(plan: _Plan, encoded: Any, where: str) -> Any:
    """Plan the tensors an encoded object refers to (whole); checks its structure."""
    for key in tensor_refs(encoded, f"{plan.path}: {where}"):
        entry = plan.entry(key, "The manifest is inconsistent; re-save the checkpoint.")
        plan.add(key, entry, Region.whole(entry.shape))
    return encoded


def _plan_rank_extra(plan: _Plan, rank: int, world: int) -> Any:
    """This rank's saved ``rank_extra`` (encoded), or None if there is none for it."""
    manifest = plan.manifest
    saved = manifest.rank_extra if manifest.version >= 3 else manifest.objects.get("rank_extra")
    if not saved:
        return None
    if manifest.version < 3 and not isinstance(saved, dict):
        raise _malformed(plan.path, "rank_extra")
    if manifest.world_size != world:
        warnings.warn(
            f"{plan.path} was saved by {manifest.world_size} ranks and is loaded by {world}: "
            "per-rank extras cannot be matched to ranks, so load returns None for them",
            stacklevel=4,
        )
        return None
    if manifest.version < 3:
        return _plan_objects(plan, saved.get(str(rank)), f"rank_extra of rank {rank}")
    # Format 3: in this rank's own file, object and tensors, listed by that file's index.
    rel = manifest.rank_file(rank)
    index = plan.index(rel)
    encoded = index.rank_extra
    header = plan.files.header(rel)
    for key in tensor_refs(encoded, f"{plan.path}: rank_extra of rank {rank}"):
        info = header.tensors.get(key)
        record = index.chunks.get(key)
        if info is None or record is None or any(record.offsets) or info.dtype is None:
            raise CheckpointError(
                f"{header.path}: rank_extra refers to {key!r}, which the file does not hold whole; the "
                "file is damaged, restore it or load an earlier checkpoint"
            )
        entry = TensorEntry(info.shape, dtype_name(info.dtype))
        chunks = [Chunk(rel, key, record.offsets, info.shape)] if entry.nbytes else []
        plan.targets[key] = _Target(key, entry, Region.whole(info.shape), chunks)
    return encoded


def _verify_files(plan: _Plan, files: list[str], verify: bool, stats: LoadStats) -> None:
    """Formats 1 and 2: each file's size against the manifest's before reading; format 1 also checks
    whole-file CRC-32s here (format 2 checks each block as it is read, in ``_read_targets``).
    Format 3 lists no files: a file's header says what it holds and must cover it exactly."""
    if plan.manifest.version >= 3:
        return
    for rel in files:
        full = checkpoint_file(plan.path, rel)  # a regular file inside the checkpoint, or raises
        expected = plan.manifest.files[rel]
        size = os.path.getsize(full)
        if size != expected.size:
            raise CheckpointError(
                f"{full} is {size} bytes but the manifest says {expected.size}: the file "
                "is truncated or was replaced; restore it or load an earlier checkpoint"
            )
        if verify and plan.manifest.version == 1:
            crc, n = file_crc32(full)
            stats.bytes_verified += n
            if crc != expected.crc32:
                raise CheckpointError(
                    f"{full} is corrupted (crc32 {crc}, manifest says {expected.crc32}); "
                    "restore the file or load an earlier checkpoint"
                )


def _check_headers(plan: _Plan, names: list[str]) -> None:
    """Check each file's safetensors header once per file, before any chunk of it is used (the
    header lists every tensor of the file, so checking it per chunk would cost (tensors in the
    file)^2): format 3 against the checksum it carries and the manifest's save id, format 2 against
    the CRC32C the manifest lists (when verifying)."""
    for rel in names:
        if plan.manifest.version >= 3:
            plan.index(rel)
            continue
        expected = plan.manifest.files[rel].header_crc32c
        if expected is None or not plan.verify:
            continue
        crc = f"{checksum(plan.files.header(rel).raw):08x}"
        if crc != expected:
            raise CheckpointError(
                f"{plan.files.full_path(rel)} is corrupted (crc32c of its header {crc}, manifest "
                f"says {expected}); restore the file or load an earlier checkpoint"
            )


def stored_chunk(files: OpenFiles, entry: TensorEntry, chunk: Chunk, verify: bool) -> StoredChunk:
    """Where ``chunk``'s bytes are, after checking its header entry against the manifest (the header's
    own checksum is :func:`_check_headers`' job)."""
    full = files.full_path(chunk.file)
    info = files.header(chunk.file).info(chunk.key)
    if info.shape != chunk.shape or info.dtype_name != safetensors_dtype(entry.torch_dtype):
        raise CheckpointError(
            f"{full}, key {chunk.key!r}: file holds {info.dtype_name}{list(info.shape)}, "
            f"manifest says {entry.dtype}{list(chunk.shape)}; the checkpoint is damaged"
        )
    dtype = entry.torch_dtype
    checked = verify and chunk.crc32c is not None
    return StoredChunk(
        full,
        files.open(chunk.file)[0],
        info.begin,
        chunk.region,
        dtype,
        f"key {chunk.key!r}",
        chunk.grid(dtype.itemsize) if checked else None,
        chunk.checksums() if checked else None,
    )


def _locate(plan: _Plan, stats: LoadStats) -> None:
    """Where every needed chunk's bytes are (and their block checksums), from the headers of the
    files that hold them; every header and every chunk's entry in it checked first."""
    names = plan.needed_files()
    stats.files_read = names
    _verify_files(plan, names, plan.verify, stats)
    _check_headers(plan, names)
    v3 = plan.manifest.version >= 3
    for t in plan.targets.values():
        for chunk in t.chunks:
            part = chunk.region.intersect(t.region)
            if part is None:
                continue
            if v3:
                chunk = plan.with_checksums(chunk)
            t.sources.append((stored_chunk(plan.files, t.entry, chunk, plan.verify), part))


def _read_targets(plan: _Plan, stats: LoadStats) -> None:
    """One pass: each rank reads the blocks holding its boxes, checks them, fills fresh buffers."""
    reads = ReadPass(verify=plan.verify)
    for t in plan.targets.values():
        t.buffer = fresh_memory.empty(t.region.shape, t.entry.torch_dtype)
        for source, part in t.sources:
            reads.add(source, part, t.buffer[part.slices_within(t.region)])
        stats.bytes_owned += t.buffer.numel() * t.buffer.element_size()
    with ByteProgress("load", plan.path, reads.nbytes) as progress:
        counts = reads.run(progress)
    stats.bytes_read += counts.bytes_read
    stats.bytes_verified += counts.bytes_verified


@dataclass
class _Planned:
    """What :func:`plan_load` decided: the plan and the encoded objects the load will decode."""

    plan: _Plan
    model_sd: dict[str, torch.Tensor]
    saved_optimizer: dict | None
    encoded_extra: Any
    encoded_rank_extra: Any


def plan_load(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    files: OpenFiles,
    *,
    verify: bool = True,
    strict: bool = True,
    return_rank_extra: bool = False,
    stats: LoadStats | None = None,
) -> _Planned:
    """The metadata half of ``load`` on this rank: read and check the manifest, decide the box of every
    tensor to fill, find the stored chunks that hold it, and read and check the headers of their files
    (through ``files``) for where their bytes are. No tensor byte is read, no buffer allocated, nothing
    modified, so a model still on the meta device can be planned (the scale benchmark does)."""
    stats = stats if stats is not None else LoadStats()
    rank, world = _dist.rank_and_world()
    manifest = read_manifest(path)
    plan = _Plan(path, manifest, files, verify)
    model_sd = _plan_model(plan, model, strict, stats)
    saved_optim = _plan_optimizer(plan, model, optimizer) if optimizer is not None else None
    encoded_extra = _plan_objects(plan, manifest.objects.get("extra"), "extra")
    encoded_rank_extra = _plan_rank_extra(plan, rank, world) if return_rank_extra else None
    _locate(plan, stats)
    stats.metadata_bytes = manifest.json_bytes + files.header_bytes()
    return _Planned(plan, model_sd, saved_optim, encoded_extra, encoded_rank_extra)


@dataclass
class _Restored:
    """Everything ``load`` applies, computed before anything is modified."""

    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (model tensor, value read)
    optimizer_state: dict | None
    extra: Any
    rank_extra: Any


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify: bool = True,
    strict: bool = True,
    stats: LoadStats | None = None,
    return_rank_extra: bool = False,
) -> Any:
    """Load a checkpoint into ``model`` (and ``optimizer``); returns the saved ``extra``.

    Works for any saving/loading world sizes and meshes (reshard on load) and for
    plain unsharded models. Collective when torch.distributed is initialized.
    ``verify`` checks the checksum of every block this rank reads, as it reads it, before
    anything is modified (``verify=False`` skips the hashing). On any ``CheckpointError`` the
    model and optimizer are unchanged. Pass a ``LoadStats`` to get byte counts.
    ``strict=False`` loads what the checkpoint has: model keys it lacks stay as they
    are and checkpoint keys the model lacks are ignored (both listed in
    ``stats.missing_keys`` / ``stats.unexpected_keys``, missing ones also warned about).
    ``return_rank_extra=True`` returns ``(extra, rank_extra)``: this rank's
    ``rank_extra`` from ``save``, or None when the world size changed (with a warning)
    or none was saved.
    """
    with gc_pause.paused():  # its objects die by refcount; a full collection would stall every rank
        return _load(os.fspath(path), model, optimizer, verify, strict, stats, return_rank_extra)


def _load(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    verify: bool,
    strict: bool,
    stats: LoadStats | None,
    return_rank_extra: bool,
) -> Any:
    stats = stats if stats is not None else LoadStats()
    start = time.perf_counter()
    error: BaseException | None = None
    try:
        reshard_model(model)
        _refuse_meta(path, model)
        with OpenFiles(path) as files:
            planned = plan_load(
                path,
                model,
                optimizer,
                files,
                verify=verify,
                strict=strict,
                return_rank_extra=return_rank_extra,
                stats=stats,
            )
            _read_targets(planned.plan, stats)
        restored = _restore(
            planned.plan,
            model,
            planned.model_sd,
            optimizer,
            planned.saved_optimizer,
            planned.encoded_extra,
            planned.encoded_rank_extra,
        )
    except CheckpointError as e:
        error = e
    except Exception as e:  # anything unforeseen still goes through the all-ranks agreement
        error = CheckpointError(f"loading {path} failed: {e!r}")
        error.__cause__ = e
    # Nobody modifies anything unless every rank read and decoded everything it needs.
    failure = _dist.first_failure(error)
    if failure is not None:
        stats.seconds = time.perf_counter() - start
        if error is not None:
            raise error
        raise CheckpointError(
            f"loading {path} failed on another rank (rank {failure[0]}: {failure[1]}); nothing was changed"
        )
    if stats.missing_keys:
        warnings.warn(
            f"load({path}, strict=False): the checkpoint has no value for {len(stats.missing_keys)} "
            f"model key(s), left as they were: {stats.missing_keys[:10]}",
            stacklevel=3,
        )
    if optimizer is not None:
        optimizer.load_state_dict(restored.optimizer_state)  # builds its new state, then swaps it in
    with torch.no_grad():
        for dest, value in restored.copies:
            dest.copy_(value)
    stats.seconds = time.perf_counter() - start
    return (restored.extra, restored.rank_extra) if return_rank_extra else restored.extra


def _restore(
    plan: _Plan,
    model: nn.Module,
    model_sd: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    saved_optim: dict | None,
    encoded_extra: Any,
    encoded_rank_extra: Any,
) -> _Restored:
    tensors = {}
    for key, t in plan.targets.items():
        template = plan.dtensor_templates.get(key)
        tensors[key] = (
            compat.dtensor_like(template, t.buffer.to(compat.local_tensor(template).device))
            if template is not None
            else t.buffer
        )
    copies = []
    for fqn, value in model_sd.items():
        dest = value.to_local() if isinstance(value, DTensor) else value
        copies.append((dest, plan.targets[model_key(fqn)].buffer))
    optimizer_state = (
        _optimizer_state_dict(plan.path, optimizer, model, saved_optim, tensors) if optimizer is not None else None
    )
    return _Restored(
        copies,
        optimizer_state,
        decode(encoded_extra, tensors.__getitem__, f"{plan.path}: extra"),
        decode(encoded_rank_extra, tensors.__getitem__, f"{plan.path}: rank_extra"),
    )


def _optimizer_state_dict(
    path: str, optimizer: torch.optim.Optimizer, model: nn.Module, saved: dict, tensors: dict[str, torch.Tensor]
) -> dict:
    """The ``optimizer.load_state_dict`` argument: saved state under the current parameter ids."""
    current = optimizer.state_dict()["param_groups"]
    fqn_groups = optimizer_param_fqns(model, optimizer)
    fqn_to_id = {fqn: pid for g, fqns in zip(current, fqn_groups) for pid, fqn in zip(g["params"], fqns)}
    state = {
        fqn_to_id[fqn]: decode(s, tensors.__getitem__, f"{path}: optimizer state of {fqn!r}")
        for fqn, s in saved["state"].items()
    }
    groups = []
    for gi, (g, now) in enumerate(zip(saved["param_groups"], current)):
        hyper = decode(
            {k: v for k, v in g.items() if k != "params"}, tensors.__getitem__, f"{path}: optimizer param group {gi}"
        )
        # State is keyed by the current ids, so keep the current order (same set, checked).
        groups.append({**hyper, "params": now["params"]})
    return {"state": state, "param_groups": groups}
