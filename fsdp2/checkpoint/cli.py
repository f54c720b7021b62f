"""``python -m fsdp2.checkpoint {inspect,verify,consolidate} PATH ...``

inspect      what a checkpoint holds: tensors, shapes, dtypes, chunks, file sizes
verify       every checksum (per block, or per file for format 1), every chunk present,
             chunks tile each tensor (fsdp2.checkpoint.verify)
consolidate  full tensors as Hugging Face style sharded safetensors + index.json,
             one tensor in memory at a time; --config copies config.json and
             tokenizer files so that from_pretrained loads the folder

Bad input (a damaged or crafted checkpoint, a missing file) prints "error: ..." and
exits 2; verify exits 1 when it found problems.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Sequence

from .consolidate import DTYPES, consolidate
from .errors import CheckpointError
from .paths import checkpoint_file
from .reader import read_manifest
from .verify import verify_checkpoint

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


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


def _disk_size(path: str, rel: str) -> int | None:
    try:
        return os.path.getsize(checkpoint_file(path, rel))
    except (CheckpointError, OSError):
        return None


def cmd_inspect(args) -> int:
    m = read_manifest(args.path)
    print(
        f"{args.path}: fsdp2 checkpoint, format {m.version}, generation {m.generation}, saved by {m.world_size} rank(s)"
    )
    if m.version >= 3:  # files named by rule: their sizes are on disk, their checksums in their headers
        m.validate_files()
        sizes = {name: _disk_size(args.path, name) for name in m.file_names()}
        total = sum(n for n in sizes.values() if n is not None)
        print(f"files ({len(sizes)}, {_human(total)}):")
        for name, size in sizes.items():
            print(f"  {name}  {'missing' if size is None else _human(size)}")
    else:
        total = sum(f.size for f in m.files.values())
        print(f"files ({len(m.files)}, {_human(total)}):")
        for name, f in m.files.items():
            check = f"crc32={f.crc32}" if f.crc32 is not None else f"header crc32c={f.header_crc32c}"
            print(f"  {name}  {_human(f.size)}  {check}")
    print(f"tensors ({len(m.tensors)}):")
    for key, t in m.tensors.items():
        try:
            size = _human(t.nbytes)
        except CheckpointError:
            size = "unknown dtype"
        try:
            m.validate_entry(key)
            chunks = m.chunks_of(key)
        except CheckpointError as e:
            print(f"  {key}  {t.dtype}{list(t.shape)}  {size}  {e}")
            continue
        layout = ""
        if t.rule is not None:
            layout = f"  mesh {list(t.rule.mesh.shape)} {', '.join(t.rule.placement_names()) or 'whole'}"
        print(f"  {key}  {t.dtype}{list(t.shape)}  {size}{layout}  {len(chunks)} chunk(s)")
        if args.chunks:
            for c in chunks:
                print(f"      {c.file}[{c.key}] offsets={list(c.offsets)} shape={list(c.shape)}")
    optim = m.objects.get("optimizer")
    groups = optim.get("param_groups") if isinstance(optim, dict) else None
    if isinstance(groups, list) and isinstance(optim.get("state"), dict):
        kind = f" ({optim['type']})" if isinstance(optim.get("type"), str) else ""
        print(f"optimizer: {len(groups)} param group(s), state for {len(optim['state'])} param(s){kind}")
        for i, g in enumerate(groups):
            if isinstance(g, dict):
                hyper = {k: v for k, v in g.items() if k != "params"}
                print(f"  group {i}: {len(g.get('params') or [])} params, {json.dumps(hyper)}")
    elif optim is not None:
        print("optimizer: malformed entry in the manifest")
    if "extra" in m.objects:
        print(f"extra: {json.dumps(m.objects['extra'])[:400]}")
    if m.rank_extra:
        print("rank_extra: in each rank's file")
    elif isinstance(m.objects.get("rank_extra"), dict):
        print(f"rank_extra: saved by {len(m.objects['rank_extra'])} rank(s)")
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


def cmd_consolidate(args) -> int:
    index = consolidate(
        args.path,
        args.out,
        args.max_shard_size,
        args.all,
        not args.no_verify,
        config=args.config,
        dtype=args.dtype,
        overwrite=args.overwrite,
    )
    files = sorted(set(index["weight_map"].values()))
    print(
        f"wrote {len(index['weight_map'])} tensors ({_human(index['metadata']['total_size'])}) "
        f"in {len(files)} file(s) to {args.out}"
    )
    if args.config is None:
        print(
            "note: no config.json written; pass --config (the model's config.json or its Hugging Face "
            "folder) to make the folder loadable with from_pretrained"
        )
    return 0


# ---------------------------------------------------------------- entry point


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fsdp2.checkpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    con.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=parse_size("2GB"),
        help="largest output file (default 2GB; a bigger single tensor gets its own file)",
    )
    con.add_argument(
        "--all", action="store_true", help="include optimizer and extra tensors under their checkpoint keys"
    )
    con.add_argument("--no-verify", action="store_true", help="skip checksum verification first")
    con.add_argument(
        "--config",
        metavar="PATH",
        help="the model's config.json, or its Hugging Face folder (config and tokenizer files "
        "are copied), so that from_pretrained(OUT) loads the result",
    )
    con.add_argument("--dtype", choices=sorted(DTYPES), help="convert floating-point tensors (and the config)")
    con.add_argument("--overwrite", action="store_true", help="replace weight files already in OUT")
    con.set_defaults(run=cmd_consolidate)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
