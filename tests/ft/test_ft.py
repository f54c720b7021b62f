"""Fault-tolerant HSDP on torchft: 2 replica groups x 2 shard ranks on gloo, one group
killed (SIGKILL) and restarted while the other trains on; the restarted group heals from the
live one. Each run is a torchft lighthouse in this process and tests/ft/ft_worker.py subprocesses.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch

pytest.importorskip("torchft", reason='fsdp2.ft needs torchft: pip install "fsdp2[ft]"')

from fsdp2 import FSDPUsageError  # noqa: E402
from fsdp2.ft import FaultTolerantHSDP, ReplicaLayout  # noqa: E402
from tests.ft.ft_job import FTJob  # noqa: E402

pytestmark = pytest.mark.slow  # replica groups as processes under a lighthouse

STEPS = 9
DIE_IN_ALL_REDUCE, FIRST_REJOIN, SECOND_REJOIN = 2, 4, 6


def _run_schedule(impl: str, workdir) -> dict:
    """Group 1 dies inside step 2's all-reduce; its replacement dies while healing at step 4;
    the next one heals at step 6. Group 0 never stops. Returns each rank's final state."""
    common = ["--impl", impl, "--steps", str(STEPS), "--after-close"]
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
            (0, True, 2),
            (1, True, 2),
            (2, False, 2),
            (2, True, 1),  # group 1 died in this all-reduce: not committed, retried alone
            (3, True, 1),
            (4, False, 2),
            (4, True, 1),  # its replacement died while healing
            (5, True, 1),
            (6, True, 2),
            (7, True, 2),
            (8, True, 2),  # healed at 6
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


def _run_two_groups(workdir, extra: list[str], steps: int = 3) -> dict:
    with FTJob(workdir) as job:
        for replica in (0, 1):
            job.launch(replica, worker_args=["--steps", str(steps), "--gate-at", "0", *extra])
        job.wait_lighthouse(participants=0, heartbeating=2)
        job.open_gate(0)
        assert job.wait_group(0) == [0, 0] and job.wait_group(1) == [0, 0], job.stderr_tails()
        return {(r, s): job.result(r, 0, s) for r in (0, 1) for s in range(2)}


@pytest.fixture(scope="module")
def two_group_runs(tmp_path_factory):
    with ThreadPoolExecutor(2) as pool:
        runs = {
            name: pool.submit(_run_two_groups, tmp_path_factory.mktemp(name), ["--after-close", *extra])
            for name, extra in (("eager", []), ("compiled", ["--compile"]))
        }
        return {name: f.result() for name, f in runs.items()}


def test_the_compiled_whole_step_equals_eager_under_torchft(two_group_runs):
    """``torch.compile(model, fullgraph=True)`` under FaultTolerantHSDP: the graph hands each
    reduced bucket to torchft's all-reduce (the all-reduce hook) before its division, as eager."""
    eager, compiled = two_group_runs["eager"], two_group_runs["compiled"]
    for who, theirs in eager.items():
        ours = compiled[who]
        assert _commits(ours["log"]) == _commits(theirs["log"]) == [(0, True, 2), (1, True, 2), (2, True, 2)]
        for name, value in theirs["params"].items():
            assert torch.equal(value, ours["params"][name]), (who, name)
    replicas = [compiled[0, s]["params"] for s in range(2)], [compiled[1, s]["params"] for s in range(2)]
    for a, b in zip(*replicas):
        assert all(torch.equal(a[name], b[name]) for name in a)  # the groups stayed replicas


def test_a_closed_model_trains_as_the_same_model_without_ft_bitwise(schedule_runs, two_group_runs):
    """After ``close()`` the model's all-reduce hooks are gone: its next backward (eager or
    compiled, fsdp2 or PyTorch's FSDP2) gives the gradients of the same model that never had
    FaultTolerantHSDP, bitwise, and nothing is averaged across the replica groups any more."""
    runs = {**{f"schedule {impl}": schedule_runs[impl] for impl in schedule_runs}, **two_group_runs}
    checked = 0
    for name, results in runs.items():
        for who, result in results.items():
            assert result["after_close"], (name, who)
            for param, (equal, largest_difference) in result["after_close"].items():
                assert equal, (name, who, param, largest_difference)
                checked += 1
    assert checked == 2 * 4 * 4 + 2 * 4 * 4  # runs x ranks x parameters


