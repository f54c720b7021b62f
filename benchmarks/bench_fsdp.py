"""Training-step benchmark: fsdp2 vs PyTorch FSDP2 (torch.distributed.fsdp.fully_shard) vs unsharded.

    python benchmarks/bench_fsdp.py --mode cpu-gloo --model small        # 2 gloo ranks on CPU (~1-2 min)
    python benchmarks/bench_fsdp.py --mode fake --world-size 64 --model small
    python benchmarks/bench_fsdp.py --mode gpu --model 1b                 # 1 GPU, NCCL, world size 1
    python benchmarks/bench_fsdp.py --mode fake --world-size 8 --model 1b --device cuda
    python benchmarks/bench_fsdp.py --mode fake --impls fsdp2,fsdp2-int8,fsdp2-float8   # low-precision all-gather
    python benchmarks/bench_fsdp.py --mode gpu --model 1b --force-collectives --impls fsdp2,fsdp2-int8,fsdp2-float8

Every implementation runs in its own fresh process(es) (one per rank), so process groups,
meshes, allocator peaks and max RSS never leak from one into the next. Each builds the same
GPT from the same seed, trains on the same batch, and applies fully_shard per block then to
the root (fsdp2 and PyTorch FSDP2 identically). A step is forward + loss + backward +
optimizer.step() + zero_grad(set_to_none=True); we report the median (and min) of --steps
steps after --warmup steps, pooled over --rounds fresh runs of every implementation
(order alternating between rounds, which evens out load from other processes).

``CPU ms/step`` is the process's CPU time per step (all its threads, ``time.process_time``):
on a machine shared with other jobs it moves far less than wall-clock time, so it is the
better comparison of fsdp2's and PyTorch FSDP2's own overhead in fake mode (where no real
communication is waited on). With real ranks it leaves out time spent waiting for peers.

Memory columns:
- ``state``: bytes this rank holds between steps for params + grads + optimizer state (exact);
- ``peak alloc``: the allocator's peak over one training step, activations included. On GPU
  ``torch.cuda.max_memory_allocated`` over the timed steps. On CPU (exact too) the state held
  between steps (params + optimizer state) plus the highest allocation above it during one
  extra, untimed step, measured by ``fsdp2.tools.memory_meter.PeakMemory`` from the CPU allocator's
  profiler events (every allocation, free and storage resize). Allocator caching, oneDNN/BLAS
  scratch and Python objects are not in it;
- ``max RSS delta`` (CPU): the process's max RSS minus its RSS before the model was built (rough:
  allocator caching, thread arenas and the import-time high-water mark blur it).
For fsdp2 the ``predicted`` peak is ``fsdp2.tools.estimate.estimate_memory(..., sample_input=...)``
on a meta copy of the model (a dry run of the step on meta; see fsdp2/tools/meta_step.py), printed
with measured/predicted.

Modes:
- ``cpu-gloo``: 2 (or --world-size) gloo ranks on CPU, one thread each;
- ``gpu``: NCCL, world size 1 (sharding is trivial; measures fsdp2's own overhead);
- ``fake``: one process as rank 0 of --world-size ranks, so this simulates rank 0's memory and
  compute, not the communication time. ``--pg noop`` (default, fsdp2.tools.noop_pg): collectives do
  nothing at all (buffers keep whatever they held), so the cost measured is the implementation's
  own at any N. ``--pg fake``: PyTorch's fake process group, whose all-gathers copy the input
  into each of the N output chunks (N copies per all-gather: at N = 1024 that copying dominates
  the step). Gathered values are garbage (denormals are flushed so they cannot slow CPU math
  down); losses are meaningless there.
``fsdp2-int8`` / ``fsdp2-float8`` are fsdp2 with ``set_all_gather_policy(AllGatherPolicy(dtype))``
on every group (1-D parameters exact). ``--force-collectives`` runs fsdp2's collectives even in
one-rank shard groups (world size 1), which otherwise skip them (and quantization with them).
The unsharded baseline is a plain replica per rank with the same optimizer and no gradient
sync at all: the compute-only floor, not a DDP run. With --model 1b it uses bf16 autocast,
the counterpart of the FSDP runs' bf16 params + fp32 reduce MixedPrecisionPolicy.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import time
import traceback
import warnings

MiB = 2**20
IMPLS = ("fsdp2", "torch", "unsharded")
EXTRA_IMPLS = ("fsdp2-local", "floor")  # --local-step, --floor
QUANTIZED = {"fsdp2-int8": "int8", "fsdp2-float8": "float8_e4m3fn"}  # fsdp2 + AllGatherPolicy(dtype)

# dim 2048, 18 layers, 16 heads, vocab 32000, seq 2048: 1.04B params untied
# (16 layers would be ~0.94B).
MODELS = {
    "small": dict(vocab_size=2048, seq_len=128, dim=256, n_layers=4, n_heads=4),
    "medium": dict(vocab_size=8192, seq_len=256, dim=512, n_layers=8, n_heads=8),  # 33.8M params
    "1b": dict(vocab_size=32000, seq_len=2048, dim=2048, n_layers=18, n_heads=16),
    # small's and medium's structure (same modules, groups, parameters and ops) with tiny tensors:
    # a step's CPU time is then its host work, as on a GPU, where the copies are kernels
    "small-host": dict(vocab_size=64, seq_len=8, dim=32, n_layers=4, n_heads=4),
    "medium-host": dict(vocab_size=64, seq_len=8, dim=32, n_layers=8, n_heads=8),
}
DEFAULT_BATCH = {"small": 4, "medium": 4, "1b": 4, "small-host": 1, "medium-host": 1}  # sequences per rank


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class _TorchCommCounter:
    """Counts PyTorch FSDP2's collectives by wrapping the c10d functions it calls (bench only).

    Same convention as fsdp2.tools.comm_stats: all-gather output bytes, reduce-scatter input bytes.
    """

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.bytes = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        ag = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        rs = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
        self.names = {ag: ("all_gather", 0), rs: ("reduce_scatter", 1)}  # which arg is counted

    def __enter__(self):
        self.saved = {}
        for name, (kind, argi) in self.names.items():
            orig = getattr(self.dist, name)
            self.saved[name] = orig

            def wrapper(*args, _orig=orig, _kind=kind, _argi=argi, **kwargs):
                t = args[_argi] if len(args) > _argi else kwargs["input" if _argi else "output"]
                self.bytes[_kind] += t.numel() * t.element_size()
                return _orig(*args, **kwargs)

            setattr(self.dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, orig in self.saved.items():
            setattr(self.dist, name, orig)


def fastest_adamw(params):
    """The benchmark's AdamW, fused where the device has the kernel, else foreach; and its name."""
    import torch

    try:
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True), "fused AdamW"
    except RuntimeError:  # no fused kernel for this device
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=True), "foreach AdamW"


