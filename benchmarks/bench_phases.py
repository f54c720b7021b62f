"""Where a step's time goes: CPU ms of forward, backward and optimizer step, per implementation.

    python benchmarks/bench_phases.py --world-size 8            # simulated world: rank 0 of 8, no-op collectives
    python benchmarks/bench_phases.py --world-size 8 --pg fake  # PyTorch's fake process group instead
    python benchmarks/bench_phases.py --world-size 1024 --paired  # all in one process, turns alternating

Each implementation (fsdp2 as users get it, whose AdamW steps the local shards as plain tensors
from its second step by default; fsdp2 with ``fsdp2.optim.step_on_dtensors``, AdamW stepping the
DTensors; PyTorch FSDP2; unsharded) runs in a fresh process on a
GPT of bench_fsdp.py with AdamW, and reports the median process CPU time (all threads, which
other load on a shared machine moves little) of each phase over --steps steps after --warmup.
With ``--paired`` they share one process and take turns step by step, so that load from other
jobs, which inflates CPU time too (cache misses, spinning threads), hits each alike.

``--model small-host`` / ``medium-host``: the small / medium GPT's structure with tiny tensors
(the same ops, groups and Python calls; the copies and the math nearly free), so that a step's
CPU time is its host work, the part a GPU cannot hide; ``small`` and ``medium`` add the CPU's
copies, which a GPU runs as kernels.

``--malloc caching`` runs the children with glibc's heap keeping freed memory (no ``mmap`` per
large buffer, no trimming), as CUDA's caching allocator keeps it: by default every buffer an FSDP
implementation frees and regrows between uses (gathered parameters, communication buffers) is
returned to the OS and faulted in again page by page, a CPU allocator's cost that a GPU step does
not have. The allocator's own counts (``torch`` storage bytes) are the same either way.

``--compiled`` measures compiled steps instead (``--backend``, default inductor): fsdp2 with the
whole model under ``torch.compile(fullgraph=True)`` (fsdp2's traced path) against eager fsdp2,
PyTorch FSDP2 eager and with each block compiled, and the unsharded model compiled whole; and
reports what PyTorch FSDP2 does under ``torch.compile(model, fullgraph=True)``. For Python calls
(``--counts``) use ``--pg fake``: PyTorch's fake process group is C++, as gloo and NCCL are, while
the no-op group's collectives are Python (~8 calls each, counted in every column).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

IMPLS = ("fsdp2", "fsdp2-dtensor", "torch", "unsharded")
COMPILED_IMPLS = ("fsdp2", "fsdp2-compiled", "torch", "torch-block-compiled", "unsharded-compiled")


def _build(impl: str, world_size: int, model_name: str, backend: str = "inductor"):
    """``impl``'s loss function and AdamW on the simulated world already initialized, and a batch.

    ``-compiled``: the whole model under ``torch.compile(fullgraph=True)``; ``-block-compiled``:
    each block compiled (``block.compile()``) before fully_shard, the way PyTorch's FSDP2 is compiled.
    """
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_fsdp import MODELS

    from fsdp2.models import GPT, GPTConfig

    cfg = GPTConfig(**MODELS[model_name])
    torch.manual_seed(0)
    model = GPT(cfg)
    if impl.endswith("-block-compiled"):
        for block in model.blocks:
            block.compile(backend=backend)
    if not impl.startswith("unsharded"):
        from torch.distributed.device_mesh import init_device_mesh

        if impl.startswith("fsdp2"):
            from fsdp2 import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if impl == "fsdp2-dtensor":
        from fsdp2.optim import step_on_dtensors

        step_on_dtensors(opt)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    run = (
        torch.compile(model, backend=backend, fullgraph=True)
        if impl.endswith("-compiled") and "block" not in impl
        else model
    )

    def loss_of(tokens):
        logits = run(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    return loss_of, opt, tokens


def torch_fsdp2_under_fullgraph(world_size: int, model_name: str, backend: str) -> str:
    """What ``torch.compile(model, fullgraph=True)`` does over PyTorch's FSDP2: its first line."""
    import torch

    loss_of, _, tokens = _build("torch-compiled", world_size, model_name, backend)
    try:
        loss_of(tokens).backward()
    except Exception as error:  # noqa: BLE001 - reported, not handled
        return f"{type(error).__name__}: " + next((line for line in str(error).splitlines() if line.strip()), "")
    finally:
        torch._dynamo.reset()
    return "ran (no error)"


def _timed_step(loss_of, opt, tokens) -> tuple[float, float, float]:
    """CPU seconds of forward, backward, optimizer step + zero_grad."""
    c0 = time.process_time()
    loss = loss_of(tokens)
    c1 = time.process_time()
    loss.backward()
    c2 = time.process_time()
    opt.step()
    opt.zero_grad(set_to_none=True)
    c3 = time.process_time()
    return c1 - c0, c2 - c1, c3 - c2


