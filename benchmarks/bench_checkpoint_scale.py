"""Checkpoint metadata at 1,024-16,384 ranks without a cluster: fsdp2 against DCP, simulated.

    python benchmarks/bench_checkpoint_scale.py        # Llama-3-8B + AdamW at 1,024 / 4,096 / 16,384 ranks
    python benchmarks/bench_checkpoint_scale.py --model gpt-small --sizes 8,16 --repeats 1   # a quick look

The state: a model of ``fsdp2.plan``'s presets (default ``llama3-8b``: 291 parameters) sharded with
fsdp2's ``fully_shard`` on a 1-D mesh of N ranks, plus its AdamW state (exp_avg and exp_avg_sq
sharded like the parameters, a scalar step each: 1,164 tensors), all on the meta device: no tensor
byte exists, is written or is read. One process plays one rank of a fake process group of N ranks
(collectives do nothing). Both libraries get the same flat state (fsdp2's keys).

Each measurement runs in a fresh process (its peak memory is its own):

- commit on rank 0. fsdp2: describe every tensor by its rule, merge (no sidecar: rank 0 describes
  every tensor of an FSDP mesh), check and write ``manifest.json`` (fsynced). DCP: its coordinator's
  ``DefaultSavePlanner.create_global_plan`` over every rank's local plan, then the ``Metadata`` its
  ``FileSystemWriter.finish`` builds (storage_data: one entry per chunk), pickled to ``.metadata``
  (fsynced). Rank 0's local plan is DCP's own; the other ranks' are that plan with each rank's chunk
  boxes, made before the clock starts (as is the gather that would bring them to rank 0, not
  counted: DCP's figure is a lower bound).
- load plan of one rank (rank N/2: it reads its own file and rank 0's, which holds the steps).
  fsdp2: ``fsdp2.checkpoint.reader.plan_load``: the manifest, then the headers of the files it needs
  (their sparse files hold the headers the writer would write, with placeholder checksums), every
  check a verified load makes, up to the byte ranges to read. DCP: unpickle ``.metadata`` and
  ``DefaultLoadPlanner.create_local_plan``.
- metadata bytes a rank reads: fsdp2, ``LoadStats.metadata_bytes`` (manifest + headers); DCP, its
  ``.metadata``.
- peak memory: growth of the process's peak resident set during the load plan (``VmHWM``, reset
  through ``/proc/self/clear_refs``).

The table gives CPU seconds (this process's, fsync waits excluded: both sides fsync once), which
other jobs on a shared machine disturb less than wall-clock seconds (printed below it). fsdp2's
commit and load plan run with Python's automatic garbage collection paused, as ``save`` and
``load`` run them; DCP's as DCP runs them. fsdp2's times are medians of --repeats rounds, each
size's commit and plan once per round, sizes in a shuffled order, each size's two processes kept
between rounds (so other jobs' load hits every size alike); DCP's are one run each. DCP's simulation holds every
rank's plan and the whole ``Metadata`` in memory (about 2.3 GB at 1,024 ranks for the 8B state,
growing with N): a size whose estimate exceeds the machine's available memory is not run, and its
DCP figures are extrapolated linearly from the two largest sizes run, marked ``~``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SAVE_ID = "0123456789abcdef"


# ---------------------------------------------------------------- one simulated rank


def _as_rank(rank: int, world: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _sharded_state(preset: str, world: int):
    """The meta model sharded with fully_shard on a 1-D mesh of ``world`` ranks, its AdamW with state."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2 import fully_shard
    from fsdp2.models import GPT, Llama, LlamaConfig
    from fsdp2.plan.model_source import PRESETS

    config = PRESETS[preset]
    with torch.device("meta"):
        model = Llama(config) if isinstance(config, LlamaConfig) else GPT(config)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        optimizer.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.empty_like(p),
            "exp_avg_sq": torch.empty_like(p),
        }
    return model, optimizer


def _flat(model, optimizer):
    from fsdp2.checkpoint.state import flatten

    return flatten(model, optimizer, None)