class FloorStep:
    """What a step must cost at least, in three parts timed apart (``--floor``).

    1. forward + backward of the model held in the compute dtype (bf16 with --bf16), no FSDP;
    2. what fp32 master weights add to that: the fp32 -> bf16 cast of every parameter for forward
       and again for backward (FSDP re-gathers resharded blocks), and the bf16 -> fp32 copy of
       every gradient (none of it with fp32 compute);
    3. the optimizer step on plain fp32 tensors (fused AdamW where the device has it, else foreach).
    """

    def __init__(self, model, compute_dtype, device, sync):
        import torch

        self.model = model.to(compute_dtype)
        self.params = list(self.model.parameters())
        self.sync = sync
        if compute_dtype == torch.float32:
            self.masters, self.master_grads = self.params, None
        else:
            self.masters = [torch.nn.Parameter(p.detach().float()) for p in self.params]
            self.master_grads = [torch.zeros_like(m) for m in self.masters]
            for m, g in zip(self.masters, self.master_grads):
                m.grad = g
        self.optimizer, self.optimizer_kind = fastest_adamw(self.masters)
        self.parts: dict[str, list[float]] = {}

    def part_names(self) -> tuple[str, str, str]:
        return (
            "forward+backward",
            "fp32 masters: 2 casts + grad copy",
            f"optimizer ({self.optimizer_kind}, plain tensors)",
        )

    def step(self, inputs, targets):
        import torch

        marks = [time.perf_counter()]
        loss = self.model.loss(inputs, targets)
        loss.backward()
        self.sync()
        marks.append(time.perf_counter())
        if self.master_grads is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.master_grads, [p.grad for p in self.params])
                for _ in range(2):  # forward's cast, and backward's after a reshard
                    torch._foreach_copy_([p.data for p in self.params], self.masters)
        self.sync()
        marks.append(time.perf_counter())
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        self.sync()
        marks.append(time.perf_counter())
        for name, t0, t1 in zip(self.part_names(), marks, marks[1:]):
            self.parts.setdefault(name, []).append(t1 - t0)
        return loss


