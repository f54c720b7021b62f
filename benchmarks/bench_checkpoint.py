"""Checkpoint save/load/async save: fsdp2.checkpoint vs torch.distributed.checkpoint (DCP).

Both sides save and load the same state -- a GPT sharded with fsdp2's ``fully_shard`` on a
1-D mesh plus its AdamW state (DTensors) -- in the same processes, alternating, between
barriers. Each time is the slowest rank's; tables show the median over --repeats rounds.

    python benchmarks/bench_checkpoint.py --model 125m --ranks 2 --repeats 3         # CPU, gloo
    python benchmarks/bench_checkpoint.py --device cuda --model 1b --ranks 1 --repeats 3
    python benchmarks/bench_checkpoint.py --sizes mini,small,125m,350m --repeats 7   # loads only, by size
    python benchmarks/bench_checkpoint.py --hashes                                    # checksum speeds
    python benchmarks/bench_checkpoint.py --first-touch                               # fresh vs touched memory
    python benchmarks/bench_checkpoint.py --hash-threads 1,2,8,16                     # GIL hand-offs of hashing threads

Rows:
- save: write + fsync + commit (fsdp2: rank files + manifest; DCP: its files + .metadata).
- load verify / no verify: fsdp2 with its default block checksums, and without; DCP verifies
  nothing. Loads start after ``os.sync()``, so the saves' writeback does not land in the first.
  ``--cold`` evicts both sides' files from the page cache (posix_fadvise DONTNEED on the files
  only) before every load, so loads read the disk; default: warm page cache.
- async save: "call" = time ``save(async_save=True)`` / ``dcp.async_save`` takes to return;
  "blocked" = call + until the device-to-host snapshot is complete (CUDA sync; = call on
  CPU), i.e. how long the training loop is held; then training steps run while the background
  write goes on ("overlap step" vs a normal step); "wait" = ``wait()``/``result()`` after that.
  Round 1 includes allocating the staging buffer, later rounds reuse it (reported apart).
- bytes: LoadStats of fsdp2 rank 0 (tensor bytes read / owned / checksummed) and each side's
  ``read()`` syscall bytes on rank 0 (rchar; both read with read/pread now).
- --sizes mini,125m,...: only loads, for each model preset: save once with each library (model +
  AdamW state, and the model's state alone), then --repeats rounds of (fsdp2 verified, fsdp2
  verify=False, DCP) of each, each round in a shuffled order (seeded by the round) so that load
  from other jobs, and what one load leaves behind for the next, hit all six alike; prints, per
  preset, a row for model + AdamW and one for the model alone: medians and the medians of the
  per-round ratios verified /
  DCP and verification cost (verified - verify=False) / verify=False, with a bootstrap 90%
  interval of the latter (a round's noise on this scale is often larger than the cost);
  --hash-baseline [NAME] adds a fourth load to the rounds, verified with CRC32C implementation
  NAME (default: the ``crc32c`` package; ``integrity.IMPLEMENTATIONS``) instead of fsdp2's
  default (the fastest installed); --page-baseline adds a load verified with its buffers left to
  4 KiB pages (``FSDP2_LOAD_HUGEPAGES=0``), --thread-baseline one with ``LOCAL_WORLD_SIZE`` unset
  (every rank reads with at least 2 threads), --gc-baseline one with Python's automatic garbage
  collection left running during the load; --no-dcp leaves DCP out of the rounds (verification's
  cost only, more rounds per minute);
  --trace prints every timed load: the phases inside fsdp2's ``load`` per rank (plan, read,
  restore, agree = waiting for the other ranks, gc0-2 = garbage collections), page faults, bytes
  read from storage, and the machine's /proc/vmstat deltas (huge pages, compaction, reclaim).
- --reshard 3,4: load the last checkpoint as every rank of other world sizes (one process
  simulating each rank with PyTorch's fake process group) and report bytes read / owned with
  verification on.
- --hf (CPU): save -> consolidate to Hugging Face layout -> in fresh processes, ``load_hf`` into a
  new sharded model on every rank (peak RSS growth during the call vs the rank's shard bytes),
  then DCP's HuggingFaceStorageReader into the same model.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import statistics
import tempfile
import time

MODELS = {  # GPTConfig kwargs; state = params + 2 AdamW moments, fp32
    "mini": dict(vocab_size=1024, seq_len=128, dim=128, n_layers=4, n_heads=4),  # 1.06M params, 13 MB state
    "tiny": dict(vocab_size=2048, seq_len=128, dim=256, n_layers=4, n_heads=4),  # 4.2M params, 51 MB state
    "small": dict(vocab_size=8192, seq_len=256, dim=512, n_layers=6, n_heads=8),  # 27M, 330 MB state
    "60m": dict(vocab_size=32000, seq_len=512, dim=512, n_layers=8, n_heads=8),  # 58M, 0.70 GB state
    "125m": dict(vocab_size=32000, seq_len=1024, dim=768, n_layers=12, n_heads=12),  # 135M, 1.6 GB state
    "350m": dict(vocab_size=32000, seq_len=1024, dim=1024, n_layers=14, n_heads=16),  # 244M, 2.9 GB state
    "1b": dict(vocab_size=32000, seq_len=2048, dim=2048, n_layers=18, n_heads=16),  # 1.04B, 12.5 GB state
}
STEP_SEQ = {"mini": 128, "tiny": 128, "small": 64, "60m": 64, "125m": 64, "350m": 32, "1b": 2048}  # tokens per sequence


def _rchar() -> int:
    """Bytes this process read through read()/pread() syscalls (mmap reads are not counted)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _evict(directory: str) -> None:
    """Drop a directory's files from the page cache (clean pages only: they were fsynced)."""
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class _Bench:
    def __init__(self, rank: int, device, args):
        self.rank, self.device, self.args = rank, device, args

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def slowest(self, seconds: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([seconds], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def timed(self, fn, evict: list[str] = ()):
        import torch.distributed as dist

        if evict and self.rank == 0:
            for d in evict:
                _evict(d)
        dist.barrier()
        start, rchar = time.perf_counter(), _rchar()
        fn()
        self.sync()
        return self.slowest(time.perf_counter() - start), _rchar() - rchar


def _build(cfg, mesh, device):
    import torch

    from fsdp2 import fully_shard
    from fsdp2.models import GPT

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def _init_world(rank, world, port, args):
    """Process group and 1-D mesh for this rank; returns (device, mesh)."""
    # As torchrun does: fsdp2 shares the host's cores among its ranks' reader threads by it.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    if args.device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world)
    return device, init_device_mesh(device.type, (world,))


def _trained(name, mesh, device, args, rank):
    """A sharded GPT of preset ``name`` with AdamW state (one step); (model, opt, step, state bytes)."""
    import torch

    from fsdp2.models import GPTConfig

    cfg = GPTConfig(**MODELS[name])
    model = _build(cfg, mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seq = min(STEP_SEQ[name], cfg.seq_len)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, seq + 1), generator=g).to(device)

    def step():
        opt.zero_grad(set_to_none=True)
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()

    step()  # creates the AdamW state
    local = sum(t.to_local().numel() * t.element_size() for t in model.state_dict().values())
    local += sum(
        v.to_local().numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if hasattr(v, "to_local")
    )
    return model, opt, step, _all_ranks(local, device)


def _all_ranks(nbytes: int, device) -> float:
    """``nbytes`` summed over the ranks (collective)."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(nbytes)], device=device)
    dist.all_reduce(total)
    return total.item()


def _worker(rank, world, port, args, out):
    device, mesh = _init_world(rank, world, port, args)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fsdp2.checkpoint as ck
    from fsdp2.checkpoint.staging import process_staging

    model, opt, step, total = _trained(args.model, mesh, device, args, rank)
    b = _Bench(rank, device, args)

    def dcp_state():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    rows: dict[str, list] = {}
    stats_rows = []
    async_rows = []
    last = None
    for rep in range(args.repeats):
        base = os.path.join(args.dir, f"rep{rep}")
        ours, theirs = os.path.join(base, "fsdp2"), os.path.join(base, "dcp")
        evict = [ours, theirs] if args.cold else []
        stats = [ck.LoadStats(), ck.LoadStats()]
        r = {}
        r["fsdp2 save"] = b.timed(lambda: ck.save(ours, model, opt))
        r["dcp save"] = b.timed(lambda: dcp.save(dcp_state(), checkpoint_id=theirs))
        os.sync()  # the saves' writeback would otherwise slow whichever load runs first
        r["fsdp2 load, verified"] = b.timed(lambda: ck.load(ours, model, opt, stats=stats[0]), evict)
        r["fsdp2 load, verify=False"] = b.timed(lambda: ck.load(ours, model, opt, verify=False, stats=stats[1]), evict)
        r["dcp load"] = b.timed(lambda: dcp.load(dcp_state(), checkpoint_id=theirs), evict)
        for name, value in r.items():
            rows.setdefault(name, []).append(value)
        stats_rows.append((stats[0].bytes_read, stats[0].bytes_owned, stats[0].bytes_verified))
        async_rows.append(_async_round(b, base, model, opt, step, dcp_state))
        dist.barrier()
        if rank == 0:
            if last is not None:
                shutil.rmtree(last, ignore_errors=True)
            shutil.rmtree(theirs, ignore_errors=True)
            shutil.rmtree(os.path.join(base, "async"), ignore_errors=True)
        last = base
    hf_dir = _hf_export(b, args, model) if args.hf else None
    dist.barrier()
    if rank == 0:
        out.put(
            dict(
                total_bytes=total,
                rows=rows,
                stats=stats_rows,
                async_rows=async_rows,
                allocations=process_staging().allocations,
                hf_dir=hf_dir,
                last=os.path.join(last, "fsdp2"),
            )
        )
    dist.barrier()
    dist.destroy_process_group()


LOADS = ("fsdp2 verified", "fsdp2 verify=False", "DCP")
# The same loads of the model's state alone, from each library's model-only checkpoint.
MODEL_LOADS = ("model: fsdp2 verified", "model: fsdp2 verify=False", "model: DCP")
BASELINE_HASH = "fsdp2 verified, other CRC32C"  # --hash-baseline NAME: verified with that implementation
BASELINE_PAGES = "fsdp2 verified, 4 KiB pages"  # --page-baseline: verified, load buffers not advised as huge pages
BASELINE_THREADS = "fsdp2 verified, 2+ threads"  # --thread-baseline: verified, reader threads not shared by rank
BASELINE_GC = "fsdp2 verified, GC on"  # --gc-baseline: verified, automatic garbage collection left running


def _kinds(args) -> tuple[str, ...]:
    loads = tuple(k for k in LOADS + MODEL_LOADS if not (args.no_dcp and k.endswith("DCP")))
    return (
        loads
        + ((BASELINE_HASH,) if args.hash_baseline else ())
        + ((BASELINE_PAGES,) if args.page_baseline else ())
        + ((BASELINE_THREADS,) if args.thread_baseline else ())
        + ((BASELINE_GC,) if args.gc_baseline else ())
    )


def _with_checksum_implementation(name: str, fn):
    """``fn`` run with fsdp2's CRC32C computed by implementation ``name``."""
    from fsdp2.checkpoint import integrity

    chosen = integrity.choose_implementation([name])[1]  # once: choosing runs a self-test (~1 ms)

    def run():
        kept = integrity._crc32c
        integrity._crc32c = chosen
        try:
            fn()
        finally:
            integrity._crc32c = kept

    return run


def _with_gc_running(fn):
    """``fn`` run with fsdp2's load leaving automatic garbage collection on (as before it paused it)."""
    import contextlib

    def run():
        from fsdp2.checkpoint import gc_pause  # here: the bench also runs against commits without it

        kept = gc_pause.paused
        gc_pause.paused = contextlib.nullcontext
        try:
            fn()
        finally:
            gc_pause.paused = kept

    return run


def _with_env(name: str, value: str | None, fn):
    """``fn`` run with environment variable ``name`` set to ``value`` (None: unset)."""

    def run():
        kept = os.environ.get(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        try:
            fn()
        finally:
            if kept is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = kept

    return run


def _sweep_worker(rank, world, port, args, out):
    """--sizes: per model preset, save with both libraries, then ``--repeats`` rounds of the loads,
    each round in a shuffled order (:func:`_round_order`) so that machine load hits every side alike."""
    import gc
    import shutil

    device, mesh = _init_world(rank, world, port, args)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fsdp2.checkpoint as ck
    from fsdp2.checkpoint.tensor_reader import read_threads

    b = _Bench(rank, device, args)
    results = {}
    for name in args.sizes:
        model, opt, _, total = _trained(name, mesh, device, args, rank)
        model_bytes = _all_ranks(
            sum(t.to_local().numel() * t.element_size() for t in model.state_dict().values()), device
        )
        ours, theirs = os.path.join(args.dir, name, "fsdp2"), os.path.join(args.dir, name, "dcp")
        ours_model, theirs_model = ours + "-model", theirs + "-model"
        ck.save(ours, model, opt)
        ck.save(ours_model, model)
        if not args.no_dcp:
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=theirs)
            dcp.save({"model": model.state_dict()}, checkpoint_id=theirs_model)
        loads = {
            "fsdp2 verified": lambda: ck.load(ours, model, opt),
            "fsdp2 verify=False": lambda: ck.load(ours, model, opt, verify=False),
            "DCP": lambda: dcp.load({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=theirs),
            "model: fsdp2 verified": lambda: ck.load(ours_model, model),
            "model: fsdp2 verify=False": lambda: ck.load(ours_model, model, verify=False),
            "model: DCP": lambda: dcp.load({"model": model.state_dict()}, checkpoint_id=theirs_model),
            BASELINE_HASH: _with_checksum_implementation(
                args.hash_baseline or "crc32c", lambda: ck.load(ours, model, opt)
            ),
            # fsdp2.checkpoint.fresh_memory.ENV: load buffers left to 4 KiB pages
            BASELINE_PAGES: _with_env("FSDP2_LOAD_HUGEPAGES", "0", lambda: ck.load(ours, model, opt)),
            # without LOCAL_WORLD_SIZE a rank reads with at least 2 threads, as before it was used
            BASELINE_THREADS: _with_env("LOCAL_WORLD_SIZE", None, lambda: ck.load(ours, model, opt)),
            BASELINE_GC: _with_gc_running(lambda: ck.load(ours, model, opt)),
        }
        kinds = _kinds(args)
        evict = [ours, theirs, ours_model, theirs_model] if args.cold else []
        for kind in kinds:  # warm-up: first-touch costs of both libraries, and the page cache
            loads[kind]()
        floors = []
        for load in (
            lambda stats: ck.load(ours, model, opt, stats=stats),
            lambda stats: ck.load(ours_model, model, stats=stats),
        ):
            stats = ck.LoadStats()
            load(stats)
            floors.append(_hash_floor_seconds(stats.bytes_verified) / read_threads())  # shared by the reader threads
        rounds = []
        tracer = _LoadTracer(rank, name) if args.trace else None
        for rep in range(args.repeats):
            order = _round_order(kinds, rep)
            times = {}
            for kind in order:
                if tracer is not None:
                    tracer.begin()
                times[kind] = b.timed(tracer.wrap(loads[kind]) if tracer else loads[kind], evict)[0]
                if tracer is not None:
                    tracer.end(rep, kind, times[kind])
            rounds.append(times)
        if tracer is not None:
            tracer.close()
        results[name] = dict(
            total_bytes=total, model_bytes=model_bytes, rounds=rounds, hash_floor=floors[0], model_hash_floor=floors[1]
        )
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(args.dir, name), ignore_errors=True)
        model = opt = loads = None  # free this size before the next
        gc.collect()
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def _round_order(kinds: tuple[str, ...], rep: int) -> list[str]:
    """The loads of round ``rep`` in an order drawn from ``rep`` (the same on every rank). Rotating one
    order kept each load's predecessor fixed (verify=False always ran right after verified, and
    a DCP load, which leaves the memory in another state, never ran right before fsdp2's verified
    one); shuffled, every load follows every other alike, on average."""
    order = list(kinds)
    random.Random(rep).shuffle(order)
    return order


def _hash_floor_seconds(nbytes: int, window_bytes: int = 1 << 20) -> float:
    """Seconds the CRC32C alone takes over ``nbytes`` on this thread, the bytes in the CPU cache (one
    ``window_bytes`` buffer hashed again and again, one call per window): what verifying costs at
    least on the core that reads, whatever the read path does. Best of 3."""
    import numpy as np

    from fsdp2.checkpoint import integrity

    crc = integrity.checksum_function()
    window = memoryview(np.random.default_rng(0).integers(0, 255, size=window_bytes, dtype=np.uint8))
    calls, rest = divmod(nbytes, window_bytes)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            crc(window, 0)
        crc(window[:rest], 0)
        best = min(best, time.perf_counter() - t)
    return best


_VMSTAT_FIELDS = (
    "pgmajfault",
    "pgpgin",
    "thp_fault_alloc",
    "thp_fault_fallback",
    "compact_stall",
    "pgsteal_kswapd",
    "pgsteal_direct",
    "workingset_refault_file",
)


def _vmstat() -> dict[str, int]:
    with open("/proc/vmstat") as f:
        values = dict(line.split() for line in f)
    return {k: int(values.get(k, 0)) for k in _VMSTAT_FIELDS}


def _io_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (page-cache misses), /proc/self/io."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


class _LoadTracer:
    """--trace: for every timed load of the sweep, one line on rank 0: the time, where each rank's
    time went inside ``fsdp2.checkpoint.load`` (phases), its page faults and storage reads, and the
    machine's /proc/vmstat deltas (huge-page faults and fallbacks, compaction stalls, reclaim)."""

    PHASES = {"plan": ("_plan_model", "_plan_optimizer"), "read": ("_read_targets",), "restore": ("_restore",)}

    def __init__(self, rank: int, size: str):
        import torch
        import torch.distributed as dist

        from fsdp2.checkpoint import reader

        self.rank, self.size, self.dist = rank, size, dist
        self.phase_s: dict[str, float] = {}
        self._patched = []

        def timed(phase, fn):
            def wrapper(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.phase_s[phase] = self.phase_s.get(phase, 0.0) + time.perf_counter() - t

            return wrapper

        for phase, names in self.PHASES.items():
            for n in names:
                self._patched.append((reader, n, getattr(reader, n)))
                setattr(reader, n, timed(phase, getattr(reader, n)))
        from fsdp2.checkpoint import _dist

        self._patched.append((_dist, "first_failure", _dist.first_failure))
        _dist.first_failure = timed("agree", _dist.first_failure)
        import gc

        def gc_timer(event, info):
            if event == "start":
                self._gc_start = time.perf_counter()
            elif getattr(self, "_gc_start", None) is not None:
                key = f"gc{info['generation']}"
                self.phase_s[key] = self.phase_s.get(key, 0.0) + time.perf_counter() - self._gc_start
                self._gc_start = None

        gc.callbacks.append(gc_timer)
        self._gc_timer = gc_timer
        self._patched.append((torch.optim.Optimizer, "load_state_dict", torch.optim.Optimizer.load_state_dict))
        torch.optim.Optimizer.load_state_dict = timed("optim.load_state_dict", torch.optim.Optimizer.load_state_dict)
        if rank == 0:
            print(
                f"{'size':<6}{'round':>6} {'load':<28}{'s':>7}  per rank: phases (s), minor/major faults, "
                "MB from storage | machine: vmstat deltas",
                flush=True,
            )

    def wrap(self, fn):
        """``fn``, adding its whole time on this rank as the phase "rank total"."""

        def run():
            t = time.perf_counter()
            fn()
            self.phase_s["rank total"] = time.perf_counter() - t

        return run

    def begin(self) -> None:
        import resource

        self.phase_s = {}
        self._ru = resource.getrusage(resource.RUSAGE_SELF)
        self._io = _io_read_bytes()
        self._vm = _vmstat()

    def end(self, rep: int, kind: str, seconds: float) -> None:
        import resource

        ru = resource.getrusage(resource.RUSAGE_SELF)
        vm = _vmstat()
        mine = dict(
            phases={k: round(v, 3) for k, v in self.phase_s.items()},
            faults=(ru.ru_minflt - self._ru.ru_minflt, ru.ru_majflt - self._ru.ru_majflt),
            storage_mb=round((_io_read_bytes() - self._io) / 1e6, 1),
        )
        every = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(every, mine)
        if self.rank == 0:
            moved = {k: vm[k] - self._vm[k] for k in vm if vm[k] != self._vm[k]}
            ranks = " ; ".join(
                f"{r['phases']} flt {r['faults'][0]}/{r['faults'][1]} disk {r['storage_mb']}" for r in every
            )
            print(
                f"{self.size:<6}{rep:>6} {kind:<28}{seconds:>7.3f}  {ranks} | {moved} "
                f"load avg {os.getloadavg()[0]:.1f}",
                flush=True,
            )

    def close(self) -> None:
        import gc

        gc.callbacks.remove(self._gc_timer)
        for owner, n, fn in reversed(self._patched):
            setattr(owner, n, fn)


def _sweep_report(args, results) -> None:
    import torch

    from fsdp2.checkpoint import integrity

    kinds = _kinds(args)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
    print(
        f"load only, model + AdamW state (+ AdamW rows) and the model's alone (model rows), {args.ranks} rank(s), "
        f"{device}, torch {torch.__version__}, "
        f"{'cold' if args.cold else 'warm'} page cache, {args.repeats} rounds of the {len(kinds)} loads in shuffled "
        f"order; times: medians, ratios: medians of the per-round ratios; CRC32C: {integrity.IMPLEMENTATION}; "
        f"THP_MEM_ALLOC_ENABLE={thp}; load average at the end {os.getloadavg()[0]:.1f}"
    )
    extra = f"{args.hash_baseline + ' (s)':>16}{'its / DCP':>11}{'its cost':>10}" if args.hash_baseline else ""
    extra += f"{'4 KiB pages (s)':>17}{'its / DCP':>11}" if args.page_baseline else ""
    extra += f"{'2+ threads (s)':>16}{'its / DCP':>11}" if args.thread_baseline else ""
    extra += f"{'GC on (s)':>11}{'its / DCP':>11}{'its cost':>10}" if args.gc_baseline else ""
    print(
        f"{'model':<14}{'state MB':>10}{'verified (s)':>14}{'verify=False':>14}{'DCP (s)':>9}"
        f"{'verified / DCP':>16}{'verify cost':>13}{'its 90% CI':>14}{'hash floor':>12}{extra}"
    )

    def cost_of(rounds, verified="fsdp2 verified", unverified="fsdp2 verify=False"):
        return statistics.median((x[verified] - x[unverified]) / x[unverified] for x in rounds)

    def ratios(rounds, verified, dcp_kind="DCP"):
        vs_dcp = statistics.median(x[verified] / x[dcp_kind] for x in rounds) if dcp_kind in kinds else math.nan
        return vs_dcp, cost_of(rounds, verified)

    def row(label, nbytes, rounds, med, floor, loads):
        verified, unverified, dcp_kind = loads
        vs_dcp = ratios(rounds, verified, dcp_kind)[0]
        cost = cost_of(rounds, verified, unverified)
        low, high = _bootstrap_interval(rounds, lambda some: cost_of(some, verified, unverified))
        dcp_s = "-" if math.isnan(vs_dcp) else f"{med[dcp_kind]:.3f}"
        return (
            f"{label:<14}{nbytes / 1e6:>10.1f}{med[verified]:>14.3f}"
            f"{med[unverified]:>14.3f}{dcp_s:>9}{_times(vs_dcp):>16}{cost:>12.2f}x"
            f"{f'{low:.2f}-{high:.2f}x':>14}{floor / med[unverified]:>11.2f}x"
        )

    for name, r in results.items():
        rounds = r["rounds"]
        med = {kind: statistics.median(x[kind] for x in rounds) for kind in kinds}
        line = row(f"{name} + AdamW", r["total_bytes"], rounds, med, r["hash_floor"], LOADS)
        if args.hash_baseline:
            base_dcp, base_cost = ratios(rounds, BASELINE_HASH)
            line += f"{med[BASELINE_HASH]:>16.3f}{_times(base_dcp):>11}{base_cost:>9.2f}x"
        if args.page_baseline:
            line += f"{med[BASELINE_PAGES]:>17.3f}{_times(ratios(rounds, BASELINE_PAGES)[0]):>11}"
        if args.thread_baseline:
            line += f"{med[BASELINE_THREADS]:>16.3f}{_times(ratios(rounds, BASELINE_THREADS)[0]):>11}"
        if args.gc_baseline:
            gc_dcp, gc_cost = ratios(rounds, BASELINE_GC)
            line += f"{med[BASELINE_GC]:>11.3f}{_times(gc_dcp):>11}{gc_cost:>9.2f}x"
        print(line)
        print(row(f"{name} model", r["model_bytes"], rounds, med, r["model_hash_floor"], MODEL_LOADS))
    print(
        "verified / DCP: fsdp2's default (checksummed) load time over DCP's (< 1: fsdp2 faster); verify cost: "
        "(verified - verify=False) / verify=False; its 90% CI: of that median, bootstrapped over the rounds "
        "(how far this run's noise leaves it uncertain); hash floor: the CRC32C alone over the bytes a rank "
        "verifies, in the CPU cache, shared by its reader threads (_hash_floor_seconds), / verify=False: the least "
        "verify cost when each reader thread hashes what it reads"
        + (
            f"; {args.hash_baseline}: verified with that CRC32C implementation instead of fsdp2's default"
            if args.hash_baseline
            else ""
        )
    )


def _times(ratio: float) -> str:
    """A ratio as printed in the --sizes table; "-" without DCP in the rotation (--no-dcp)."""
    return "-" if math.isnan(ratio) else f"{ratio:.2f}x"


def _bootstrap_interval(rounds: list, estimate, draws: int = 2000, level: float = 0.9) -> tuple[float, float]:
    """The central ``level`` interval of ``estimate`` over ``draws`` resamplings of ``rounds`` with
    replacement (a percentile bootstrap; seeded, so a run's report is reproducible from its rounds)."""
    import random

    rng = random.Random(0)
    values = sorted(estimate(rng.choices(rounds, k=len(rounds))) for _ in range(draws))
    tail = int(draws * (1 - level) / 2)
    return values[tail], values[draws - 1 - tail]


_DCP_GROUP = None


def _async_round(b: _Bench, base, model, opt, step, dcp_state) -> dict:
    """Async save blocking time and training steps overlapping the background write."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fsdp2.checkpoint as ck

    def normal_steps(n=3):
        times = []
        for _ in range(n):
            dist.barrier()
            t = time.perf_counter()
            step()
            b.sync()
            times.append(b.slowest(time.perf_counter() - t))
        return statistics.median(times)

    result = {"normal step": normal_steps()}
    # DCP's background thread runs collectives: give it its own group, as its docs advise.
    global _DCP_GROUP
    if _DCP_GROUP is None:
        _DCP_GROUP = dist.new_group(backend="gloo")
    for name in ("fsdp2", "dcp"):
        path = os.path.join(base, "async", name)
        dist.barrier()
        t0 = time.perf_counter()
        if name == "fsdp2":
            handle = ck.save(path, model, opt, async_save=True)
            done = handle.done_writing
        else:
            handle = dcp.async_save(dcp_state(), checkpoint_id=path, process_group=_DCP_GROUP)
            done = handle.done
        call = time.perf_counter() - t0
        b.sync()
        blocked = time.perf_counter() - t0
        overlapped = []
        while True:  # same number of steps on every rank: agree whether anyone is still writing
            writing = b.slowest(0.0 if done() else 1.0) > 0
            if not writing or len(overlapped) >= 50:
                break
            t = time.perf_counter()
            step()
            b.sync()
            overlapped.append(b.slowest(time.perf_counter() - t))
        t = time.perf_counter()
        handle.wait() if name == "fsdp2" else handle.result()
        wait = time.perf_counter() - t
        result[name] = dict(
            call=b.slowest(call),
            blocked=b.slowest(blocked),
            overlap_steps=overlapped,
            wait=b.slowest(wait),
            total=b.slowest(time.perf_counter() - t0),
        )
    return result


def _hf_export(b: _Bench, args, model) -> str:
    """save -> consolidate to Hugging Face layout (rank 0); returns the HF directory."""
    import torch.distributed as dist

    import fsdp2.checkpoint as ck
    from fsdp2.checkpoint.cli import consolidate

    base = os.path.join(args.dir, "hf")
    ck.save(os.path.join(base, "ckpt"), model)
    if b.rank == 0:
        consolidate(os.path.join(base, "ckpt"), os.path.join(base, "hf"))
        shutil.rmtree(os.path.join(base, "ckpt"), ignore_errors=True)
    dist.barrier()
    return os.path.join(base, "hf")


def _hf_worker(rank, world, port, args, hf_dir, out):
    """Fresh processes: load_hf into a new sharded model; peak RSS growth vs this rank's shard bytes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2.checkpoint as ck
    from fsdp2.models import GPTConfig

    dist.init_process_group("gloo", rank=rank, world_size=world)
    device = torch.device("cpu")
    b = _Bench(rank, device, args)
    model = _build(GPTConfig(**MODELS[args.model]), init_device_mesh("cpu", (world,)), device)
    shard_bytes = sum(t.to_local().numel() * t.element_size() for t in model.state_dict().values())
    if args.cold and rank == 0:
        _evict(hf_dir)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    rss0 = _vm("VmRSS")
    stats = ck.LoadStats()
    seconds, _ = b.timed(lambda: ck.load_hf(hf_dir, model, stats=stats))
    peak = _vm("VmHWM") - rss0
    result = dict(
        seconds=seconds, shard_bytes=shard_bytes, peak_rss_growth=peak, read=stats.bytes_read, owned=stats.bytes_owned
    )
    try:
        if args.cold and rank == 0:
            _evict(hf_dir)
        reader = dcp.HuggingFaceStorageReader(hf_dir)
        sd = model.state_dict()
        result["dcp_seconds"], _ = b.timed(lambda: dcp.load(sd, storage_reader=reader))
    except Exception as e:  # noqa: BLE001 - report, do not fail the benchmark
        result["dcp_error"] = repr(e)[:200]
    per_rank = [None] * world
    dist.all_gather_object(per_rank, result)
    if rank == 0:
        out.put(per_rank)
    dist.barrier()
    dist.destroy_process_group()


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reshard_worker(rank, path, model, worlds, out):
    """Load ``path`` as each rank of each world size in turn (fake process group: no traffic).

    The targets are Shard(0) DTensors built from metadata (fsdp2's layout for every parameter),
    plus AdamW, whose state the load lays out like the parameters.
    """
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp2.checkpoint as ck
    from fsdp2.layout.regions import shard_region
    from fsdp2.models import GPT, GPTConfig

    with torch.device("meta"):
        meta = GPT(GPTConfig(**MODELS[model]))
    result = {}
    for world in worlds:
        read = owned = 0
        worst = 1.0
        for r in range(world):
            dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=world)
            # A fresh dim name per rank: DTensor caches sharding decisions per (equal) mesh, which
            # would hand one simulated rank the mesh object, and coordinate, of the previous one.
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(f"w{world}r{r}",))
            m = nn.Module()
            for fqn, p in meta.named_parameters():
                region = shard_region(p.shape, (world,), (r,), [Shard(0)])
                local = torch.empty(region.shape)
                dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
                owner = m
                *parents, leaf = fqn.split(".")
                for name in parents:
                    if not hasattr(owner, name):
                        owner.add_module(name, nn.Module())
                    owner = getattr(owner, name)
                owner.register_parameter(leaf, nn.Parameter(dt))
            opt = torch.optim.AdamW(m.parameters())
            stats = ck.LoadStats()
            ck.load(path, m, opt, stats=stats)
            read, owned = read + stats.bytes_read, owned + stats.bytes_owned
            worst = max(worst, stats.bytes_read / stats.bytes_owned)
            dist.destroy_process_group()
            del m, opt
        result[world] = (read, owned, worst)
    out.put(result)


