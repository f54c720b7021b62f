"""Save mid-epoch on one world size, resume on another: the data continues where it stopped.

    python examples/resume_any_world.py --nproc 4 --steps 8 --save-at 3 --ckpt runs/elastic
    python examples/resume_any_world.py --nproc 2 --steps 8 --ckpt runs/elastic --resume
    python examples/resume_any_world.py --nproc 3 --steps 8 --ckpt runs/elastic --resume

The input pipeline's position is one number that means the same on every world size: how many
samples the whole job has consumed. The samples are read in one global order (a permutation per
epoch, seeded by the epoch), cut into global batches of a fixed size; rank r of W takes the r-th
W-th of each global batch. The position goes into the checkpoint's ``extra``; the model and
optimizer reshard on load (fsdp2.checkpoint), so a job saved on 4 ranks goes on from the next
sample on 2 or 3, none skipped and none repeated. The global batch must divide by every world
size the job runs on (12 here: 1, 2, 3, 4, 6, 12). Per-rank state (RNG streams) is saved with
``rank_extra``, which comes back only on the same world size: data order here depends on no
per-rank RNG, which is what lets it move.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp2 import fully_shard
from fsdp2.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=2)
NUM_SAMPLES = 40  # an epoch: 40 samples = 3 global batches and a third (epochs cross batches)
GLOBAL_BATCH = 12


def dataset() -> torch.Tensor:
    """NUM_SAMPLES token sequences, the same in every process."""
    return torch.randint(0, CFG.vocab_size, (NUM_SAMPLES, CFG.seq_len + 1), generator=torch.Generator().manual_seed(0))


class GlobalOrder:
    """Sample indices in the job's one order, from a position (samples consumed so far)."""

    def __init__(self, num_samples: int, seed: int = 0):
        self.num_samples = num_samples
        self.seed = seed

    def take(self, position: int, count: int) -> list[int]:
        """The ``count`` sample indices after ``position``."""
        out = []
        while len(out) < count:
            epoch, offset = divmod(position + len(out), self.num_samples)
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
            out += order[offset : offset + count - len(out)].tolist()
        return out


def train(
    rank: int, world_size: int, *, steps: int, ckpt: str = "", save_at: int | None = None, resume: bool = False
) -> dict:
    """Train to ``steps`` (from the checkpoint's step if ``resume``); every rank returns, per step,
    the samples the job consumed (all ranks' in rank order) and the job's mean loss."""
    from fsdp2 import checkpoint

    if GLOBAL_BATCH % world_size:
        raise ValueError(f"global batch {GLOBAL_BATCH} does not split over {world_size} ranks")
    per_rank = GLOBAL_BATCH // world_size
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step, position = 0, 0
    if resume:
        extra = checkpoint.load(ckpt, model, optimizer)
        step, position = extra["step"], extra["samples_consumed"]

    data, order = dataset(), GlobalOrder(NUM_SAMPLES)
    record = {}
    while step < steps:
        batch = order.take(position, GLOBAL_BATCH)
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        tokens = data[mine]
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()  # fsdp2 averages gradients over ranks: the global batch's mean loss
        optimizer.step()
        optimizer.zero_grad()
        position += GLOBAL_BATCH
        step += 1
        seen = [None] * world_size
        dist.all_gather_object(seen, mine)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        record[step] = {"samples": [i for part in seen for i in part], "loss": mean.item() / world_size}
        if step == save_at:
            checkpoint.save(ckpt, model, optimizer, extra={"step": step, "samples_consumed": position})
    return record


def _spawned(rank: int, args: argparse.Namespace, port: int | None) -> None:
    from launch import init_process_group

    warnings.filterwarnings("ignore", message=".*is deprecated. Please use.*")
    world = init_process_group(rank, args.nproc, port)
    record = train(rank, world, steps=args.steps, ckpt=args.ckpt, save_at=args.save_at, resume=args.resume)
    if rank == 0:
        for step, r in record.items():
            print(f"step {step}: loss {r['loss']:.4f}  samples {r['samples']}")
        if args.record:
            Path(args.record).write_text(json.dumps(record))
    dist.destroy_process_group()


def main() -> None:
    from launch import launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4, help="CPU ranks to spawn (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ckpt", required=True, help="checkpoint directory")
    parser.add_argument("--save-at", type=int, default=None, help="save after this step")
    parser.add_argument("--resume", action="store_true", help="load --ckpt and go on to --steps")
    parser.add_argument("--record", default="", help="write {step: {samples, loss}} JSON here")
    args = parser.parse_args()
    launch(_spawned, args, args.nproc)


if __name__ == "__main__":
    main()