def _page_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _counts(loss_of, opt, tokens, compiled: bool = False) -> dict[str, int | str]:
    """Load-independent work of one step: ops seen by a dispatch mode and the MB they write
    (collectives excluded), Python calls, and how many of those are in DTensor's package (its
    dispatch) and in the FSDP implementation's own code. (Page faults are counted over the timed
    steps instead, see _run: one step's count depends on where glibc's heap happens to stand.)"""
    from fsdp2.tools.host_work import DTENSOR_CODE, FSDP_CODE, count_host_work

    # Dynamo does not run under the dispatch mode that counts ops: compiled steps count calls only.
    work = count_host_work(lambda: _timed_step(loss_of, opt, tokens), count_ops=not compiled)
    counts = {
        "ops": work.ops if work.ops is not None else "n/a",
        "MB written": round(work.bytes_written / 1e6, 1) if work.ops is not None else "n/a",
        "python calls": work.python_calls,
        "DTensor calls": work.calls_in(DTENSOR_CODE),
        "FSDP calls": work.calls_in(FSDP_CODE),
    }
    if compiled:  # what the compiler runs, without the optimizer (eager in every column)
        forward_backward = count_host_work(lambda: loss_of(tokens).backward(), count_ops=False)
        opt.zero_grad(set_to_none=True)
        counts["python calls, forward + backward"] = forward_backward.python_calls
    return counts


def _run(
    impls: list[str],
    world_size: int,
    steps: int,
    warmup: int,
    threads: int,
    pg: str,
    model_name: str,
    counts: bool = False,
    backend: str = "inductor",
) -> dict:
    """Median CPU ms per phase of each impl; several impls in one process take turns step by step."""
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_fsdp import init_simulated_world

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # gathered buffers hold garbage in a simulated world
    init_simulated_world(pg, world_size)
    built = {impl: _build(impl, world_size, model_name, backend) for impl in impls}
    phases = {impl: {"forward": [], "backward": [], "optimizer": []} for impl in impls}
    faults: dict[str, list[int]] = {impl: [] for impl in impls}
    for i in range(warmup + steps):
        for impl in impls if i % 2 == 0 else impls[::-1]:
            before = _page_faults()
            seconds = _timed_step(*built[impl])
            if i >= warmup:
                faults[impl].append(_page_faults() - before)
                for name, value in zip(phases[impl], seconds):
                    phases[impl][name].append(value)
    result = {
        impl: {name: 1e3 * statistics.median(v) for name, v in by_phase.items()} for impl, by_phase in phases.items()
    }
    if counts:
        for impl in impls:
            result[impl]["counts"] = {
                "page faults (median)": round(statistics.median(faults[impl])),
                **_counts(*built[impl], compiled="compiled" in impl),
            }
    if "torch-block-compiled" in impls:
        result["torch-fullgraph"] = torch_fsdp2_under_fullgraph(world_size, model_name, backend)
    dist.destroy_process_group()
    return result