class _Clock:
    """Wall and CPU seconds (this process's, all threads) of a block: on a machine shared with other
    jobs, CPU time is the work done and wall time includes waiting for a core."""

    def __enter__(self) -> "_Clock":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    def figures(self) -> dict:
        return {"seconds": self.wall, "cpu_seconds": self.cpu}


def _peak_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _write_rank_header(path: str, rank: int, shards) -> None:
    """Rank ``rank``'s file as a sparse file: the header fsdp2's writer would write (placeholder
    checksums, sealed), then no data (a hole as long as the shards)."""
    from fsdp2.checkpoint import writer
    from fsdp2.checkpoint.file_index import seal
    from fsdp2.checkpoint.format import rank_file_name
    from fsdp2.checkpoint.safetensors_io import TensorSpec, safetensors_header

    index, _ = writer.rank_file_index(shards, SAVE_ID, None)
    specs = [TensorSpec(s.key, s.dtype, s.region.shape) for s in shards]
    header = seal(safetensors_header(specs, index.metadata()))
    name = os.path.join(path, "gen-000001", rank_file_name(rank))
    with open(name, "wb") as f:
        f.write(header)
        f.truncate(len(header) + sum(spec.nbytes for spec in specs))


class Fsdp2Commit:
    """Rank 0 of a fake world of ``world`` ranks: its state, its own file's header; each call is one
    commit (timed: describe every tensor, merge, check, write and fsync the manifest)."""

    def __init__(self, preset: str, world: int, path: str):
        _as_rank(0, world)
        self.world, self.path = world, path
        model, optimizer = _sharded_state(preset, world)
        self.flat = _flat(model, optimizer)
        os.makedirs(os.path.join(path, "gen-000001"), exist_ok=True)
        self()
        _write_rank_header(path, 0, self.shards)

    def __call__(self) -> dict:
        from fsdp2.checkpoint import gc_pause, writer
        from fsdp2.checkpoint.directory import write_durably

        with _Clock() as clock, gc_pause.paused():  # as save runs
            self.shards, described = writer.plan_local_shards(self.flat.tensors, 0)
            manifest = writer.build_manifest(self.path, 1, self.world, self.flat.objects, described, 0, SAVE_ID, False)
            text = manifest.to_json()
            write_durably(os.path.join(self.path, "manifest.json"), text)
        return {**clock.figures(), "manifest_bytes": len(text.encode()), "tensors": len(manifest.tensors)}


class Fsdp2Plan:
    """Rank ``rank`` of a fake world (its own file's header written); each call plans its load from the
    manifest and the headers of the files it needs (timed; peak memory at the first call)."""

    def __init__(self, preset: str, world: int, rank: int, path: str):
        from fsdp2.checkpoint import writer

        _as_rank(rank, world)
        self.path = path
        self.model, self.optimizer = _sharded_state(preset, world)
        if rank != 0:
            shards, _ = writer.plan_local_shards(_flat(self.model, self.optimizer).tensors, rank)
            _write_rank_header(path, rank, shards)
        self.peak = None

    def __call__(self) -> dict:
        from fsdp2.checkpoint import gc_pause
        from fsdp2.checkpoint.reader import LoadStats, plan_load
        from fsdp2.checkpoint.tensor_reader import OpenFiles

        measured = self.peak is None and _peak_reset()
        before = _vm("VmRSS")
        stats = LoadStats()
        with _Clock() as clock, gc_pause.paused(), OpenFiles(self.path) as files:  # as load plans: gc paused
            planned = plan_load(self.path, self.model, self.optimizer, files, verify=True, stats=stats)
        if measured:
            self.peak = _vm("VmHWM") - before
        del planned
        return {
            **clock.figures(),
            "peak_bytes": self.peak,
            "metadata_bytes": stats.metadata_bytes,
            "files": len(stats.files_read),
        }


def _dcp_state_of(preset: str, world: int):
    model, optimizer = _sharded_state(preset, world)
    return _flat(model, optimizer).tensors