BAD_JOINERS = {
    "other_model": (
        {"worker_args": ["--hidden", "34"]},
        ["'0.weight' is [34, 10]", "[33, 10] torch.float32 on the live groups"],
    ),
    # Its shard rank 2 has no peer to heal from; it is refused as its ranks 0 and 1 are.
    "other_world_size": ({"ranks": 3}, ["has 3 shard ranks, the live groups have 2"]),
    # Same parameters, other fully_shard units: its first all-reduce would have another size.
    "other_wrapping": (
        {"worker_args": ["--wrap", "root"]},
        ["fully_shard'ed differently: fully_shard was applied to the root module here"],
    ),
}
JOIN_STEPS, JOIN_AT = 5, 2


def _run_with_bad_joiner(joiner: dict, workdir) -> tuple[list[str | None], list[int], dict]:
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
        errors = [job.error(2, 0, s) for s in range(ranks)]
        return errors, codes, {(r, s): job.result(r, 0, s) for r in (0, 1) for s in range(2)}


@pytest.fixture(scope="module")
def bad_joiner_runs(tmp_path_factory):
    with ThreadPoolExecutor(len(BAD_JOINERS)) as pool:
        runs = {
            k: pool.submit(_run_with_bad_joiner, joiner, tmp_path_factory.mktemp(k))
            for k, (joiner, _) in BAD_JOINERS.items()
        }
        return {k: f.result() for k, f in runs.items()}


@pytest.mark.parametrize("kind", sorted(BAD_JOINERS))
def test_a_bad_joiner_is_refused_and_the_live_groups_train_on(bad_joiner_runs, kind):
    errors, codes, results = bad_joiner_runs[kind]
    joiner, expected = BAD_JOINERS[kind]
    assert codes == [3] * joiner.get("ranks", 2)  # every rank of the joiner stopped with the error
    for error in errors:
        assert "FSDPUsageError" in error and "replica group 'replica_2' cannot join" in error, errors
        assert all(part in error for part in expected), errors
    for (replica, shard_rank), result in results.items():
        # The step the joiner entered is not committed (its all-reduce lost a member) and is retried.
        assert _commits(result["log"]) == [
            (0, True, 2),
            (1, True, 2),
            (2, False, 3),
            (2, True, 2),
            (3, True, 2),
            (4, True, 2),
        ]
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
        FaultTolerantHSDP(
            model, torch.optim.SGD(model.parameters(), lr=0.1), replica_id="r", lighthouse="http://127.0.0.1:1"
        )


def test_example_trains_two_replica_groups_under_torchrun(tmp_path):
    import os
    import subprocess
    import sys

    from tests.ft.ft_job import ROOT

    with FTJob(tmp_path) as job:  # for its lighthouse
        env = dict(
            os.environ,
            TORCHFT_LIGHTHOUSE=job.lighthouse_address,
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        groups = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node",
                    "1",
                    "--standalone",  # its own store on a port the kernel picks
                    "examples/train_ft.py",
                    "--replica-id",
                    str(r),
                    "--steps",
                    "3",
                    "--min-replicas",
                    "2",
                ],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
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
        "lighthouse": "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1],
        "replica_id": "solo",
        "manager_kwargs": {
            "store_addr": "127.0.0.1",
            "store_port": store.port,
            "rank": 0,
            "world_size": 1,
            "hostname": "localhost",
        },
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
            refused(lambda: model(torch.ones(2, 4)).sum().backward())  # between steps
            ft.begin_step()
            model(torch.ones(2, 4)).sum().backward()
            errors.append(f"committed={ft.commit_step()} step={ft.step}")
        hsdp = fully_shard(
            torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        )
        refused(lambda: FaultTolerantHSDP(hsdp, torch.optim.SGD(hsdp.parameters(), lr=0.1), **where))
    finally:
        lighthouse.shutdown()
    return errors


def test_steps_out_of_order_a_backward_between_steps_and_a_replicate_mesh_are_refused(worlds):
    before, twice, step, between, next_step, hsdp = worlds.run(1, _misuse)[0]
    assert "commit_step: called between steps" in before and "begin_step()" in before
    assert "begin_step: called in a step" in twice
    assert step == "committed=True step=1"  # the refusals changed nothing: the step went on
    assert "a backward with gradient sync ran between steps" in between and "Call begin_step()" in between
    assert next_step == "committed=True step=2"
    assert "replicate dim" in hsdp and "1-D shard mesh" in hsdp


