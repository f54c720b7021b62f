"""Fault-tolerant HSDP on torchft (issue 23): 2 replica groups x 2 shard ranks on gloo, one group
killed (SIGKILL) and restarted while the other trains on; the restarted group heals from the
live one. Each run is a torchft lighthouse in this process and tests/ft_worker.py subprocesses.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("torchft", reason='fsdp2.ft needs torchft: pip install "fsdp2[ft]"')

from fsdp2 import FSDPUsageError  # noqa: E402
from fsdp2.ft import FaultTolerantHSDP, ReplicaLayout  # noqa: E402
from tests.ft_job import FTJob  # noqa: E402

STEPS = 9
DIE_IN_ALL_REDUCE, FIRST_REJOIN, SECOND_REJOIN = 2, 4, 6


def _run_schedule(impl: str, workdir) -> dict:
    """Group 1 dies inside step 2's all-reduce; its replacement dies while healing at step 4;
    the next one heals at step 6. Group 0 never stops. Returns each rank's final state."""
    common = ["--impl", impl, "--steps", str(STEPS)]
    with FTJob(workdir) as job:
        job.launch(0, worker_args=common + ["--gate-at", "0", str(FIRST_REJOIN), str(SECOND_REJOIN)])
        job.launch(1, worker_args=common + ["--gate-at", "0", "--die-in-all-reduce", str(DIE_IN_ALL_REDUCE)])
        job.wait_lighthouse(participants=0, heartbeating=2)
        job.open_gate(0)  # both groups are up: the first quorum holds both
        assert job.wait_group(1) == [-9, -9]

        for incarnation, step, extra in ((1, FIRST_REJOIN, ["--die-while-healing"]), (2, SECOND_REJOIN, [])):
            job.wait_files(f"at_{step}_r0*", 2)  # the survivor waits at `step`, so the join happens there
            job.launch(1, incarnation, worker_args=common + extra)
            job.wait_lighthouse(participants=1, heartbeating=2)  # the joiner asks first
            job.open_gate(step)
        assert job.wait_group(1, 1) == [-9, -9]
        assert job.wait_group(0) == [0, 0] and job.wait_group(1, 2) == [0, 0], job.stderr_tails()
        return {(r, i, s): job.result(r, i, s) for r, i in ((0, 0), (1, 2)) for s in range(2)}


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory):
    # fsdp2 and PyTorch's FSDP2 under the same failure schedule, side by side (mostly waiting).
    with ThreadPoolExecutor(2) as pool:
        runs = {impl: pool.submit(_run_schedule, impl, tmp_path_factory.mktemp(impl)) for impl in ("fsdp2", "torch")}
        return {impl: f.result() for impl, f in runs.items()}


def _commits(log: list[dict]) -> list[tuple[int, bool, int]]:
    return [(e["step"], e["committed"], e["participants"]) for e in log]


def test_the_survivor_never_stops_and_a_failed_step_is_stepped_by_nobody(schedule_runs):
    for shard_rank in range(2):
        survivor = schedule_runs["fsdp2"][0, 0, shard_rank]
        assert _commits(survivor["log"]) == [
            (0, True, 2), (1, True, 2),
            (2, False, 2), (2, True, 1),  # group 1 died in this all-reduce: not committed, retried alone
            (3, True, 1),
            (4, False, 2), (4, True, 1),  # its replacement died while healing
            (5, True, 1),
            (6, True, 2), (7, True, 2), (8, True, 2),  # healed at 6
        ]
        # The optimizer stepped exactly once per committed step on both shard ranks.
        assert all(int(s["step"]) == STEPS for s in survivor["optimizer"].values())