def dcp_commit(preset: str, world: int, path: str) -> dict:
    """DCP's coordinator: global plan over every rank's local plan, Metadata pickled (timed)."""
    import gc
    import pickle

    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
    from torch.distributed.tensor import Shard

    from fsdp2.layout.regions import shard_region

    _as_rank(0, world)
    planner = DefaultSavePlanner()
    planner.set_up_planner(_dcp_state_of(preset, world), is_coordinator=True)
    own = planner.create_local_plan()
    plans = [own]
    for rank in range(1, world):  # every rank's plan: rank 0's items, with that rank's boxes
        items = []
        for item in own.items:
            data = item.tensor_data
            if item.type == WriteItemType.SHARD and len(data.size):
                box = shard_region(tuple(data.size), (world,), (rank,), [Shard(0)])
                offsets = torch.Size(box.offsets)
                chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(box.shape))
                item = WriteItem(
                    index=MetadataIndex(item.index.fqn, offsets),
                    type=item.type,
                    tensor_data=type(data)(chunk=chunk, properties=data.properties, size=data.size),
                )
            items.append(item)
        plans.append(SavePlan(items, planner_data=own.planner_data))
    gc.collect()
    with _Clock() as clock:
        global_plan, metadata = planner.create_global_plan(plans)
        metadata.storage_data = {
            item.index: _StorageInfo(f"__{rank}_0.distcp", 0, 0)
            for rank, plan in enumerate(global_plan)
            for item in plan.items
        }
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            os.fsync(f.fileno())
    chunks = sum(len(md.chunks) for md in metadata.state_dict_metadata.values() if hasattr(md, "chunks"))
    return {
        **clock.figures(),
        "manifest_bytes": os.path.getsize(os.path.join(path, ".metadata")),
        "chunks": chunks,
        "peak_rss": _vm("VmHWM"),
    }


def dcp_plan(preset: str, world: int, rank: int, path: str) -> dict:
    """One rank plans its load with DCP: unpickle .metadata, create its local plan (timed, peak memory)."""
    import pickle

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    _as_rank(rank, world)
    state = _dcp_state_of(preset, world)
    measured = _peak_reset()
    before = _vm("VmRSS")
    with _Clock() as clock:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            metadata = pickle.load(f)
        planner = DefaultLoadPlanner()
        planner.set_up_planner(state, metadata, is_coordinator=False)
        plan = planner.create_local_plan()
    return {
        **clock.figures(),
        "peak_bytes": _vm("VmHWM") - before if measured else None,
        "metadata_bytes": os.path.getsize(os.path.join(path, ".metadata")),
        "items": len(plan.items),
    }


# ---------------------------------------------------------------- driver


def _leave_world() -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import debug

    dist.destroy_process_group()
    # DTensor caches sharding decisions per (equal) mesh: the next world must not get this one's.
    getattr(debug, "_clear_sharding_prop_cache", debug._clear_python_sharding_prop_cache)()


def _measure(in_process: bool, fn, *args):
    """``fn(*args)`` in a fresh process, or here (quick, but then peak memory includes earlier work)."""
    if not in_process:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            return pool.submit(fn, *args).result()
    try:
        return fn(*args)
    finally:
        _leave_world()


def _serve(conn, kind, args) -> None:
    """A worker process: build ``kind(*args)``, then call it once per request until told to stop."""
    measure = kind(*args)
    conn.send("ready")
    while conn.recv():
        conn.send(measure())


class _Worker:
    def __init__(self, kind, *args):
        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs, kind, args), daemon=True)
        self.process.start()
        if self.conn.recv() != "ready":
            raise RuntimeError(f"{kind.__name__}{args} did not start")

    def __call__(self) -> dict:
        self.conn.send(True)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(False)
        self.process.join()


