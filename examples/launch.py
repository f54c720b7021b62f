"""Start the examples' ranks the way PyTorch users do, or by themselves.

Under ``torchrun`` (one node or many; ``srun torchrun`` under SLURM) every process is already one
rank: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set, and the process group is formed
from them (``env://``). Run standalone, the example spawns ``nproc`` CPU ranks on this machine.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=120)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(run: Callable[..., None], args, nproc: int) -> None:
    """Call ``run(rank, args, port)`` in every rank: this process under torchrun, else ``nproc`` spawned."""
    if under_torchrun():
        run(int(os.environ["RANK"]), args, None)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(args, port), nprocs=nproc)


def init_process_group(rank: int, nproc: int, port: int | None) -> int:
    """Join the job's gloo process group (CPU ranks); returns the world size."""
    if port is None:  # torchrun: rendezvous through the environment
        dist.init_process_group("gloo", timeout=TIMEOUT)
    else:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc, timeout=TIMEOUT
        )
    return dist.get_world_size()
