import time

import pytest

from tests.harness import COLLECTIVE_TIMEOUT_S, RankFailure


def _sum_ranks(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    return rank


def test_world_runs_collectives(worlds):
    assert worlds.run(3, _sum_ranks) == [3.0, 3.0, 3.0]


@pytest.mark.slow  # replaces a world
def test_failure_names_rank_and_world_recovers(worlds):
    with pytest.raises(RankFailure, match=r"(?s)rank 1:.*boom on rank one"):
        worlds.run(2, _fail_on_rank_one)
    assert worlds.run(2, _sum_ranks) == [1.0, 1.0]


def _die_on_rank_zero(rank, world_size):
    import os

    if rank == 0:
        os._exit(3)
    return rank


@pytest.mark.slow  # replaces a world
def test_dead_rank_is_reported_and_world_replaced(worlds):
    with pytest.raises(RankFailure, match=r"rank 0: process died \(exit code 3\)"):
        worlds.run(2, _die_on_rank_zero)
    assert worlds.run(2, _sum_ranks) == [1.0, 1.0]


def _fail_on_rank_one_while_rank_zero_receives(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one fails before sending")
    dist.recv(torch.empty(1), src=1)  # never sent: blocks until gloo gives up
    return rank


@pytest.mark.slow  # replaces a world
def test_a_rank_failing_while_another_waits_in_recv_fails_the_call_in_seconds(worlds):
    """The harness stops waiting for the other ranks once one failed (not gloo's timeout, nor the call's)."""
    assert worlds.run(2, _sum_ranks) == [1.0, 1.0]  # the world is up: only the failing call is timed
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)rank 0: no answer \d+s after rank 1 failed.*rank 1:.*before sending"):
        worlds.run(2, _fail_on_rank_one_while_rank_zero_receives)
    assert time.monotonic() - start < COLLECTIVE_TIMEOUT_S / 3
    assert worlds.run(2, _sum_ranks) == [1.0, 1.0]
