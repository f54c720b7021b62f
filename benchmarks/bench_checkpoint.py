"""Save/load time and bytes read: fsdp2.checkpoint vs torch.distributed.checkpoint (DCP).

Both save and load the same sharded model state dict (DTensors, Shard(0) on a 1D
mesh) on a CPU gloo world started with torch.multiprocessing.spawn. Each timing is
the slowest rank's, the median of --repeats runs, between barriers.

    python benchmarks/bench_checkpoint.py --ranks 2 --layers 24 --hidden 2048

Files land in the page cache (no cache dropping): the figures compare the two
implementations' CPU/IO-path costs, not disk speed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def _rchar() -> int:
    """Bytes this process read through read() syscalls (mmap reads are not counted)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _timed(fn):
    import torch
    import torch.distributed as dist

    dist.barrier()
    start, rchar = time.perf_counter(), _rchar()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item(), _rchar() - rchar


def _worker(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fsdp2.checkpoint as ck

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))

    def build():
        with torch.device("cpu"):
            model = nn.Sequential(*[nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)])
        for layer in model:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    model, target = build(), build()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = {}
    for rep in range(args.repeats):
        base = os.path.join(args.dir, f"rep{rep}")
        ours, theirs = os.path.join(base, "fsdp2"), os.path.join(base, "dcp")
        stats = [ck.LoadStats(), ck.LoadStats()]
        results = {
            "fsdp2 save": _timed(lambda: ck.save(ours, model)),
            "dcp save": _timed(lambda: dcp.save(model.state_dict(), checkpoint_id=theirs)),
            "fsdp2 load (verify)": _timed(lambda: ck.load(ours, target, stats=stats[0])),
            "fsdp2 load (no verify)": _timed(lambda: ck.load(ours, target, verify=False, stats=stats[1])),
        }

        def dcp_load():
            sd = target.state_dict()
            dcp.load(sd, checkpoint_id=theirs)

        results["dcp load"] = _timed(dcp_load)
        for name, (seconds, rchar) in results.items():
            rows.setdefault(name, []).append((seconds, rchar))
        rows.setdefault("_stats", []).append((stats[1].bytes_read, stats[1].bytes_owned, stats[0].bytes_verified))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    if rank == 0:
        out.put((nbytes, rows))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    import socket

    import torch.multiprocessing as mp

    args.dir = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(_worker, args=(args.ranks, port, args, out), nprocs=args.ranks, join=True)
    nbytes, rows = out.get()
    shutil.rmtree(args.dir, ignore_errors=True)

    mb = 1e6
    print(f"model: {args.layers} x Linear({args.hidden}, {args.hidden}) fp32 = {nbytes / mb:.0f} MB, "
          f"{args.ranks} ranks (gloo, CPU), median of {args.repeats}")
    read, owned, verified = rows.pop("_stats")[-1]
    med = {name: statistics.median(s for s, _ in vals) for name, vals in rows.items()}
    rchar = {name: statistics.median(r for _, r in vals) for name, vals in rows.items()}
    print(f"{'operation':<24}{'time (s)':>10}{'MB/s':>10}{'rank0 read() MB':>17}{'vs DCP':>9}")
    for name, seconds in med.items():
        ref = med["dcp save"] if "save" in name else med["dcp load"]
        print(f"{name:<24}{seconds:>10.3f}{nbytes / mb / seconds:>10.0f}{rchar[name] / mb:>17.1f}"
              f"{ref / seconds:>8.2f}x")
    print(f"fsdp2 rank 0: tensor bytes read {read / mb:.1f} MB for {owned / mb:.1f} MB owned "
          f"(ratio {read / owned:.3f}); checksum pass reads {verified / mb:.1f} MB")
    print("'vs DCP' = DCP time / fsdp2 time (>1: fsdp2 faster). read() MB counts read syscalls only; "
          "safetensors reads through mmap, so fsdp2's tensor reads show in the line above instead.")


if __name__ == "__main__":
    main()