def hash_table(mib: int = 256) -> list[tuple[str, float, float, float]]:
    """(name, GiB/s on 1 MiB in the CPU cache, GiB/s on ``mib`` MiB from memory, longest stall of
    another Python thread while it hashes the whole buffer, as a fraction of one such call: ~0 = GIL
    released, ~1 = held). One thread each; best of 5 (cache) / 3 (memory)."""
    import threading
    import zlib

    import numpy as np

    from fsdp2.checkpoint import integrity

    data = np.random.default_rng(0).integers(0, 255, size=mib << 20, dtype=np.uint8)
    view = memoryview(data)
    block, window = 4 << 20, view[: 1 << 20]
    cands = {"zlib.crc32 (format 1)": lambda m, c: zlib.crc32(m, c)}
    for name in integrity.IMPLEMENTATIONS:  # fsdp2's CRC32C implementations, fastest first
        try:
            cands[f"{name} (CRC32C)"] = integrity.choose_implementation([name])[1]
        except ImportError:
            pass
    try:
        import google_crc32c

        cands["google-crc32c (needs bytes: copies)"] = lambda m, c: google_crc32c.extend(c, bytes(m))
    except ImportError:
        pass
    try:
        import xxhash

        cands["xxhash xxh3_64"] = lambda m, c: xxhash.xxh3_64_intdigest(m, c)
    except ImportError:
        pass

    def best(fn, times):
        out = float("inf")
        for _ in range(times):
            t = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - t)
        return out

    def stall(fn) -> float:
        """Longest gap between iterations of this thread's loop while another thread hashes ``view``
        4 times, over the time of one such call."""
        done, took = threading.Event(), []

        def worker():
            time.sleep(0.02)
            for _ in range(4):
                t = time.perf_counter()
                fn(view, 0)
                took.append(time.perf_counter() - t)
            done.set()

        th = threading.Thread(target=worker)
        th.start()
        last, longest = time.perf_counter(), 0.0
        while not done.is_set():
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        th.join()
        return longest / statistics.mean(took)

    rows = []
    for name, fn in cands.items():
        in_cache = best(lambda: [fn(window, 0) for _ in range(64)], 5)

        def from_memory():
            c = 0
            for i in range(0, len(view), block):
                c = fn(view[i : i + block], c)

        rows.append((name, 64 / in_cache / 1024, len(data) / best(from_memory, 3) / 2**30, stall(fn)))
    return rows