# -- in-process: what is checked before anything connects (torchft's Manager recorded, not run) -------


@pytest.fixture
def managers(monkeypatch):
    """The keyword arguments of every torchft Manager a FaultTolerantHSDP makes; none connects."""
    import torchft.manager

    made: list[dict] = []

    class Recorded:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def shutdown(self, wait: bool = True) -> None:
            pass

    monkeypatch.setattr(torchft.manager, "Manager", Recorded)
    for name, value in TORCHRUN_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    return made


# What torchrun sets for rank 0 of a replica group of 2 ranks (where torchft finds its store).
TORCHRUN_ENVIRONMENT = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"}


def _mlp(wrap: str = "layers", fully_shard=None, mp_policy=None, ignored_params=()):
    """Linear-ReLU-Linear on the fake world's 1-D mesh: ``wrap`` "layers" (each Linear, then the
    root), "root", or "first" (the first Linear only: the last one and the root stay plain);
    ``ignored_params``: names of parameters the root's fully_shard ignores."""
    from torch.distributed.device_mesh import init_device_mesh

    if fully_shard is None:
        from fsdp2 import fully_shard
    kwargs = {"mp_policy": mp_policy} if mp_policy is not None else {}
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    if wrap in ("layers", "first"):
        fully_shard(model[0], mesh=mesh, **kwargs)
    if wrap == "layers":
        fully_shard(model[2], mesh=mesh, **kwargs)
    if wrap in ("layers", "root"):
        ignored = {p for n, p in model.named_parameters() if n in (ignored_params or ())}
        fully_shard(model, mesh=mesh, ignored_params=ignored or None, **kwargs)
    return model


WHERE = {"replica_id": "replica_0", "lighthouse": "http://127.0.0.1:1"}


def _ft(model, optimizer=None, **kwargs) -> FaultTolerantHSDP:
    optimizer = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=0.1)
    return FaultTolerantHSDP(model, optimizer, **{**WHERE, **kwargs})


