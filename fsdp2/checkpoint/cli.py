"""``python -m fsdp2.checkpoint {inspect,verify,consolidate} PATH ...``

inspect      what a checkpoint holds: tensors, shapes, dtypes, chunks, file sizes
verify       every checksum (per block, or per file for format 1), every chunk present,
             chunks tile each tensor (fsdp2.checkpoint.verify)
consolidate  full tensors as Hugging Face style sharded safetensors + index.json,
             one tensor in memory at a time
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from typing import Sequence

import torch

from .errors import CheckpointError
from .format import TensorEntry
from .reader import read_manifest
from .safetensors_io import SafetensorsStreamWriter, TensorSpec
from .verify import verify_checkpoint

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 2GB, 500MB, 1GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


# ---------------------------------------------------------------- inspect


def cmd_inspect(args) -> int:
    m = read_manifest(args.path)
    total = sum(f.size for f in m.files.values())
    print(f"{args.path}: fsdp2 checkpoint, generation {m.generation}, saved by {m.world_size} rank(s)")
    print(f"files ({len(m.files)}, {_human(total)}):")
    for name, f in m.files.items():
        check = f"crc32={f.crc32}" if f.crc32 is not None else f"header crc32c={f.header_crc32c}"
        print(f"  {name}  {_human(f.size)}  {check}")
    print(f"tensors ({len(m.tensors)}):")
    for key, t in m.tensors.items():
        print(f"  {key}  {t.dtype}{list(t.shape)}  {_human(t.nbytes)}  {len(t.chunks)} chunk(s)")
        if args.chunks:
            for c in t.chunks:
                print(f"      {c.file}[{c.key}] offsets={list(c.offsets)} shape={list(c.shape)}")
    optim = m.objects.get("optimizer")
    if optim is not None:
        print(f"optimizer: {len(optim['param_groups'])} param group(s), state for {len(optim['state'])} param(s)")
        for i, g in enumerate(optim["param_groups"]):
            hyper = {k: v for k, v in g.items() if k != "params"}
            print(f"  group {i}: {len(g['params'])} params, {json.dumps(hyper)}")
    if "extra" in m.objects:
        print(f"extra: {json.dumps(m.objects['extra'])[:400]}")
    return 0


# ---------------------------------------------------------------- verify


def cmd_verify(args) -> int:
    problems = verify_checkpoint(args.path)
    for p in problems:
        print(f"FAIL {p}")
    if problems:
        print(f"{args.path}: {len(problems)} problem(s)")
        return 1
    print(f"{args.path}: OK")
    return 0


# ---------------------------------------------------------------- consolidate


def _assemble(path: str, entry: TensorEntry, handle) -> torch.Tensor:
    """The full tensor, filled chunk by chunk from the rank files."""
    out = torch.empty(entry.shape, dtype=entry.torch_dtype)
    for c in entry.chunks:
        part = handle(c.file).get_tensor(c.key)
        out[c.region.slices()] = part
        del part
    return out


def _plan_output_files(entries: list[tuple[str, TensorEntry]], max_bytes: int) -> list[list]:
    groups: list[list] = [[]]
    size = 0
    for name, entry in entries:
        if groups[-1] and size + entry.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, entry))
        size += entry.nbytes
    return groups


def consolidate(path: str, out: str, max_shard_size: int = 2 * 10**9, include_all: bool = False,
                verify: bool = True) -> dict:
    """Write full tensors in Hugging Face sharded layout; returns the index dict."""
    from safetensors import safe_open

    m = read_manifest(path)
    if verify:
        problems = verify_checkpoint(path)
        if problems:
            raise CheckpointError(f"{path} failed verification: {problems[0]} (and {len(problems) - 1} more)")
    else:
        m.validate()
    if include_all:
        entries = sorted(m.tensors.items())
    else:
        entries = sorted((k.removeprefix("model/"), t) for k, t in m.tensors.items() if k.startswith("model/"))
    groups = _plan_output_files(entries, max_shard_size)
    os.makedirs(out, exist_ok=True)
    weight_map, total = {}, 0
    with contextlib.ExitStack() as stack:
        handles = {}

        def handle(rel):
            if rel not in handles:
                handles[rel] = stack.enter_context(safe_open(os.path.join(path, rel), framework="pt"))
            return handles[rel]

        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            writer = SafetensorsStreamWriter(os.path.join(out, fname),
                                             [TensorSpec(n, e.torch_dtype, e.shape) for n, e in group],
                                             metadata={"format": "pt"})
            for name, entry in group:
                writer.write(_assemble(path, entry, handle))  # one full tensor in RAM at a time
                weight_map[name] = fname
                total += entry.nbytes
            writer.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return index


def cmd_consolidate(args) -> int:
    index = consolidate(args.path, args.out, args.max_shard_size, args.all, not args.no_verify)
    files = sorted(set(index["weight_map"].values()))
    print(f"wrote {len(index['weight_map'])} tensors ({_human(index['metadata']['total_size'])}) "
          f"in {len(files)} file(s) to {args.out}")
    return 0


# ---------------------------------------------------------------- entry point


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fsdp2.checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="list tensors, shapes, dtypes, chunks and files")
    ins.add_argument("path")
    ins.add_argument("--chunks", action="store_true", help="also list every chunk of every tensor")
    ins.set_defaults(run=cmd_inspect)
    ver = sub.add_parser("verify", help="check checksums and chunk tiling; exit 1 on any problem")
    ver.add_argument("path")
    ver.set_defaults(run=cmd_verify)
    con = sub.add_parser("consolidate", help="write full tensors as HF-style sharded safetensors")
    con.add_argument("path")
    con.add_argument("out")
    con.add_argument("--max-shard-size", type=parse_size, default=parse_size("2GB"),
                     help="largest output file (default 2GB; a bigger single tensor gets its own file)")
    con.add_argument("--all", action="store_true",
                     help="include optimizer and extra tensors under their checkpoint keys")
    con.add_argument("--no-verify", action="store_true", help="skip checksum verification first")
    con.set_defaults(run=cmd_consolidate)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