def _child_env(malloc: str) -> dict[str, str]:
    env = dict(os.environ)
    if malloc == "caching":
        env["MALLOC_MMAP_THRESHOLD_"] = str(32 << 20)  # glibc's largest: buffers below it come from the heap
        env["MALLOC_TRIM_THRESHOLD_"] = str(1 << 40)  # and freed memory stays there
    return env


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pg", choices=["noop", "fake"], default="noop", help="see bench_fsdp.py --pg")
    parser.add_argument("--model", default="small", help="a model name of bench_fsdp.py")
    parser.add_argument(
        "--paired",
        action="store_true",
        help="all implementations in one process, taking turns step by step: load from other "
        "jobs hits each alike (the default gives each a fresh process of its own)",
    )
    parser.add_argument(
        "--counts",
        action="store_true",
        help="also count one step's ops and Python calls per implementation (independent of load)",
    )
    parser.add_argument(
        "--malloc",
        choices=["default", "caching"],
        default="default",
        help="caching: glibc keeps freed memory in its heap (see above)",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="compiled steps: fsdp2 whole-model fullgraph vs eager fsdp2, PyTorch FSDP2 eager and "
        "block-compiled, and the unsharded model compiled",
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile backend with --compiled")
    parser.add_argument("--impl", help=argparse.SUPPRESS)  # child process: comma-separated impls
    ns = parser.parse_args(argv)
    if ns.impl:
        print(
            json.dumps(
                _run(
                    ns.impl.split(","),
                    ns.world_size,
                    ns.steps,
                    ns.warmup,
                    ns.threads,
                    ns.pg,
                    ns.model,
                    ns.counts,
                    ns.backend,
                )
            )
        )
        return
    impls_run = COMPILED_IMPLS if ns.compiled else IMPLS
    results = {}
    for impls in [impls_run] if ns.paired else [(impl,) for impl in impls_run]:
        cmd = (
            [sys.executable, __file__, "--impl", ",".join(impls)]
            + [
                f"--{k.replace('_', '-')}={v}"
                for k, v in dict(
                    world_size=ns.world_size,
                    steps=ns.steps,
                    warmup=ns.warmup,
                    threads=ns.threads,
                    pg=ns.pg,
                    model=ns.model,
                    backend=ns.backend,
                ).items()
            ]
            + (["--counts"] if ns.counts else [])
        )
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=_child_env(ns.malloc)).stdout
        results.update(json.loads(out.strip().splitlines()[-1]))
    if ns.compiled:
        _report_compiled(results, ns)
        return
    how = "one process, turns alternating" if ns.paired else "a fresh process each"
    print(
        f"# simulated world {ns.world_size} ({ns.pg} process group), {ns.model} GPT, {ns.threads} threads, "
        f"{ns.malloc} malloc, CPU ms per step (median of {ns.steps}; {how})"
    )
    total = _print_phase_table(results, IMPLS, ns.counts)
    print(
        f"fsdp2 / PyTorch FSDP2: {total['fsdp2'] / total['torch']:.2f}x; with the optimizer on DTensors "
        f"{total['fsdp2-dtensor'] / total['torch']:.2f}x (optimizer phase {results['fsdp2']['optimizer']:.1f} "
        f"vs {results['fsdp2-dtensor']['optimizer']:.1f} ms)"
    )
    fwd_bwd = {i: results[i]["forward"] + results[i]["backward"] for i in IMPLS}
    over = {i: fwd_bwd[i] - fwd_bwd["unsharded"] for i in ("fsdp2", "torch")}
    print(
        f"forward + backward over unsharded: fsdp2 {over['fsdp2']:.1f} ms, PyTorch FSDP2 {over['torch']:.1f} ms "
        f"({over['fsdp2'] / over['torch']:.2f}x)"
        if over["torch"] > 0
        else ""
    )


def _print_phase_table(results: dict, impls, counts: bool) -> dict[str, float]:
    """The markdown table of CPU ms per phase (and counts) side by side; returns each impl's total."""
    print("| phase | " + " | ".join(impls) + " |")
    print("|---|" + "---:|" * len(impls))
    for phase in ("forward", "backward", "optimizer"):
        print(f"| {phase} | " + " | ".join(f"{results[i][phase]:.1f}" for i in impls) + " |")
    total = {i: sum(results[i][phase] for phase in ("forward", "backward", "optimizer")) for i in impls}
    print("| total | " + " | ".join(f"{total[i]:.1f}" for i in impls) + " |")
    if counts:  # compiled columns lack some counts (ops): blank there
        for name in dict.fromkeys(name for i in impls for name in results[i]["counts"]):
            print(f"| {name} per step | " + " | ".join(str(results[i]["counts"].get(name, "")) for i in impls) + " |")
    return total


def _report_compiled(results: dict, ns) -> None:
    how = "one process, turns alternating" if ns.paired else "a fresh process each"
    print(
        f"# simulated world {ns.world_size} ({ns.pg} process group), {ns.model} GPT, {ns.threads} threads, backend "
        f"{ns.backend}, CPU ms per step (median of {ns.steps} after {ns.warmup} warm-up steps; {how})"
    )
    total = _print_phase_table(results, COMPILED_IMPLS, ns.counts)
    if ns.counts:
        for key in ("python calls", "python calls, forward + backward"):
            ours, unsharded = (results[i]["counts"][key] for i in ("fsdp2-compiled", "unsharded-compiled"))
            print(f"{key} per step, compiled fsdp2 / compiled unsharded: {ours / unsharded:.2f}x")
    print(
        f"CPU per step, compiled fsdp2 / eager fsdp2: {total['fsdp2-compiled'] / total['fsdp2']:.2f}x; / PyTorch FSDP2 "
        f"eager: {total['fsdp2-compiled'] / total['torch']:.2f}x; / PyTorch FSDP2 block-compiled: "
        f"{total['fsdp2-compiled'] / total['torch-block-compiled']:.2f}x"
    )
    if "torch-fullgraph" in results:
        print(f"PyTorch FSDP2 under torch.compile(model, fullgraph=True): {results['torch-fullgraph']}")


if __name__ == "__main__":
    main()