def test_the_healed_group_holds_the_survivors_state_bitwise(schedule_runs):
    for impl in ("fsdp2", "torch"):
        for shard_rank in range(2):
            survivor, healed = schedule_runs[impl][0, 0, shard_rank], schedule_runs[impl][1, 2, shard_rank]
            assert _commits(healed["log"]) == [(6, True, 2), (7, True, 2), (8, True, 2)]
            assert survivor["params"].keys() == healed["params"].keys()
            for name in survivor["params"]:
                assert torch.equal(survivor["params"][name], healed["params"][name]), (impl, shard_rank, name)
            for idx, state in survivor["optimizer"].items():
                for key, value in state.items():
                    assert torch.equal(value, healed["optimizer"][idx][key]), (impl, shard_rank, idx, key)


def test_parameters_equal_pytorch_fsdp2_under_torchft_bitwise(schedule_runs):
    for who in ((0, 0, 0), (0, 0, 1), (1, 2, 0), (1, 2, 1)):
        ours, theirs = schedule_runs["fsdp2"][who], schedule_runs["torch"][who]
        assert _commits(ours["log"]) == _commits(theirs["log"])
        for name, value in ours["params"].items():
            assert torch.equal(value, theirs["params"][name]), (who, name)


BAD_JOINERS = {
    "other_model": ({"worker_args": ["--hidden", "34"]}, ["'0.weight' is [34, 10]", "[33, 10] torch.float32 on the live groups"]),
    "other_world_size": ({"ranks": 1}, ["has 1 shard ranks, the live groups have 2"]),
}
JOIN_STEPS, JOIN_AT = 5, 2


def _run_with_bad_joiner(joiner: dict, workdir) -> tuple[str | None, list[int], dict]:
    """Groups 0 and 1 train; at step 2 a group 2 that does not match tries to join."""
    common = ["--steps", str(JOIN_STEPS)]
    with FTJob(workdir) as job:
        for replica in (0, 1):
            job.launch(replica, worker_args=common + ["--gate-at", "0", str(JOIN_AT)])
        job.wait_lighthouse(participants=0, heartbeating=2)
        job.open_gate(0)
        job.wait_files(f"at_{JOIN_AT}_*", 4)
        ranks = joiner.get("ranks", 2)
        job.launch(2, ranks=ranks, worker_args=common + joiner.get("worker_args", []))
        job.wait_lighthouse(participants=1, heartbeating=3)
        job.open_gate(JOIN_AT)
        codes = job.wait_group(2)
        assert job.wait_group(0) == [0, 0] and job.wait_group(1) == [0, 0], job.stderr_tails()
        return job.error(2, 0, 0), codes, {(r, s): job.result(r, 0, s) for r in (0, 1) for s in range(2)}


@pytest.fixture(scope="module")
def bad_joiner_runs(tmp_path_factory):
    with ThreadPoolExecutor(len(BAD_JOINERS)) as pool:
        runs = {k: pool.submit(_run_with_bad_joiner, joiner, tmp_path_factory.mktemp(k)) for k, (joiner, _) in BAD_JOINERS.items()}
        return {k: f.result() for k, f in runs.items()}


@pytest.mark.parametrize("kind", sorted(BAD_JOINERS))
def test_a_bad_joiner_is_refused_and_the_live_groups_train_on(bad_joiner_runs, kind):
    error, codes, results = bad_joiner_runs[kind]
    joiner, expected = BAD_JOINERS[kind]
    assert codes == [3] * joiner.get("ranks", 2)  # every rank of the joiner stopped with the error
    assert "FSDPUsageError" in error and "replica group 'replica_2' cannot join" in error, error
    assert all(part in error for part in expected), error
    for (replica, shard_rank), result in results.items():
        # The step the joiner entered is not committed (its all-reduce lost a member) and is retried.
        assert _commits(result["log"]) == [(0, True, 2), (1, True, 2), (2, False, 3), (2, True, 2), (3, True, 2), (4, True, 2)]
        assert all(int(s["step"]) == JOIN_STEPS for s in result["optimizer"].values())
        other = results[1 - replica, shard_rank]
        for name, value in result["params"].items():
            assert torch.equal(value, other["params"][name])


# -- in-process: the layout check and the step protocol ---------------------------------------


