"""``consolidate``: a checkpoint's full tensors as a Hugging Face model folder.

    out/model-00001-of-00003.safetensors ...   full tensors, assembled one at a time
    out/model.safetensors.index.json           which file holds which tensor
    out/config.json, tokenizer files           copied from the user's model folder (``config=``)

With the model's ``config.json`` (and state-dict names that are Hugging Face's, e.g. a
``transformers`` model trained with fsdp2) ``AutoModelForCausalLM.from_pretrained(out)``
loads the folder with no hand step. Weights that are one tensor in the model (a head tied
to the embedding) are written once, under the first state-dict name, as ``save_pretrained``
does. Everything is checked before anything is written.

Every output file is written into a fresh temporary folder -- next to ``out``, or inside it when
it exists -- and moved into place only once all of them are written: a new ``out`` is that
folder renamed, an existing one gets each file renamed over its final name. So a failure (a full
disk) leaves ``out`` as it was, and a name that already exists -- a symlink included, as in a
Hugging Face snapshot folder, whose files link into the cache's blobs/ -- is replaced, never
written through: no file outside ``out`` is ever changed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil

import torch

from fsdp2.tools.progress import ByteProgress

from .errors import CheckpointError
from .format import Manifest, TensorEntry
from .paths import checkpoint_file
from .reader import read_manifest
from .safetensors_io import SafetensorsStreamWriter, TensorSpec
from .verify import verify_checkpoint

INDEX_NAME = "model.safetensors.index.json"
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
# Files of a Hugging Face model folder that are not weights: copied along with config.json.
_MODEL_FOLDER_FILES = re.compile(
    r"config\.json|generation_config\.json|tokenizer[^/]*|special_tokens_map\.json|added_tokens\.json"
    r"|vocab\.(json|txt)|merges\.txt|[^/]*\.model|chat_template\.[^/]*|preprocessor_config\.json"
)
# Weight files a folder may hold already; an export must not be mixed with them.
_WEIGHT_FILES = re.compile(r".*\.safetensors|.*\.safetensors\.index\.json|pytorch_model.*\.bin(\.index\.json)?")


def consolidate(
    path: str,
    out: str,
    max_shard_size: int = 2 * 10**9,
    include_all: bool = False,
    verify: bool = True,
    *,
    config: str | None = None,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
) -> dict:
    """Write the full tensors of the checkpoint at ``path`` to the folder ``out``; returns the index.

    ``config``: the model's ``config.json``, or a Hugging Face model folder whose config and
    tokenizer files are copied. ``dtype`` ("bf16", "fp16", "fp32" or a torch dtype) converts
    floating-point tensors (and the config's ``torch_dtype``). ``include_all`` adds optimizer
    and ``extra`` tensors under their checkpoint keys. A folder that already holds weight
    files is refused unless ``overwrite``, which replaces them.
    """
    manifest = read_manifest(path)
    if verify:
        problems = verify_checkpoint(path)
        if problems:
            raise CheckpointError(f"{path} failed verification: {problems[0]} (and {len(problems) - 1} more)")
    else:
        manifest.validate()
    out_dtype = _dtype(dtype)
    copies = _config_files(config)
    stale = _check_output(path, out, overwrite)
    entries = _entries(manifest, include_all)

    with _staging_folder(out) as staging:
        index = _write_shards(path, manifest, staging, entries, max_shard_size, out_dtype)
        for source, name in copies:
            final = os.path.join(out, name)
            if os.path.exists(final) and os.path.samefile(source, final) and out_dtype is None:
                continue  # the config already lives in the output folder
            _copy_config_file(source, os.path.join(staging, name), out_dtype)
        _publish(staging, out, stale - set(index["weight_map"].values()) - {INDEX_NAME})
    return index


# ---------------------------------------------------------------- checks (nothing written yet)


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and dtype not in DTYPES.values():
            raise CheckpointError(f"dtype {dtype} is not one of {sorted(set(DTYPES.values()), key=str)}")
        return dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _config_files(config: str | None) -> list[tuple[str, str]]:
    """(source, name in the output) of the config and tokenizer files to copy."""
    if config is None:
        return []
    if os.path.isdir(config):
        names = sorted(
            n
            for n in os.listdir(config)
            if _MODEL_FOLDER_FILES.fullmatch(n) and os.path.isfile(os.path.join(config, n))
        )
        if "config.json" not in names:
            raise CheckpointError(f"{config} has no config.json; pass the model's config.json or its folder")
        copies = [(os.path.join(config, n), n) for n in names]
    elif os.path.isfile(config):
        copies = [(config, "config.json")]
    else:
        raise CheckpointError(f"config {config} does not exist; pass the model's config.json or its folder")
    source = copies[[n for _, n in copies].index("config.json")][0]
    try:
        with open(source) as f:
            parsed = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{source} is not a readable JSON model config ({e})") from None
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{source} is not a JSON object, so not a model config")
    return copies


def _check_output(path: str, out: str, overwrite: bool) -> set[str]:
    """Refuse an output folder inside the checkpoint or holding other weights; the names to replace."""
    real_out, real_path = os.path.realpath(out), os.path.realpath(path)
    if os.path.commonpath([real_out, real_path]) == real_path:
        raise CheckpointError(f"output folder {out} is inside the checkpoint {path}; write it elsewhere")
    if not os.path.exists(out):
        return set()
    if not os.path.isdir(out):
        raise CheckpointError(f"output {out} exists and is not a folder")
    weights = {n for n in os.listdir(out) if _WEIGHT_FILES.fullmatch(n)}
    if weights and not overwrite:
        raise CheckpointError(
            f"{out} already holds weight files ({sorted(weights)[:3]}...); mixing them with "
            "this export would load wrong weights. Choose an empty folder or pass "
            "overwrite=True (--overwrite) to replace them"
        )
    return weights


def _entries(manifest: Manifest, include_all: bool) -> list[tuple[str, str, TensorEntry]]:
    """(output name, checkpoint key, entry) of every tensor to write, tied aliases left out."""
    ties = manifest.objects.get("tied_weights", [])
    if not (isinstance(ties, list) and all(isinstance(g, list) and all(isinstance(n, str) for n in g) for g in ties)):
        raise CheckpointError("the manifest's tied_weights are malformed; the checkpoint is damaged")
    aliases = {f"model/{name}" for group in ties for name in group[1:]}
    keys = sorted(k for k in manifest.tensors if k not in aliases and (include_all or k.startswith("model/")))
    return [(k if include_all else k.removeprefix("model/"), k, manifest.tensors[k]) for k in keys]


# ---------------------------------------------------------------- writing


def _assemble(manifest: Manifest, key: str, handle) -> torch.Tensor:
    """The full tensor, filled chunk by chunk from the rank files."""
    entry = manifest.tensors[key]
    out = torch.empty(entry.shape, dtype=entry.torch_dtype)
    for c in manifest.chunks_of(key):
        part = handle(c.file).get_tensor(c.key)
        out[c.region.slices()] = part
        del part
    return out


def _plan_output_files(entries: list[tuple[str, str, TensorEntry]], max_bytes: int) -> list[list]:
    groups: list[list] = [[]]
    size = 0
    for name, key, entry in entries:
        if groups[-1] and size + entry.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, key, entry))
        size += entry.nbytes
    return groups


def _write_shards(
    path: str,
    manifest: Manifest,
    out: str,
    entries: list[tuple[str, str, TensorEntry]],
    max_shard_size: int,
    out_dtype: torch.dtype | None,
) -> dict:
    """The shard files and the index, written into the (fresh, empty) folder ``out``."""
    from safetensors import safe_open

    def target_dtype(entry: TensorEntry) -> torch.dtype:
        return out_dtype if out_dtype is not None and entry.torch_dtype.is_floating_point else entry.torch_dtype

    groups = _plan_output_files(entries, max_shard_size)
    weight_map, total = {}, 0
    with contextlib.ExitStack() as stack:
        progress = stack.enter_context(
            ByteProgress(
                "consolidate", path, sum(TensorSpec(n, target_dtype(e), e.shape).nbytes for n, _, e in entries)
            )
        )
        handles = {}

        def handle(rel):
            if rel not in handles:
                handles[rel] = stack.enter_context(safe_open(checkpoint_file(path, rel), framework="pt"))
            return handles[rel]

        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            specs = [TensorSpec(n, target_dtype(e), e.shape) for n, _, e in group]
            writer = SafetensorsStreamWriter(os.path.join(out, fname), specs, metadata={"format": "pt"})
            try:
                for (name, key, _), spec in zip(group, specs):
                    writer.write(_assemble(manifest, key, handle).to(spec.dtype))  # one full tensor in RAM at a time
                    weight_map[name] = fname
                    total += spec.nbytes
                    progress.advance(spec.nbytes)
                writer.close()
            except BaseException:
                writer.abort()  # closed, so deleting the staging folder frees the space
                raise
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out, INDEX_NAME), "w") as f:
        json.dump(index, f, indent=2)
    return index


@contextlib.contextmanager
def _staging_folder(out: str):
    """A fresh folder on ``out``'s file system for every output file; deleted if the block fails."""
    out = os.path.abspath(out)
    if os.path.isdir(out):
        staging = os.path.join(out, f".fsdp2-consolidate-{secrets.token_hex(4)}.tmp")
    else:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        staging = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.{secrets.token_hex(4)}.tmp")
    os.mkdir(staging)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _publish(staging: str, out: str, stale: set[str]) -> None:
    """Move the files written in ``staging`` into ``out`` (renames: no space needed, nothing written
    through a symlink), then delete the ``stale`` weight files of an earlier export."""
    out = os.path.abspath(out)
    if not os.path.isdir(out):
        os.rename(staging, out)
        return
    names = sorted(os.listdir(staging), key=lambda name: name == INDEX_NAME)  # the index last
    for name in names:
        os.replace(os.path.join(staging, name), os.path.join(out, name))
    os.rmdir(staging)
    for name in stale:
        os.remove(os.path.join(out, name))


def _copy_config_file(source: str, dest: str, out_dtype: torch.dtype | None) -> None:
    if os.path.basename(dest) != "config.json" or out_dtype is None:
        shutil.copyfile(source, dest)
        return
    with open(source) as f:
        config = json.load(f)
    name = str(out_dtype).removeprefix("torch.")
    # transformers reads "torch_dtype" (and, since 4.56, "dtype"): say what the files hold.
    for key in [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]:
        config[key] = name
    with open(dest, "w") as f:
        json.dump(config, f, indent=2)