BAD_ARGUMENTS = {
    "replica_id_int": ({"replica_id": 3}, r"replica_id must be a str .* got int 3"),
    "replica_id_empty": ({"replica_id": ""}, r"replica_id is empty"),
    "min_replicas_zero": ({"min_replicas": 0}, r"min_replicas .* must be at least 1, got 0"),
    "min_replicas_float": ({"min_replicas": 2.0}, r"min_replicas .* must be an int, got float"),
    "lighthouse_without_scheme": (
        {"lighthouse": "127.0.0.1:29510"},
        r"'127.0.0.1:29510' has no scheme; pass 'http://127.0.0.1:29510'",
    ),
    "timeout_seconds": ({"timeout": 60}, r"timeout must be a datetime.timedelta, got int 60"),
    "quorum_timeout_zero": ({"quorum_timeout": timedelta(0)}, r"quorum_timeout must be positive"),
    "quorum_retries_negative": ({"quorum_retries": -1}, r"quorum_retries .* must be at least 0"),
    "init_sync_str": ({"init_sync": "yes"}, r"init_sync must be a bool"),
    "manager_kwargs_timeout": (
        {"manager_kwargs": {"timeout": timedelta(seconds=1)}},
        r"manager_kwargs\['timeout'\]: pass timeout= to FaultTolerantHSDP",
    ),
    "manager_kwargs_pg": (
        {"manager_kwargs": {"pg": None}},
        r"manager_kwargs\['pg'\]: FaultTolerantHSDP sets it itself",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_bad_arguments_are_refused_before_connecting(fake_world, managers, case):
    fake_world(2)
    kwargs, message = BAD_ARGUMENTS[case]
    with pytest.raises(FSDPUsageError, match=message):
        _ft(_mlp(), **kwargs)
    assert managers == []  # nothing was started


def test_a_model_or_optimizer_of_another_type_is_refused_before_connecting(fake_world, managers):
    fake_world(2)
    model = _mlp()
    with pytest.raises(FSDPUsageError, match="model must be a fully_shard'ed nn.Module, got dict"):
        FaultTolerantHSDP({"model": model}, torch.optim.SGD(model.parameters(), lr=0.1), **WHERE)
    with pytest.raises(FSDPUsageError, match="optimizer must be a torch.optim.Optimizer .*, got list"):
        FaultTolerantHSDP(model, list(model.parameters()), **WHERE)
    stale = torch.optim.SGD(torch.nn.Linear(4, 6).parameters(), lr=0.1)  # not the model's parameters
    with pytest.raises(FSDPUsageError, match=r"steps parameters that are not the model's \(positions \[0, 1\]\)"):
        FaultTolerantHSDP(model, stale, **WHERE)
    assert managers == []


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_parameters_no_fully_shard_averages_are_refused_before_connecting(fake_world, managers, impl):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    fake_world(2)
    shard = torch_fully_shard if impl == "torch" else None
    with pytest.raises(
        FSDPUsageError,
        match=r"trainable parameters \['2.weight', '2.bias'\] are not under fully_shard, so "
        r"their gradients would never be averaged across the replica groups.*"
        r"fully_shard\(model, mesh=shard_mesh\) after its blocks",
    ):
        _ft(_mlp("first", shard))
    # ignored_params leave a parameter a plain tensor under a fully_shard'ed module: not averaged either.
    ignoring = _mlp("root", shard, ignored_params={"2.bias"})
    with pytest.raises(FSDPUsageError, match=r"trainable parameters \['2.bias'\] are not under fully_shard"):
        _ft(ignoring)
    assert managers == []
    frozen = _mlp("first", shard)
    frozen[2].requires_grad_(False)  # no gradient to average: accepted
    _ft(frozen).close()
    assert len(managers) == 1


@pytest.mark.parametrize(
    "unset, given, message",
    [
        (["MASTER_ADDR", "MASTER_PORT"], {}, "MASTER_ADDR is not set, MASTER_PORT is not set"),
        (["RANK", "WORLD_SIZE"], {}, "RANK is not set, WORLD_SIZE is not set"),
        ([], {"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an int"),
    ],
)
def test_a_group_without_torchruns_environment_is_refused_before_connecting(
    fake_world, managers, monkeypatch, unset, given, message
):
    """A process group started with ``init_method="tcp://..."`` has no MASTER_ADDR (and so on):
    torchft's Manager would fail on it with a bare KeyError."""
    fake_world(2)
    for name in unset:
        monkeypatch.delenv(name)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        FSDPUsageError, match=f"FaultTolerantHSDP: {message}. torchft finds .* Start each replica group"
    ):
        _ft(_mlp())
    assert managers == []
    store = {"store_addr": "127.0.0.1", "store_port": 29500, "rank": 1, "world_size": 2}
    for name in TORCHRUN_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    _ft(_mlp(), manager_kwargs=store).close()  # manager_kwargs stand in for the environment
    assert managers[0]["store_port"] == 29500 and managers[0]["rank"] == 1


def test_quorum_retries_default_reaches_torchfts_manager(fake_world, managers):
    from fsdp2.ft import DEFAULT_QUORUM_RETRIES

    fake_world(2)
    _ft(_mlp()).close()
    _ft(_mlp(), quorum_retries=0).close()
    assert DEFAULT_QUORUM_RETRIES == 3
    assert [m["quorum_retries"] for m in managers] == [3, 0]
    assert managers[0]["replica_id"] == "replica_0" and managers[0]["lighthouse_addr"] == "http://127.0.0.1:1"


def test_a_second_fault_tolerant_hsdp_on_the_same_model_is_refused(fake_world, managers):
    fake_world(2)
    model = _mlp()
    first = _ft(model)
    with pytest.raises(
        FSDPUsageError,
        match=r"FaultTolerantHSDP\(replica_id='replica_0'\): the model's all-reduce hooks "
        r"already belong to the FaultTolerantHSDP of replica group 'replica_0'.*close\(\)",
    ):
        _ft(model)
    assert len(managers) == 1
    assert model._fsdp_state.group.reduce.settings.all_reduce_hook == first._all_reduce_across_replicas  # untouched
    first.close()
    second = _ft(model)  # the first let go of the hooks
    assert model[0]._fsdp_state.group.reduce.settings.all_reduce_hook == second._all_reduce_across_replicas
    second.close()


def test_layout_names_other_fully_shard_units_and_reduce_dtypes(fake_world):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    fake_world(2)
    live = ReplicaLayout.of(_mlp("layers"), 2)
    assert live.units == (  # in module order; the root reduces no parameter of its own
        ("", (), "None"),
        ("0", ("0.weight", "0.bias"), "torch.float32"),
        ("2", ("2.weight", "2.bias"), "torch.float32"),
    )
    assert ReplicaLayout.of(_mlp("layers", torch_fully_shard), 2).mismatch(live) is None  # PyTorch's FSDP2 alike
    root_only = ReplicaLayout.of(_mlp("root"), 2)
    assert root_only.params == live.params  # the parameters alone cannot tell them apart
    assert root_only.mismatch(live) == (
        "the model is fully_shard'ed differently: fully_shard was applied to the root module here, to the root "
        "module, '0', '2' on the live groups (each one's gradients are one all-reduce across the groups); apply "
        "fully_shard to the same modules, with the same mp_policy, on every replica group"
    )
    ignoring = ReplicaLayout.of(_mlp("root", ignored_params={"2.bias"}), 2)
    assert "fully_shard(the root module) reduces ['0.weight', '0.bias', '2.weight'] here, " in ignoring.mismatch(
        root_only
    )
    bf16_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    bf16 = ReplicaLayout.of(_mlp("layers", mp_policy=bf16_policy), 2)
    assert (
        "fully_shard('0') reduces gradients in torch.bfloat16 here, torch.float32 on the live groups"
        in bf16.mismatch(live)
    )
    assert ReplicaLayout.from_dict(bf16.as_dict()) == bf16


def test_layout_names_another_optimizer(fake_world):
    fake_world(2)
    model = _mlp()
    sgd = ReplicaLayout.of(model, 2, torch.optim.SGD(model.parameters(), lr=0.1))
    adam = ReplicaLayout.of(model, 2, torch.optim.Adam(model.parameters(), lr=0.1))
    assert sgd.optimizer == ("torch.optim.sgd.SGD", (("0.weight", "0.bias", "2.weight", "2.bias"),))
    assert adam.mismatch(sgd) == (
        "the optimizer is torch.optim.adam.Adam here, torch.optim.sgd.SGD on the live groups, whose optimizer state "
        "this group would load; use the same optimizer on every replica group"
    )
    groups = [{"params": [model[0].weight, model[0].bias]}, {"params": [model[2].weight, model[2].bias]}]
    split = ReplicaLayout.of(model, 2, torch.optim.SGD(groups, lr=0.1))
    assert "has 2 param groups here, 1 on the live groups" in split.mismatch(sgd)
    backwards = ReplicaLayout.of(model, 2, torch.optim.SGD(list(model.parameters())[::-1], lr=0.1))
    assert "param group 0 of the optimizer torch.optim.sgd.SGD holds ['2.bias', " in backwards.mismatch(sgd)
    assert ReplicaLayout.from_dict(adam.as_dict()) == adam


def _stepped(ft: FaultTolerantHSDP) -> None:
    ft.model(torch.randn(2, 4)).sum().backward()
    ft.optimizer.step()


@pytest.mark.parametrize("joiner", ["root_only", "adam"])
def test_a_joiner_of_another_wrapping_or_optimizer_loads_nothing(fake_world, managers, joiner):
    fake_world(2)
    live_model = _mlp()
    live = _ft(live_model, torch.optim.SGD(live_model.parameters(), lr=0.1, momentum=0.9), replica_id="replica_live")
    for m in (live_model, live_model[0], live_model[2]):
        m.set_all_reduce_hook(lambda reduced: None)  # no torchft here
    _stepped(live)
    model = _mlp("root" if joiner == "root_only" else "layers")
    optimizer = (torch.optim.Adam if joiner == "adam" else torch.optim.SGD)(model.parameters(), lr=0.1)
    ft = _ft(model, optimizer)
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    expected = (
        "the model is fully_shard'ed differently"
        if joiner == "root_only"
        else "the optimizer is torch.optim.adam.Adam here"
    )
    with pytest.raises(FSDPUsageError, match=f"replica group 'replica_0' cannot join the job: {expected}"):
        ft.load_state_dict(live.state_dict())
    assert all(torch.equal(p.to_local(), before[n]) for n, p in model.named_parameters())
    assert not optimizer.state  # nothing loaded


def test_a_joiner_of_the_same_layout_loads_the_live_state(fake_world, managers):
    fake_world(2)
    live_model = _mlp()
    live = _ft(live_model, torch.optim.SGD(live_model.parameters(), lr=0.1, momentum=0.9), replica_id="replica_live")
    for m in (live_model, live_model[0], live_model[2]):
        m.set_all_reduce_hook(lambda reduced: None)
    _stepped(live)
    model = _mlp()
    ft = _ft(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ft.load_state_dict(live.state_dict())
    for (name, p), q in zip(model.named_parameters(), live_model.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), name
    assert len(ft.optimizer.state) == 4


NO_QUORUM = {  # case: (the lighthouse's --min_replicas, what the error says)
    "too_few_groups": (
        2,
        "got no quorum from the lighthouse <lighthouse> within quorum_timeout=0:00:01 (min_replicas=2)",
    ),
    "lighthouse_down": (
        2,
        "got no quorum from the lighthouse <lighthouse> within quorum_timeout=0:00:01 (min_replicas=2)",
    ),
    # The lighthouse forms quorums of one group (as with --min_replicas 1): asked again until the deadline.
    "lighthouse_forms_smaller_quorums": (
        1,
        "waited quorum_timeout=0:00:01 for a quorum of min_replicas=2 replica groups, but the lighthouse "
        "<lighthouse> formed quorums of 1 (its --min_replicas is lower)",
    ),
    # Nothing listens there when the group starts: the constructor raises it.
    "lighthouse_unreachable": (1, "could not reach the lighthouse <lighthouse> within timeout=0:00:01"),
}


def _no_quorum(rank: int, world_size: int) -> dict[str, tuple[str, str, float]]:
    """One replica group of two ranks, alone, asking for a quorum of two groups (min_replicas=2)."""
    import os
    import time

    import torch.distributed as dist
    from torch.distributed import TCPStore
    from torch.distributed.device_mesh import init_device_mesh
    from torchft._torchft import LighthouseServer

    from fsdp2 import fully_shard

    os.environ.setdefault("RUST_LOG", "error")
    results = {}
    for case, (lighthouse_min_replicas, _) in NO_QUORUM.items():
        lighthouse = store = None
        where: list = [None, None]
        if rank == 0:  # the lighthouse and the group's store live here
            lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=lighthouse_min_replicas)
            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            where = ["http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1], store.port]
            if case == "lighthouse_unreachable":
                lighthouse.shutdown()
        dist.broadcast_object_list(where, src=0)
        address, port = where
        model = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (world_size,)))
        ft = None
        start = time.monotonic()
        try:
            ft = FaultTolerantHSDP(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                replica_id=f"solo_{case}",
                lighthouse=address,
                min_replicas=2,
                quorum_timeout=timedelta(seconds=1),
                timeout=timedelta(seconds=1 if case == "lighthouse_unreachable" else 10),
                manager_kwargs={
                    "store_addr": "127.0.0.1",
                    "store_port": port,
                    "rank": rank,
                    "world_size": world_size,
                    "hostname": "localhost",
                },
            )
            if case == "lighthouse_down":
                dist.barrier()
                if rank == 0:
                    lighthouse.shutdown()  # it dies under a running job
                dist.barrier()
            start = time.monotonic()
            ft.begin_step()
            results[case] = ("no error", "", time.monotonic() - start)
        except Exception as e:  # noqa: BLE001 (the test reads it)
            results[case] = (type(e).__name__, str(e).replace(address, "<lighthouse>"), time.monotonic() - start)
        finally:
            if ft is not None:
                ft.close()
            if rank == 0 and case not in ("lighthouse_down", "lighthouse_unreachable"):
                lighthouse.shutdown()
        dist.barrier()
    return results


def test_no_quorum_says_which_lighthouse_and_how_many_groups_on_every_rank(worlds):
    """A quorum the lighthouse does not form, or forms with fewer than ``min_replicas`` groups,
    and a lighthouse that is down: every rank of the group raises QuorumTimeoutError once the
    timeout has passed, none trains on without committing."""
    for rank, results in enumerate(worlds.run(2, _no_quorum, timeout=120)):
        assert results.keys() == NO_QUORUM.keys()
        for case, (name, message, elapsed) in results.items():
            assert name == "QuorumTimeoutError", (rank, case, name, message)
            assert NO_QUORUM[case][1] in message, (rank, case, message)
            assert "torchft_lighthouse" in message and "restart this group" in message, (rank, case, message)
            assert 1 <= elapsed < 60, (rank, case, elapsed)  # the timeout, on a busy machine
        assert "torchft: status:" in results["too_few_groups"][1]
        assert "--min_replicas 2" in results["lighthouse_forms_smaller_quorums"][1]