def init_simulated_world(pg: str, world_size: int) -> None:
    """Make this process rank 0 of ``world_size``: ``noop`` collectives do nothing at all
    (fsdp2.tools.noop_pg); PyTorch's ``fake`` ones copy each all-gather's input into all N output chunks."""
    import torch.distributed as dist

    if pg == "noop":
        from fsdp2.tools.noop_pg import init_noop_process_group

        init_noop_process_group(world_size)
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def _worker(rank: int, args: dict, impl: str, port: int, queue) -> None:
    try:
        queue.put((rank, _run_impl(rank, args, impl, port)))
    except BaseException:  # noqa: BLE001 - report to the parent
        queue.put((rank, {"error": traceback.format_exc()}))


def _run_impl(rank: int, args: dict, impl: str, port: int) -> dict:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    mode, ws = args["mode"], args["world_size"]
    torch.set_num_threads(args["threads"])
    on_gpu = args["device"] == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")

    if mode == "fake":
        init_simulated_world(args["pg"], ws)
        # Gathered buffers hold uninitialized memory here; denormals in it would make CPU
        # matmuls crawl and skew the comparison. Flushing them costs nothing otherwise.
        torch.set_flush_denormal(True)
    else:
        dist.init_process_group(
            "nccl" if on_gpu else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=ws,
            timeout=datetime.timedelta(seconds=300),
        )

    from fsdp2.tools.estimate import local_bytes as _local_bytes
    from fsdp2.tools.estimate import optimizer_state_bytes
    from fsdp2.models import GPT, GPTConfig
    from fsdp2.models.gpt import Block

    cfg = GPTConfig(**MODELS[args["model"]])
    bf16 = args["bf16"]
    rss_before = _rss_bytes()
    g = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (args["batch"], cfg.seq_len + 1), generator=g).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)

    estimate = None
    autocast = contextlib.nullcontext()  # the unsharded bf16 baseline autocasts instead
    floor = None
    ours = impl.startswith("fsdp2")  # fsdp2, fsdp2-local, fsdp2-int8, fsdp2-float8
    all_gather_policy = None
    if impl in QUANTIZED:
        from fsdp2 import AllGatherPolicy

        all_gather_policy = AllGatherPolicy(getattr(torch, QUANTIZED[impl]))
    if ours or impl == "torch":
        from torch.distributed.device_mesh import init_device_mesh

        if ours:
            from fsdp2 import MixedPrecisionPolicy, fully_shard
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (ws,))
        mp_policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else MixedPrecisionPolicy()
        )
        if ours:
            from fsdp2 import MixedPrecisionPolicy as MP
            from fsdp2.tools.estimate import estimate_memory

            with torch.device("meta"):
                meta_model = GPT(cfg)
            estimate = estimate_memory(
                meta_model,
                mesh,
                groups=lambda m: isinstance(m, Block),
                mp_policy=mp_policy if bf16 else MP(),
                sample_input=(inputs, targets),
                loss_fn=lambda m, x, y: m.loss(x, y),
                all_gather_policy=all_gather_policy,
                kernel_scratch=device,  # the measured run uses this device's kernels
            )
            del meta_model
        shard_kwargs = dict(mesh=mesh, mp_policy=mp_policy)
        if args["offload"]:
            if ours:
                from fsdp2 import CPUOffloadPolicy
            else:
                from torch.distributed.fsdp import CPUOffloadPolicy
            shard_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=on_gpu)  # pinning needs an accelerator
        if args["compile"] == "blocks" or (args["compile"] == "model" and not ours):
            for block in model.blocks:
                block.compile()
        communicate = contextlib.nullcontext()
        if ours and args["force_collectives"]:
            from fsdp2.runtime.schedule import always_communicate

            communicate = always_communicate()
        with communicate:
            for block in model.blocks:
                fully_shard(block, **shard_kwargs)
            fully_shard(model, **shard_kwargs)
        if all_gather_policy is not None:
            model.set_all_gather_policy(all_gather_policy)
    elif impl == "floor":
        floor = FloorStep(
            model,
            torch.bfloat16 if bf16 else torch.float32,
            device,
            torch.cuda.synchronize if on_gpu else (lambda: None),
        )
    elif bf16:
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    if floor is not None:
        optimizer = floor.optimizer
    elif impl == "fsdp2-local":
        from fsdp2.optim import step_on_local_shards

        optimizer, _ = fastest_adamw(model.parameters())  # the floor's optimizer, on the local shards
        step_on_local_shards(optimizer)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    if ours and args["compile"] == "model":
        compiled = torch.compile(model, fullgraph=True)

        def loss_of(x, y):
            return torch.nn.functional.cross_entropy(compiled(x).flatten(0, 1).float(), y.flatten())
    else:
        if impl == "unsharded" and args["compile"] != "none":
            for block in model.blocks:
                block.compile()
        loss_of = model.loss

    def step():
        if floor is not None:
            return floor.step(inputs, targets)
        with autocast:
            loss = loss_of(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def sync():
        if on_gpu:
            torch.cuda.synchronize()
        if mode != "fake" and ws > 1:
            dist.barrier()

    for _ in range(args["warmup"]):
        step()
    sync()

    # Comm bytes of one step (counted outside the timed steps).
    comm = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    if ours and args["compile"] == "model":
        comm = dict.fromkeys(comm)  # unknown (printed "-"): the collectives are graph ops, count_comm refuses them
    elif ours:
        from fsdp2.tools.comm_stats import count_comm

        with count_comm() as stats:
            step()
        comm = dict(stats.bytes)
    elif impl == "torch":
        with _TorchCommCounter() as counter:
            step()
        comm = dict(counter.bytes)
    sync()

    # State held between steps: grads exist right after backward, before zero_grad.
    params = list(model.parameters())
    with autocast:
        loss = model.loss(inputs, targets)
    loss.backward()
    state = dict(
        params=_local_bytes(params),
        grads=_local_bytes(p.grad for p in params if p.grad is not None),
        optimizer=optimizer_state_bytes(optimizer),
    )
    if floor is not None and floor.master_grads is not None:
        state["params"] += _local_bytes(floor.masters)
        state["grads"] += _local_bytes(floor.master_grads)
    optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    del loss
    gc.collect()
    sync()

    cpu_peak = None
    if not on_gpu:
        # One untimed step under the meter (the profiler slows it down), from the quiet point
        # after zero_grad: nothing older is freed inside it, which keeps the measurement exact.
        from fsdp2.tools.memory_meter import PeakMemory

        with PeakMemory("cpu") as meter:
            step()
        cpu_peak = state["params"] + state["optimizer"] + meter.peak_bytes
        gc.collect()
        sync()

    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    if floor is not None:
        floor.parts.clear()
    times, cpu_times = [], []
    for _ in range(args["steps"]):
        c0 = time.process_time()
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    sync()
    result = dict(
        impl=impl,
        times=times,
        cpu_times=cpu_times,
        median_s=statistics.median(times),
        min_s=min(times),
        state=state,
        comm=comm,
        rss_delta=_max_rss_bytes() - rss_before,
        num_params=cfg.num_params(),
        parts=floor.parts if floor is not None else None,
    )
    result["peak_alloc"] = torch.cuda.max_memory_allocated() if on_gpu else cpu_peak
    if estimate is not None:
        result["estimate"] = dict(
            peak=estimate.peak,
            activations=estimate.activations,
            sharded_state=estimate.sharded_state,
            total=estimate.total,
            peak_gathered=estimate.peak_gathered_params,
            comm=estimate.comm_bytes_per_step,
            table=str(estimate),
        )
    model = optimizer = None  # freed before the next measurement
    gc.collect()
    if mode != "fake" and ws > 1:
        dist.barrier()
    dist.destroy_process_group()
    return result


def _launch(args: dict, impl: str) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nproc = 1 if args["mode"] == "fake" else args["world_size"]
    procs = [ctx.Process(target=_worker, args=(r, args, impl, port, queue)) for r in range(nproc)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, res = queue.get(timeout=args["timeout"])
        results[rank] = res
    for p in procs:
        p.join()
    errors = [f"rank {r}:\n{res['error']}" for r, res in results.items() if "error" in res]
    if errors:
        raise RuntimeError(f"{impl} failed:\n" + "\n".join(errors))
    return results[0]


def _fmt_mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:,.1f}"


def render(args: dict, results: dict[str, dict]) -> str:
    on_gpu = args["device"] == "cuda"
    est = results.get("fsdp2", {}).get("estimate")
    head = (
        "| impl | step ms (median) | step ms (min) | CPU ms/step (median) | state MiB (params+grads+optim) |"
        " peak alloc MiB |"
    )
    head += "" if on_gpu else " max RSS delta MiB |"
    head += " predicted peak MiB | measured / predicted | all-gather MiB/step | reduce-scatter MiB/step |"
    lines = [head, "|" + "---|" * head.count(" |")]
    for impl, r in results.items():
        st = r["state"]
        own = r.get("estimate")
        predicted = own["peak"] if own and own.get("peak") else None
        row = (
            f"| {impl} | {1e3 * r['median_s']:.1f} | {1e3 * r['min_s']:.1f} | "
            f"{1e3 * statistics.median(r['cpu_times']):.1f} | "
            f"{_fmt_mib(st['params'] + st['grads'] + st['optimizer'])} | {_fmt_mib(r.get('peak_alloc'))} |"
        )
        row += "" if on_gpu else f" {_fmt_mib(r['rss_delta'])} |"
        row += (
            f" {_fmt_mib(predicted)} | {r['peak_alloc'] / predicted:.3f} |"
            if predicted and r.get("peak_alloc")
            else " - | - |"
        )
        row += f" {_fmt_mib(r['comm']['all_gather'])} | {_fmt_mib(r['comm']['reduce_scatter'])} |"
        lines.append(row)
    out = ["\n".join(lines), ""]

    def ratio(a: str, b: str, key) -> str:
        if a not in results or b not in results:
            return "-"
        x, y = key(results[a]), key(results[b])
        return f"{x / y:.2f}x" if y else "-"

    t = lambda r: r["median_s"]  # noqa: E731
    c = lambda r: statistics.median(r["cpu_times"])  # noqa: E731
    s = lambda r: sum(r["state"].values())  # noqa: E731
    p = lambda r: r["peak_alloc"]  # noqa: E731
    out.append(
        f"fsdp2 / PyTorch FSDP2: step time {ratio('fsdp2', 'torch', t)}, CPU time {ratio('fsdp2', 'torch', c)}, "
        f"state {ratio('fsdp2', 'torch', s)}, peak alloc {ratio('fsdp2', 'torch', p)}"
    )
    out.append(
        f"fsdp2 / unsharded:     step time {ratio('fsdp2', 'unsharded', t)}, state {ratio('fsdp2', 'unsharded', s)}, "
        f"peak alloc {ratio('fsdp2', 'unsharded', p)}"
    )
    if "fsdp2-local" in results:
        out.append(
            f"fsdp2-local (fsdp2.optim.step_on_local_shards) / PyTorch FSDP2: "
            f"step time {ratio('fsdp2-local', 'torch', t)}, "
            f"CPU time {ratio('fsdp2-local', 'torch', c)}; / fsdp2: step time {ratio('fsdp2-local', 'fsdp2', t)}"
        )
    if "floor" in results:
        parts = results["floor"]["parts"]
        medians = {name: 1e3 * statistics.median(v) for name, v in parts.items()}
        out.append(
            "floor parts (median ms): "
            + ", ".join(f"{name} {ms:.1f}" for name, ms in medians.items())
            + f"; sum {sum(medians.values()):.1f}"
        )
        others = [impl for impl in results if impl != "floor"]
        out.append(
            "step time / floor: "
            + ", ".join(f"{impl} {ratio(impl, 'floor', t)}" for impl in others)
            + "; CPU time / floor: "
            + ", ".join(f"{impl} {ratio(impl, 'floor', c)}" for impl in others)
        )
    g = lambda r: r["comm"]["all_gather"]  # noqa: E731
    for q in QUANTIZED:
        if q in results:
            out.append(
                f"{q} / fsdp2: step time {ratio(q, 'fsdp2', t)}, CPU time {ratio(q, 'fsdp2', c)}, "
                f"all-gather bytes {ratio(q, 'fsdp2', g)} "
                f"(predicted {_fmt_mib(results[q]['estimate']['comm']['all_gather'])} MiB)"
            )
    if est:
        f = results["fsdp2"]
        out.append(
            f"fsdp2 estimate (fsdp2.tools.estimate, rank 0): state {_fmt_mib(est['sharded_state'])} MiB "
            f"(measured {_fmt_mib(sum(f['state'].values()))}); comm all-gather {_fmt_mib(est['comm']['all_gather'])} / "
            f"reduce-scatter {_fmt_mib(est['comm']['reduce_scatter'])} MiB (counted "
            f"{_fmt_mib(f['comm']['all_gather'])} / {_fmt_mib(f['comm']['reduce_scatter'])}); "
            f"activations saved for backward {_fmt_mib(est['activations'])} MiB; "
            f"predicted step peak {_fmt_mib(est['peak'])} MiB (measured {_fmt_mib(f.get('peak_alloc'))})"
        )
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["cpu-gloo", "gpu", "fake"], required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--world-size", type=int, default=None, help="cpu-gloo: 2; gpu: 1; fake: 8")
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank (default 4)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (CPU: 10, GPU: 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the impls this many times, alternating order; step times are pooled"
    )
    parser.add_argument(
        "--impls",
        default=",".join(IMPLS),
        help="comma-separated subset of " + ",".join((*IMPLS, *EXTRA_IMPLS, *QUANTIZED)),
    )
    parser.add_argument(
        "--local-step",
        action="store_true",
        help="add fsdp2-local: fsdp2 with fsdp2.optim.step_on_local_shards(optimizer), which steps "
        "AdamW on the local shards as plain tensors (no DTensor dispatch), fused where the "
        "device has the kernel (the floor's optimizer; the other rows use AdamW's default)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="add floor: the compute-dtype model without FSDP, plus what fp32 masters must cost "
        "(casts, grad copy) and a fused AdamW step on plain tensors, timed apart (see FloorStep)",
    )
    parser.add_argument(
        "--pg",
        choices=["noop", "fake"],
        default="noop",
        help="fake mode's process group: noop (fsdp2.tools.noop_pg, collectives do nothing) or "
        "PyTorch's fake (its all-gathers copy the input into every rank's chunk)",
    )
    parser.add_argument(
        "--force-collectives",
        action="store_true",
        help="fsdp2: all-gather and reduce-scatter even in one-rank shard groups (world size 1)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="gpu mode: cuda; else cpu")
    parser.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 params + fp32 reduce (default: on for 1b, off for small)",
    )
    parser.add_argument(
        "--compile",
        choices=["none", "model", "blocks"],
        default="none",
        help="model: fsdp2 under torch.compile(model, fullgraph=True) (its traced path), PyTorch "
        "FSDP2 and unsharded with each block compiled (PyTorch FSDP2 cannot run fullgraph); "
        "blocks: every implementation with each block compiled",
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help="CPUOffloadPolicy (pinned on GPU) for both FSDP implementations (shards and "
        "optimizer step on the host; meaningful with --device cuda)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process")
    parser.add_argument("--json", default="", help="also write raw results here")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for one implementation")
    ns = parser.parse_args(argv)

    args = vars(ns).copy()
    if args["device"] is None:
        args["device"] = "cuda" if ns.mode == "gpu" else "cpu"
    if args["device"] == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("--device cuda / --mode gpu needs a CUDA GPU")
    args["world_size"] = ns.world_size or {"cpu-gloo": 2, "gpu": 1, "fake": 8}[ns.mode]
    if ns.mode == "gpu" and args["world_size"] > 1:
        import torch

        if torch.cuda.device_count() < args["world_size"]:
            sys.exit(f"--mode gpu --world-size {args['world_size']} needs that many GPUs")
    args["batch"] = ns.batch or DEFAULT_BATCH[ns.model]
    args["steps"] = ns.steps or (20 if args["device"] == "cuda" else 10)
    args["bf16"] = (ns.model == "1b") if ns.bf16 is None else ns.bf16
    nproc = 1 if ns.mode == "fake" else args["world_size"]
    args["threads"] = ns.threads or max(1, (os.cpu_count() or 1) // nproc)
    impls = [i for i in ns.impls.split(",") if i]
    impls += [extra for extra, wanted in zip(EXTRA_IMPLS, (ns.local_step, ns.floor)) if wanted and extra not in impls]
    known = (*IMPLS, *EXTRA_IMPLS, *QUANTIZED)
    unknown = set(impls) - set(known)
    if unknown:
        sys.exit(f"unknown --impls {sorted(unknown)}; choose from {known}")

    import torch

    cfg = MODELS[ns.model]
    print(
        f"# mode={ns.mode}{' pg=' + ns.pg if ns.mode == 'fake' else ''} world_size={args['world_size']} "
        f"device={args['device']} model={ns.model} {cfg} "
        f"batch/rank={args['batch']} bf16={args['bf16']} steps={args['steps']} warmup={args['warmup']} "
        f"threads/proc={args['threads']} force_collectives={args['force_collectives']} compile={ns.compile} "
        f"torch={torch.__version__}",
        flush=True,
    )
    results = {}
    for round_ in range(ns.rounds):
        # Alternate the order so that slow drift or other load on the machine hits every impl alike.
        for impl in impls if round_ % 2 == 0 else impls[::-1]:
            t0 = time.perf_counter()
            res = _launch(args, impl)
            print(
                f"#   round {round_ + 1} {impl}: median {1e3 * res['median_s']:.1f} ms, "
                f"done in {time.perf_counter() - t0:.1f}s",
                flush=True,
            )
            if impl not in results:
                results[impl] = res  # memory and comm figures: first round
            else:
                results[impl]["times"] += res["times"]
                results[impl]["cpu_times"] += res["cpu_times"]
                for name, values in (res["parts"] or {}).items():
                    results[impl]["parts"][name] += values
    for res in results.values():  # step times pooled over rounds
        res["median_s"], res["min_s"] = statistics.median(res["times"]), min(res["times"])
    print(f"# {results[impls[0]]['num_params'] / 1e6:.2f}M params")
    print(render(args, results))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(dict(args=args, results=results), f, indent=1)


if __name__ == "__main__":
    main()
