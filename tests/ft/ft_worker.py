"""One rank of one replica group in tests/ft/test_ft.py's fault-tolerant HSDP runs (a subprocess).

Trains a small MLP with fsdp2 (or PyTorch's FSDP2, ``--impl torch``) under torchft until the
job's committed step reaches ``--steps``, injecting the failure it is told to, and writes its
shards of the parameters and optimizer state and its step log to ``--out``. Gates (files in
``--gates``) pin the step at which a restarted group joins, so the failure schedule, and hence
every parameter bit, is the same from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def build_model(impl: str, mesh, hidden: int, wrap: str = "layers") -> nn.Module:
    """``wrap``: "layers" fully_shards each Linear then the root, "root" the root only."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp2 import fully_shard
    torch.manual_seed(0)
    # Odd sizes: the shards are uneven (padded) on 2 ranks.
    model = nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 7))
    if wrap == "layers":
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def batch(step: int, replica: int, shard_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * replica + shard_rank)
    return torch.randn(4, 10, generator=g), torch.randn(4, 7, generator=g)


def wait_for(path: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {path} never opened")
        time.sleep(0.02)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["fsdp2", "torch"], default="fsdp2")
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--incarnation", type=int, default=0)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--hidden", type=int, default=33)
    ap.add_argument("--wrap", choices=["layers", "root"], default="layers", help="which modules are fully_shard'ed")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gates", required=True)
    ap.add_argument("--die-before-step", type=int, default=-1, help="SIGKILL before joining this step's quorum")
    ap.add_argument("--die-in-all-reduce", type=int, default=-1, help="SIGKILL in this step's first all-reduce")
    ap.add_argument("--die-while-healing", action="store_true", help="SIGKILL while loading a peer's state")
    ap.add_argument("--gate-at", type=int, nargs="*", default=[], help="before these steps wait for gates/go_<step>")
    ap.add_argument("--timeout", type=float, default=15.0, help="seconds a dead peer may stall a collective")
    ap.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True) for the steps")
    ap.add_argument("--after-close", action="store_true", help="after close(), one backward beside a model without ft")
    args = ap.parse_args()

    from fsdp2.ft import FaultTolerantHSDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(args.impl, mesh, args.hidden, args.wrap)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if args.compile else model
    gates, out = Path(args.gates), Path(args.out)
    tag = f"r{args.replica}i{args.incarnation}s{rank}"
    timeout = timedelta(seconds=args.timeout)
    in_step = {"step": -1, "all_reduces": 0}

    class InjectedFailures(FaultTolerantHSDP):
        def _all_reduce_across_replicas(self, reduced):
            if in_step["step"] == args.die_in_all_reduce and in_step["all_reduces"] == 0:
                _die()
            in_step["all_reduces"] += 1
            super()._all_reduce_across_replicas(reduced)

        def load_state_dict(self, state):
            if args.die_while_healing:
                _die()
            super().load_state_dict(state)

    ft = InjectedFailures(
        model,
        optimizer,
        replica_id=f"replica_{args.replica}",
        timeout=timeout,
        quorum_timeout=timedelta(seconds=180),
        manager_kwargs={"hostname": "localhost"},
    )
    (gates / f"started_{tag}").touch()
    log = []
    try:
        while ft.step < args.steps:
            step = ft.step
            if step == args.die_before_step:
                (gates / f"killed_{tag}").write_text(repr(time.time()))  # for benchmarks/bench_ft.py
                _die()
            if step in args.gate_at:
                (gates / f"at_{step}_{tag}").touch()
                wait_for(gates / f"go_{step}")
            t0 = time.time()
            ft.begin_step()
            begin_s = time.time() - t0
            step = ft.step  # a healed group takes its peer's step
            in_step.update(step=step, all_reduces=0)
            x, y = batch(step, args.replica, rank)
            nn.functional.mse_loss(run(x), y).backward()
            committed = ft.commit_step()
            log.append(
                {
                    "step": step,
                    "committed": committed,
                    "participants": ft.participants,
                    "begin_s": begin_s,
                    "end": time.time(),
                }
            )
    except Exception as e:  # noqa: BLE001 (reported to the test through the result file)
        (out / f"error_{tag}.txt").write_text(f"{type(e).__name__}: {e}")
        ft.close()
        sys.exit(3)
    state = {
        "params": {n: p.to_local().clone() for n, p in model.named_parameters()},
        "optimizer": {
            i: {
                k: (v.to_local() if isinstance(v, torch.distributed.tensor.DTensor) else v).clone()
                for k, v in s.items()
            }
            for i, s in enumerate(optimizer.state[p] for p in model.parameters())
        },
    }
    torch.save(state, out / f"state_{tag}.pt")
    (out / f"log_{tag}.json").write_text(json.dumps(log))
    ft.close()
    if args.after_close:
        (out / f"after_close_{tag}.json").write_text(json.dumps(after_close(args, mesh, model, run, rank)))
    dist.destroy_process_group()


def after_close(args, mesh, model: nn.Module, run, rank: int) -> dict[str, tuple[bool, float]]:
    """The closed model's gradients against those of the same model without ft (both compiled
    with ``--compile``): per parameter, whether they are equal bitwise, and the largest difference."""
    twin = build_model(args.impl, mesh, args.hidden, args.wrap)
    twin.load_state_dict(model.state_dict())
    twin_run = torch.compile(twin, backend="aot_eager", fullgraph=True) if args.compile else twin
    x, y = batch(args.steps, args.replica, rank)
    for m, f in ((model, run), (twin, twin_run)):
        m.zero_grad(set_to_none=True)
        nn.functional.mse_loss(f(x), y).backward()
    return {
        n: (
            torch.equal(p.grad.to_local(), q.grad.to_local()),
            (p.grad.to_local() - q.grad.to_local()).abs().max().item(),
        )
        for (n, p), q in zip(model.named_parameters(), twin.parameters())
    }


if __name__ == "__main__":
    main()