def fsdp2_rounds(preset: str, sizes: list[int], repeats: int, root: str, in_process: bool) -> dict[int, dict]:
    """fsdp2's commit and load plan at every size: ``repeats`` rounds, each size once per round in a
    shuffled order (its workers kept between rounds), so the load of other jobs hits every size
    alike; medians. In process: one size after the other."""
    import random

    runs = {n: {"commit": [], "plan": []} for n in sizes}
    paths = {n: os.path.join(root, f"fsdp2-{n}") for n in sizes}
    if in_process:
        for n in sizes:
            for kind, args, name in (
                (Fsdp2Commit, (preset, n, paths[n]), "commit"),
                (Fsdp2Plan, (preset, n, n // 2, paths[n]), "plan"),
            ):
                measure = kind(*args)
                runs[n][name] = [measure() for _ in range(repeats)]
                _leave_world()
    else:
        workers = {}
        try:
            for n in sizes:
                workers[n] = (
                    _Worker(Fsdp2Commit, preset, n, paths[n]),
                    _Worker(Fsdp2Plan, preset, n, n // 2, paths[n]),
                )
            for round_ in range(repeats):
                order = list(sizes)
                random.Random(round_).shuffle(order)
                for n in order:
                    runs[n]["commit"].append(workers[n][0]())
                    runs[n]["plan"].append(workers[n][1]())
        finally:
            for pair in workers.values():
                for worker in pair:
                    worker.close()
    out = {}
    for n, kinds in runs.items():
        out[n] = {}
        for name, results in kinds.items():
            summary = dict(results[0])
            for clock in ("seconds", "cpu_seconds"):
                summary[clock] = statistics.median(r[clock] for r in results)
            out[n][name] = summary
    return out


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _extrapolate(points: dict[int, float], n: int) -> float:
    """Linear in N through the two largest sizes measured."""
    (n0, y0), (n1, y1) = sorted(points.items())[-2:]
    return y1 + (y1 - y0) / (n1 - n0) * (n - n1)


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.2f}"


def run(preset: str, sizes: list[int], repeats: int, with_dcp: bool, root: str, in_process: bool = False) -> list[dict]:
    rows, dcp_peak_rss, skipped = [], {}, []
    fsdp2 = fsdp2_rounds(preset, sizes, repeats, root, in_process)
    for n in sizes:
        row = {
            "n": n,
            "fsdp2_commit": fsdp2[n]["commit"],
            "fsdp2_plan": fsdp2[n]["plan"],
            "dcp_commit": None,
            "dcp_plan": None,
        }
        if with_dcp:
            need = _extrapolate(dcp_peak_rss, n) if len(dcp_peak_rss) >= 2 else None
            if need is None and dcp_peak_rss:
                ((n0, rss0),) = dcp_peak_rss.items()
                need = rss0 * n / n0
            if need is not None and need > 0.8 * _available_bytes():
                skipped.append((n, need))
            else:
                dcp_path = os.path.join(root, f"dcp-{n}")
                os.makedirs(dcp_path, exist_ok=True)
                row["dcp_commit"] = _measure(in_process, dcp_commit, preset, n, dcp_path)
                dcp_peak_rss[n] = row["dcp_commit"]["peak_rss"]
                row["dcp_plan"] = _measure(in_process, dcp_plan, preset, n, n // 2, dcp_path)
                os.remove(os.path.join(dcp_path, ".metadata"))
        rows.append(row)
    if with_dcp:
        _fill_extrapolated(rows)
        for n, need in skipped:
            print(
                f"DCP at {n:,} ranks not run: its simulation would hold about {need / 2**30:.1f} GiB "
                f"(available: {_available_bytes() / 2**30:.1f} GiB); its figures are extrapolated (~)"
            )
    return rows


def _fill_extrapolated(rows: list[dict]) -> None:
    measured = [r for r in rows if r["dcp_commit"] is not None]
    if len(measured) < 2:
        return
    for r in rows:
        if r["dcp_commit"] is not None:
            continue
        guess = {}
        for side, keys in (
            ("dcp_commit", ("seconds", "cpu_seconds", "manifest_bytes")),
            ("dcp_plan", ("seconds", "cpu_seconds", "peak_bytes", "metadata_bytes")),
        ):
            guess[side] = {k: _extrapolate({m["n"]: m[side][k] for m in measured}, r["n"]) for k in keys}
            guess[side]["extrapolated"] = True
        r.update(guess)


def report(rows: list[dict]) -> None:
    def fig(side: dict | None, key: str, fmt) -> str:
        if side is None or side.get(key) is None:
            return "-"
        return ("~" if side.get("extrapolated") else "") + fmt(side[key])

    def ratio(a: dict, b: dict | None, key: str) -> str:
        if b is None or not b.get(key) or a.get(key) is None:
            return "-"
        return f"{'~' if b.get('extrapolated') else ''}{a[key] / b[key]:.4f}x"

    seconds = lambda s: f"{s:.3f}"  # noqa: E731
    print(
        "| ranks | metadata a rank reads, MB: fsdp2 | DCP | fsdp2/DCP "
        "| load plan of one rank, CPU s: fsdp2 | DCP | fsdp2/DCP "
        "| its peak memory, MB: fsdp2 | DCP | fsdp2/DCP "
        "| commit on rank 0, CPU s: fsdp2 | DCP | fsdp2/DCP |"
    )
    print("|" + "---:|" * 13)
    for r in rows:
        fp, dp, fc, dc = r["fsdp2_plan"], r["dcp_plan"], r["fsdp2_commit"], r["dcp_commit"]
        print(
            f"| {r['n']:,} "
            f"| {_mb(fp['metadata_bytes'])} | {fig(dp, 'metadata_bytes', _mb)} | {ratio(fp, dp, 'metadata_bytes')} "
            f"| {seconds(fp['cpu_seconds'])} | {fig(dp, 'cpu_seconds', seconds)} | {ratio(fp, dp, 'cpu_seconds')} "
            f"| {_mb(fp['peak_bytes'])} | {fig(dp, 'peak_bytes', _mb)} | {ratio(fp, dp, 'peak_bytes')} "
            f"| {seconds(fc['cpu_seconds'])} | {fig(dc, 'cpu_seconds', seconds)} | {ratio(fc, dc, 'cpu_seconds')} |"
        )
    first, last = rows[0], rows[-1]

    def growth(side: str, key: str) -> str:
        return f"{last[side][key] / first[side][key]:.3f}x"

    print()
    print(
        f"fsdp2 from {first['n']:,} to {last['n']:,} ranks: "
        f"metadata a rank reads {growth('fsdp2_plan', 'metadata_bytes')}, "
        f"load plan {growth('fsdp2_plan', 'cpu_seconds')} CPU ({growth('fsdp2_plan', 'seconds')} wall), "
        f"commit {growth('fsdp2_commit', 'cpu_seconds')} CPU ({growth('fsdp2_commit', 'seconds')} wall)"
    )
    print(
        "fsdp2 wall seconds, load plan: "
        + ", ".join(f"{r['fsdp2_plan']['seconds']:.3f}" for r in rows)
        + "; commit: "
        + ", ".join(f"{r['fsdp2_commit']['seconds']:.3f}" for r in rows)
        + "; DCP wall seconds, load plan: "
        + ", ".join(fig_wall(r["dcp_plan"]) for r in rows)
        + "; commit: "
        + ", ".join(fig_wall(r["dcp_commit"]) for r in rows)
    )
    print(
        "manifest bytes: "
        + ", ".join(f"{r['fsdp2_commit']['manifest_bytes']:,}" for r in rows)
        + f" ({first['fsdp2_commit']['tensors']:,} tensors); files a rank reads: "
        + ", ".join(str(r["fsdp2_plan"]["files"]) for r in rows)
        + "; DCP's chunks: "
        + ", ".join(
            f"{r['dcp_commit']['chunks']:,}" if r["dcp_commit"] and "chunks" in r["dcp_commit"] else "-" for r in rows
        )
    )


def fig_wall(side: dict | None) -> str:
    if side is None:
        return "-"
    return ("~" if side.get("extrapolated") else "") + f"{side['seconds']:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", help="a preset of fsdp2.plan (default llama3-8b)")
    parser.add_argument("--sizes", default="1024,4096,16384", help="simulated world sizes")
    parser.add_argument("--repeats", type=int, default=21, help="rounds of fsdp2's commit and load plan (medians)")
    parser.add_argument("--no-dcp", action="store_true", help="fsdp2 alone")
    parser.add_argument("--dir", default=None, help="where to write manifests and sparse files (default: a temp dir)")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="every measurement in this process (quick; peak memory then unreliable)",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        rows = run(args.model, sizes, args.repeats, not args.no_dcp, root, args.in_process)
    print(f"model {args.model} + AdamW state, FSDP over N simulated ranks (meta tensors), rank N/2 plans its load")
    report(rows)


if __name__ == "__main__":
    main()