def _layout(shard_world_size=2, **shapes) -> ReplicaLayout:
    return ReplicaLayout(shard_world_size, tuple((n, s, "torch.float32") for n, s in (shapes or {"w": (4, 3)}).items()))


def test_layout_mismatch_names_the_parameter_or_the_world_size():
    assert _layout().mismatch(_layout()) is None
    assert "2 shard ranks" in _layout(2).mismatch(_layout(4)) and "4" in _layout(2).mismatch(_layout(4))
    assert "'w' is [4, 3]" in _layout(w=(4, 3)).mismatch(_layout(w=(5, 3)))
    assert "'v' is not in the live groups' model" in _layout(w=(4, 3), v=(1,)).mismatch(_layout(w=(4, 3)))
    assert "has parameter 'v'" in _layout(w=(4, 3)).mismatch(_layout(w=(4, 3), v=(1,)))
    assert ReplicaLayout.from_dict(_layout().as_dict()) == _layout()
    with pytest.raises(FSDPUsageError, match="no readable layout"):
        ReplicaLayout.from_dict({"params": []})


def test_a_model_without_fully_shard_is_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(FSDPUsageError, match="no fully_shard'ed module"):
        FaultTolerantHSDP(model, torch.optim.SGD(model.parameters(), lr=0.1), replica_id="r", lighthouse="http://127.0.0.1:1")


def test_example_trains_two_replica_groups_under_torchrun(tmp_path):
    import os
    import subprocess
    import sys

    from tests.ft_job import ROOT, free_port

    with FTJob(tmp_path) as job:  # for its lighthouse
        env = dict(os.environ, TORCHFT_LIGHTHOUSE=job.lighthouse_address, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        groups = [
            subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
                              str(free_port()), "examples/train_ft.py", "--replica-id", str(r), "--steps", "3", "--min-replicas", "2"],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in (0, 1)
        ]
        try:
            outputs = [g.communicate(timeout=120)[0] for g in groups]
        finally:
            for g in groups:
                g.kill()
    for r, (group, output) in enumerate(zip(groups, outputs)):
        assert group.returncode == 0, output[-3000:]
        assert f"replica {r} step    3 loss" in output and "groups 2 committed" in output, output[-3000:]


def _misuse(rank: int, world_size: int) -> list[str]:
    from torch.distributed import TCPStore
    from torch.distributed.device_mesh import init_device_mesh
    from torchft._torchft import LighthouseServer

    from fsdp2 import fully_shard

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    where = {
        "lighthouse": "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1], "replica_id": "solo",
        "manager_kwargs": {"store_addr": "127.0.0.1", "store_port": store.port, "rank": 0, "world_size": 1, "hostname": "localhost"},
    }
    errors = []

    def refused(call, *args) -> None:
        try:
            call(*args)
        except FSDPUsageError as e:
            errors.append(str(e))
        else:
            errors.append("accepted")

    try:
        model = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
        with FaultTolerantHSDP(model, torch.optim.SGD(model.parameters(), lr=0.1), **where) as ft:
            refused(ft.commit_step)  # before begin_step
            ft.begin_step()
            refused(ft.begin_step)  # twice
            model(torch.ones(2, 4)).sum().backward()
            errors.append(f"committed={ft.commit_step()} step={ft.step}")
        hsdp = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
        refused(lambda: FaultTolerantHSDP(hsdp, torch.optim.SGD(hsdp.parameters(), lr=0.1), **where))
    finally:
        lighthouse.shutdown()
    return errors


def test_steps_out_of_order_and_a_replicate_mesh_are_refused(worlds):
    before, twice, step, hsdp = worlds.run(1, _misuse)[0]
    assert "commit_step: called between steps" in before and "begin_step()" in before
    assert "begin_step: called in a step" in twice
    assert step == "committed=True step=1"  # the refusals changed nothing: the step went on
    assert "replicate dim" in hsdp and "1-D shard mesh" in hsdp
