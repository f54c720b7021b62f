"""Correctness of fsdp2 on a real device before timing it: the first thing to run on a lent GPU.

    python benchmarks/gpu_check.py --device cuda     # one GPU, NCCL, world size 1 (+ fake world 8)
    python benchmarks/gpu_check.py --device cpu      # the same checks on CPU (gloo), as a dry run

CI has no GPU, so the CUDA stream path (fsdp2/runtime/streams.py) is only checked there by
tests/runtime/test_streams.py with recording stand-in streams. Here it runs for real: one rank trains
a small GPT with fsdp2 for a few AdamW steps next to an unsharded copy on the same device, and
every parameter must match. At world size 1 a shard group normally skips its collectives; the
``collectives`` cases turn that shortcut off so the all-gather / reduce-scatter streams, events
and buffer hand-offs run with real data (a missing wait shows up as wrong parameters). The
last case runs rank 0 of a fake 8-rank world on the device (streams, prefetch and buffer
release at a real shard size; values are meaningless there) and compares the allocator's peak
with ``estimate_memory``'s prediction. Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

CFG = dict(vocab_size=512, seq_len=64, dim=128, n_layers=3, n_heads=4)
STEPS = 4


def _models(device, **shard_kwargs):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2 import fully_shard
    from fsdp2.models import GPT, GPTConfig

    torch.manual_seed(0)
    ref = GPT(GPTConfig(**CFG)).to(device)
    model = copy.deepcopy(ref)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **shard_kwargs)
    fully_shard(model, mesh=mesh, **shard_kwargs)
    return model, ref


def _parity_case(device, name, shortcut, mp=False, offload=False, prefetch=False):
    from fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy
    from fsdp2.runtime import schedule

    kwargs = {}
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    with contextlib.nullcontext() if shortcut else schedule.always_communicate():
        model, ref = _models(device, **kwargs)
    try:
        if prefetch:
            blocks = list(model.blocks)
            for a, b in zip(blocks, blocks[1:]):
                a.set_modules_to_forward_prefetch([b])
                b.set_modules_to_backward_prefetch([a])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        worst_loss = 0.0
        for _ in range(STEPS):
            tokens = torch.randint(0, CFG["vocab_size"], (4, CFG["seq_len"] + 1), generator=g).to(device)
            x, y = tokens[:, :-1], tokens[:, 1:]
            loss = model.loss(x, y)
            loss.backward()
            if mp:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    ref_loss = ref.loss(x, y)
            else:
                ref_loss = ref.loss(x, y)
            ref_loss.backward()
            worst_loss = max(worst_loss, abs(loss.item() - ref_loss.item()))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad(set_to_none=True)
        ref_params = dict(ref.named_parameters())
        worst_param = max(
            (p.full_tensor().to(device) - ref_params[n]).abs().max().item() for n, p in model.named_parameters()
        )
    finally:
        del model
    # bf16 params vs fp32 params under autocast differ by bf16 rounding; fp32 must be exact-ish.
    tol = 2e-2 if mp else 1e-5
    ok = worst_param <= tol and worst_loss <= (5e-2 if mp else 1e-5)
    return dict(case=name, ok=ok, worst_param=worst_param, worst_loss=worst_loss, tol=tol)


def _fake_world_case(device):
    """Rank 0 of 8 in a fake process group on ``device``: runs, and peak vs estimator."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp2 import MixedPrecisionPolicy
    from fsdp2.tools.estimate import estimate_memory, local_bytes, optimizer_state_bytes
    from fsdp2.tools.memory_meter import PeakMemory
    from fsdp2.models import GPT, GPTConfig
    from fsdp2.models.gpt import Block

    dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model, _ = _models(device, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, CFG["vocab_size"], (4, CFG["seq_len"] + 1), device=device)
        for _ in range(2):
            model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        # Held between steps; DTensor optimizer state counts its local shard only.
        held = local_bytes(model.parameters())
        held += optimizer_state_bytes(opt)
        with PeakMemory(device.type) as meter:
            model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        measured = held + meter.peak_bytes
        with torch.device("meta"):
            meta = GPT(GPTConfig(**CFG))
            meta_tokens = torch.zeros(4, CFG["seq_len"], dtype=torch.long)
        est = estimate_memory(
            meta,
            8,
            groups=lambda m: isinstance(m, Block),
            mp_policy=mp,
            sample_input=(meta_tokens, meta_tokens),
            loss_fn=lambda m, x, y: m.loss(x, y),
            kernel_scratch=device,
        )
        ratio = measured / est.peak
        # On CUDA the allocator rounds blocks up (512 B and more): a looser bound than tests/.
        return dict(
            case="fake world 8, bf16 (peak vs estimate)",
            ok=0.8 <= ratio <= 1.2,
            measured=measured,
            predicted=est.peak,
            ratio=ratio,
        )
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1
    )
    results = [
        _parity_case(device, "fp32, world 1 shortcut", shortcut=True),
        _parity_case(device, "fp32, collectives", shortcut=False),
        _parity_case(device, "fp32, collectives, explicit prefetch", shortcut=False, prefetch=True),
        _parity_case(device, "bf16 params / fp32 reduce, collectives", shortcut=False, mp=True),
        _parity_case(device, "CPU offload (pinned), collectives", shortcut=False, offload=True),
    ]
    results.append(_fake_world_case(device))
    print(
        f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}"
    )
    for r in results:
        detail = {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in r.items() if k not in ("case", "ok")}
        print(f"{'PASS' if r['ok'] else 'FAIL'}  {r['case']}: {detail}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