# MiB per load buffer of one of 2 ranks of the 125m preset: half the embedding, then per block the
# MLP's two weights, the attention's qkv and output weights (x3 with AdamW's moments, in any order).
LOAD_BUFFER_MIB = [46.875] + [4.5, 4.5, 3.375, 1.125] * 15


def first_touch_table(mib: int = 256, rounds: int = 9) -> dict[str, tuple[float, float]]:
    """Where a warm-page-cache load's time goes: read a ``mib`` MiB file (in the page cache) into a
    buffer in 16 MiB preads, into fresh memory (as every load's new buffers) or memory touched
    before, plain or hashed in ~1 MiB windows as a verified load does (fsdp2's CRC32C and the
    crc32c package), fresh memory advised as transparent huge pages, and ~250 MiB into fresh
    buffers sized like a 125m rank's (:data:`LOAD_BUFFER_MIB`) allocated as fsdp2's load allocates
    them (``fresh_memory.empty``: whole huge pages advised) and with ``FSDP2_LOAD_HUGEPAGES=0``.
    (median, max) ms per case, cases interleaved per round; the max shows stalls (compaction)."""
    import ctypes
    import mmap

    import numpy as np
    import torch

    from fsdp2.checkpoint import fresh_memory, integrity

    n, piece, window, block, huge = mib << 20, 16 << 20, 1 << 20, 128 << 10, 2 << 20
    path = os.path.join(tempfile.mkdtemp(prefix="bench_touch_"), "data")
    np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tofile(path)
    fd = os.open(path, os.O_RDONLY)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    touched = torch.ones(n, dtype=torch.uint8)
    fastest = integrity.choose_implementation()[1]
    package = integrity.choose_implementation(["crc32c"])[1]

    def read(buf, fn=None):
        view = memoryview(buf.numpy())
        step = window if fn else piece
        for off in range(0, n, step):
            os.preadv(fd, [view[off : off + step]], off)
            if fn:
                for b in range(off, off + step, block):
                    fn(view[b : b + block], 0)

    def fresh_huge():
        buf = torch.empty(n + huge, dtype=torch.uint8)
        start = -buf.data_ptr() % huge
        libc.madvise(buf.data_ptr() + start, n, getattr(mmap, "MADV_HUGEPAGE", 14))
        read(buf[start : start + n])

    def load_buffers(setting: str):
        os.environ[fresh_memory.ENV] = setting
        off = 0
        for size in LOAD_BUFFER_MIB:
            nbytes = int(size * (1 << 20)) // 4 * 4
            view = memoryview(fresh_memory.empty((nbytes // 4,), torch.float32).view(torch.uint8).numpy())
            for at in range(0, nbytes, piece):
                os.preadv(fd, [view[at : at + piece]], off + at)
            off += nbytes

    cases = {
        "fresh memory": lambda: read(torch.empty(n, dtype=torch.uint8)),
        f"fresh memory, hashed ({integrity.IMPLEMENTATION})": lambda: read(torch.empty(n, dtype=torch.uint8), fastest),
        "fresh memory, hashed (crc32c pkg)": lambda: read(torch.empty(n, dtype=torch.uint8), package),
        "touched memory": lambda: read(touched),
        f"touched memory, hashed ({integrity.IMPLEMENTATION})": lambda: read(touched, fastest),
        "touched memory, hashed (crc32c pkg)": lambda: read(touched, package),
        "fresh memory, MADV_HUGEPAGE": fresh_huge,
        "load buffers, fsdp2 (whole huge pages advised)": lambda: load_buffers("1"),
        "load buffers, FSDP2_LOAD_HUGEPAGES=0": lambda: load_buffers("0"),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for _ in range(rounds):
            for name, fn in cases.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    finally:
        os.close(fd)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return {name: (statistics.median(v) * 1e3, max(v) * 1e3) for name, v in times.items()}


def hash_threads_table(thread_counts: list[int], mib: int = 2048, rounds: int = 5):
    """What a rank's reader threads pay to hash, by thread count: (1) CRC32C of 256 KiB buffers
    already in cache, each thread its own, no I/O (GB/s in all); (2) a warm file of ``mib`` MiB
    read into touched memory by that many threads in 1 MiB windows, plain, with a hash call per
    128 KiB block, and with one call per window (GB/s, medians of ``rounds``). Each call releases
    the GIL; with several threads each release and re-acquire is a hand-off between them."""
    import threading

    import numpy as np

    from fsdp2.checkpoint.integrity import checksum_function

    crc = checksum_function()
    block, window = 128 << 10, 1 << 20
    hot = [np.random.default_rng(i).integers(0, 255, 256 << 10, dtype=np.uint8) for i in range(max(thread_counts))]

    def in_threads(threads, fn, *args_of):
        workers = [threading.Thread(target=fn, args=args_of[i]) for i in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - start

    def hash_hot(buf, reps=2000):
        view = memoryview(buf)
        for _ in range(reps):
            crc(view, 0)

    cached = {
        n: max(n * 2000 * (256 << 10) / in_threads(n, hash_hot, *[(hot[i],) for i in range(n)]) / 1e9 for _ in range(3))
        for n in thread_counts
    }
    with tempfile.TemporaryDirectory(prefix="bench_hash_threads_") as d:
        path = os.path.join(d, "data")
        with open(path, "wb") as f:
            chunk = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
            for _ in range(mib // 64):
                f.write(chunk)
        size = (mib // 64) * (64 << 20)
        fd = os.open(path, os.O_RDONLY)
        try:
            dest = np.ones(size, dtype=np.uint8)  # touched: no first-write faults in the timings
            view = memoryview(dest)
            os.preadv(fd, [view], 0)  # warm the page cache

            def read(lo, hi, mode):
                for off in range(lo, hi, window):
                    v = view[off : min(hi, off + window)]
                    os.preadv(fd, [v], off)
                    if mode == "per block":
                        for b in range(0, len(v), block):
                            crc(v[b : b + block], 0)
                    elif mode == "per window":
                        crc(v, 0)

            rows = []
            for n in thread_counts:
                step = size // n
                parts = [(i * step, (i + 1) * step) for i in range(n)]
                rates = {}
                for mode in ("plain", "per block", "per window"):
                    seconds = statistics.median(
                        in_threads(n, read, *[(lo, hi, mode) for lo, hi in parts]) for _ in range(rounds)
                    )
                    rates[mode] = size / seconds / 1e9
                rows.append((n, cached[n], rates))
        finally:
            os.close(fd)
    return rows


def main():
    from fsdp2.checkpoint import integrity

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", choices=sorted(MODELS), default="125m")
    parser.add_argument("--ranks", type=int, default=None, help="default: 2 on CPU, every GPU on cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank in the overlap steps")
    parser.add_argument("--cold", action="store_true", help="evict checkpoint files from the page cache before loads")
    parser.add_argument("--reshard", default="", help="comma-separated world sizes to load the checkpoint on")
    parser.add_argument("--hf", action="store_true", help="also measure load_hf (and DCP's HF reader)")
    parser.add_argument("--hashes", action="store_true", help="only print the checksum speed table")
    parser.add_argument(
        "--first-touch",
        action="store_true",
        help="only print where a warm load's time goes: reading into fresh vs touched memory, hashed or not",
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument(
        "--hash-baseline",
        nargs="?",
        const="crc32c",
        default=None,
        metavar="NAME",
        choices=list(integrity.IMPLEMENTATIONS),
        help="with --sizes: also load verified with CRC32C "
        "implementation NAME (default: crc32c, the package), paired with fsdp2's default",
    )
    parser.add_argument(
        "--page-baseline",
        action="store_true",
        help="with --sizes: also load verified with the "
        "load buffers left to 4 KiB pages (FSDP2_LOAD_HUGEPAGES=0), paired with the default",
    )
    parser.add_argument(
        "--thread-baseline",
        action="store_true",
        help="with --sizes: also load verified with "
        "LOCAL_WORLD_SIZE unset (at least 2 reader threads per rank, as before), paired with the "
        "default",
    )
    parser.add_argument(
        "--gc-baseline",
        action="store_true",
        help="with --sizes: also load verified with "
        "automatic garbage collection left running during the load (as before fsdp2 paused it), "
        "paired with the default",
    )
    parser.add_argument(
        "--no-dcp",
        action="store_true",
        help="with --sizes: leave DCP out of the rotation (only "
        "verification's cost: more rounds in the same time, a narrower interval)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="with --sizes: print every timed load (phases inside "
        "fsdp2's load, page faults, bytes from storage, /proc/vmstat deltas)",
    )
    parser.add_argument(
        "--hash-threads",
        default="",
        help="only print what reader threads pay to hash, for "
        "these comma-separated thread counts (e.g. 1,2,8,16): GIL hand-offs per call",
    )
    parser.add_argument(
        "--sizes",
        default="",
        help=f"only time loads, for these comma-separated model presets ({', '.join(MODELS)}), against DCP",
    )
    args = parser.parse_args()
    if args.hashes:
        from fsdp2.checkpoint import integrity

        print(f"fsdp2 checksums with: {integrity.IMPLEMENTATION}; load average {os.getloadavg()[0]:.1f}")
        print(f"{'hash':<38}{'GiB/s, 1 MiB in cache':>23}{'GiB/s, 256 MiB':>16}{'GIL stall':>11}")
        for name, cached, memory, stalled in hash_table():
            print(f"{name:<38}{cached:>23.1f}{memory:>16.1f}{stalled:>11.2f}")
        print(
            "GIL stall: longest pause of a Python loop while another thread hashes 256 MiB per call, as a "
            "fraction of one call (~0: the GIL is released; ~1: held)"
        )
        return
    if args.hash_threads:
        from fsdp2.checkpoint import integrity

        counts = [int(n) for n in args.hash_threads.split(",")]
        print(
            f"CRC32C {integrity.IMPLEMENTATION}, {len(os.sched_getaffinity(0))} CPUs, load average "
            f"{os.getloadavg()[0]:.1f}; read: a warm 2 GiB file into touched memory in 1 MiB windows"
        )
        print(
            f"{'threads':>7}{'hash in cache GB/s':>20}{'read GB/s':>11}"
            f"{'+ call per 128 KiB':>20}{'+ call per 1 MiB':>18}"
        )
        for n, cached, rates in hash_threads_table(counts):
            plain = rates["plain"]
            print(
                f"{n:>7}{cached:>20.1f}{plain:>11.1f}"
                f"{rates['per block']:>11.1f} ({plain / rates['per block'] - 1:.2f}x)"
                f"{rates['per window']:>10.1f} ({plain / rates['per window'] - 1:.2f}x)"
            )
        print("(x): verification cost, the hashed read's time over the plain read's, minus 1")
        return
    if args.first_touch:
        mib = 256
        print(
            f"read {mib} MiB from the page cache, one thread, load average {os.getloadavg()[0]:.1f}; "
            "medians (and maxima) of 9 interleaved rounds"
        )
        for name, (ms, worst) in first_touch_table(mib).items():
            size = sum(LOAD_BUFFER_MIB) if name.startswith("load buffers") else mib
            print(f"{name:<48}{ms:>9.1f} ms{size / 1024 / (ms / 1e3):>7.1f} GiB/s   max {worst:>7.1f} ms")
        return
    import socket

    import torch
    import torch.multiprocessing as mp

    if args.ranks is None:
        args.ranks = torch.cuda.device_count() if args.device == "cuda" else 2
    args.dir = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    if args.sizes:
        args.sizes = args.sizes.split(",")
        unknown = [n for n in args.sizes if n not in MODELS]
        if unknown:
            parser.error(f"--sizes: unknown model preset(s) {unknown}; choose from {', '.join(MODELS)}")
        mp.spawn(_sweep_worker, args=(args.ranks, port, args, out), nprocs=args.ranks, join=True)
        shutil.rmtree(args.dir, ignore_errors=True)
        _sweep_report(args, out.get())
        return
    mp.spawn(_worker, args=(args.ranks, port, args, out), nprocs=args.ranks, join=True)
    res = out.get()
    if res["hf_dir"]:
        hq = ctx.SimpleQueue()
        mp.spawn(_hf_worker, args=(args.ranks, port + 1, args, res["hf_dir"], hq), nprocs=args.ranks, join=True)
        res["hf"] = hq.get()
    reshard = None
    if args.reshard:
        worlds = [int(w) for w in args.reshard.split(",")]
        rq = ctx.SimpleQueue()
        mp.spawn(_reshard_worker, args=(res["last"], args.model, worlds, rq), nprocs=1, join=True)
        reshard = rq.get()
    shutil.rmtree(args.dir, ignore_errors=True)
    _report(args, res, reshard)


def _report(args, res, reshard):
    import torch

    gib, mb = 2**30, 1e6
    total = res["total_bytes"]
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(
        f"model {args.model} {MODELS[args.model]} + AdamW: {total / gib:.2f} GiB of state, {args.ranks} rank(s), "
        f"{device}, torch {torch.__version__}, {'cold' if args.cold else 'warm'} page cache for loads, "
        f"median of {args.repeats}"
    )
    med = {name: statistics.median(s for s, _ in vals) for name, vals in res["rows"].items()}
    rchar = {name: statistics.median(r for _, r in vals) for name, vals in res["rows"].items()}
    print(f"{'operation':<28}{'time (s)':>10}{'GiB/s':>8}{'vs DCP':>9}{'rank0 read() MB':>17}")
    for name, seconds in med.items():
        ref = med["dcp save"] if "save" in name else med["dcp load"]
        print(f"{name:<28}{seconds:>10.3f}{total / gib / seconds:>8.2f}{seconds / ref:>8.2f}x{rchar[name] / mb:>17.1f}")
    print("vs DCP = fsdp2 time / DCP time (<1: fsdp2 faster)")
    read, owned, verified = res["stats"][-1]
    print(
        f"fsdp2 verified load, rank 0: read {read / mb:.1f} MB for {owned / mb:.1f} MB owned "
        f"(ratio {read / owned:.4f}), checksummed {verified / mb:.1f} MB"
    )
    if reshard:
        for world, (r, o, worst) in reshard.items():
            print(
                f"reshard {args.ranks} -> {world} ranks, verified: bytes read / owned = {r / o:.4f} over all ranks, "
                f"worst rank {worst:.4f}"
            )
    print()
    print(f"async save (staging buffer allocations in this run: {res['allocations']})")
    print(
        f"{'':<8}{'round':<7}{'call (s)':>10}{'blocked (s)':>13}{'overlap steps':>15}{'step / normal':>15}"
        f"{'wait (s)':>10}{'total (s)':>11}"
    )
    for i, rnd in enumerate(res["async_rows"]):
        normal = rnd["normal step"]
        for name in ("fsdp2", "dcp"):
            a = rnd[name]
            ratio = statistics.median(a["overlap_steps"]) / normal if a["overlap_steps"] else float("nan")
            print(
                f"{name:<8}{i + 1:<7}{a['call']:>10.3f}{a['blocked']:>13.3f}{len(a['overlap_steps']):>15}"
                f"{ratio:>14.2f}x{a['wait']:>10.3f}{a['total']:>11.3f}"
            )
    normal = ", ".join(f"{r['normal step']:.3f}" for r in res["async_rows"])
    print(f"normal step (s), per round: {normal}")
    if res.get("hf"):
        print()
        print("load_hf (save -> consolidate -> load_hf into a fresh sharded model, fresh processes)")
        for rank, h in enumerate(res["hf"]):
            dcp_part = (
                f", DCP HuggingFaceStorageReader {h['dcp_seconds']:.3f} s"
                if "dcp_seconds" in h
                else f", DCP HF reader failed: {h.get('dcp_error')}"
            )
            print(
                f"rank {rank}: {h['seconds']:.3f} s{dcp_part}; read {h['read'] / mb:.1f} MB "
                f"for {h['owned'] / mb:.1f} MB owned; peak RSS growth {h['peak_rss_growth'] / mb:.1f} MB for "
                f"{h['shard_bytes'] / mb:.1f} MB of shards (+{(h['peak_rss_growth'] - h['shard_bytes']) / mb:.1f} MB)"
            )


if __name__ == "__main__":
    main()
