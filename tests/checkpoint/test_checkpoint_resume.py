"""Optimizer resume, async save and torch.distributed.checkpoint interop."""

from __future__ import annotations

import torch

from tests.checkpoint.ckpt_helpers import assert_same_state, full_optim_state, full_state, make_model, mesh_1d, shard


def _train(model, optimizer, steps, first_step, rank):
    for step in range(first_step, first_step + steps):
        torch.manual_seed(1000 + 100 * rank + step)  # each rank sees its own data, same in both runs
        optimizer.zero_grad()
        model(torch.randn(4, 16)).square().sum().backward()
        optimizer.step()


def _make_opt(model, lr=1e-2, wd=0.1):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=(0.8, 0.95))


def _resume_bitwise(rank, ws, path):
    import fsdp2.checkpoint as ck

    model = shard(make_model(0), mesh_1d(ws))
    opt = _make_opt(model)
    _train(model, opt, 3, 0, rank)
    rng = torch.get_rng_state()
    ck.save(path, model, opt, extra={"step": 3, "rng": rng, "loader": {"pos": 123}})
    _train(model, opt, 2, 3, rank)
    expected = full_state(model)

    # A fresh job: other init, other hyperparameters, optimizer that never stepped (empty state).
    model2 = shard(make_model(42), mesh_1d(ws))
    opt2 = _make_opt(model2, lr=0.5, wd=0.0)
    had_state = bool(opt2.state)
    extra = ck.load(path, model2, opt2)
    group = opt2.param_groups[0]
    state = next(iter(opt2.state.values()))
    checks = {
        "empty_before": not had_state,
        # extra is global (rank 0's copy), so only rank 0 gets its own RNG state back
        "extra": extra["step"] == 3
        and extra["loader"] == {"pos": 123}
        and (rank != 0 or torch.equal(extra["rng"], rng)),
        "hyper": (group["lr"], group["weight_decay"], group["betas"]) == (1e-2, 0.1, (0.8, 0.95)),
        "state": type(state["exp_avg"]).__name__ == "DTensor" and state["step"].item() == 3,
    }
    _train(model2, opt2, 2, 3, rank)
    got = full_state(model2)
    checks["bitwise"] = all(torch.equal(expected[k], got[k]) for k in expected)
    return checks


def _save_optimizer(rank, ws, path):
    import fsdp2.checkpoint as ck

    model = shard(make_model(0), mesh_1d(ws))
    opt = _make_opt(model)
    _train(model, opt, 2, 0, rank)
    ck.save(path, model, opt)
    return full_optim_state(model, opt)


def _load_optimizer_resharded(rank, ws, path):
    import fsdp2.checkpoint as ck

    model = shard(make_model(1), mesh_1d(ws))
    opt = _make_opt(model)
    _train(model, opt, 1, 50, rank)  # existing state gets overwritten in place of the old
    ck.load(path, model, opt)
    return full_optim_state(model, opt)


def _async_save(rank, ws, path):
    import fsdp2.checkpoint as ck

    model = shard(make_model(0), mesh_1d(ws))
    before = full_state(model)
    handle = ck.save(path, model, async_save=True)
    with torch.no_grad():  # training keeps mutating parameters while the thread writes
        for p in model.parameters():
            p.to_local().add_(1000.0)
    handle.wait()
    handle.wait()  # idempotent
    model2 = shard(make_model(3), mesh_1d(ws))
    ck.load(path, model2)
    return before, full_state(model2)


def _dcp_roundtrip(rank, ws, path):
    import torch.distributed.checkpoint as dcp

    model = shard(make_model(0), mesh_1d(ws))
    dcp.save(model.state_dict(), checkpoint_id=path)
    model2 = shard(make_model(9), mesh_1d(ws))
    sd = model2.state_dict()
    dcp.load(sd, checkpoint_id=path)
    model2.load_state_dict(sd)
    return full_state(model), full_state(model2)


def test_adamw_resume_is_bitwise_identical(worlds, tmp_path):
    for checks in worlds.run(2, _resume_bitwise, str(tmp_path / "c")):
        assert all(checks.values()), checks


def test_optimizer_state_reshards_2_to_3(worlds, tmp_path):
    path = str(tmp_path / "c")
    saved = worlds.run(2, _save_optimizer, path)[0]
    loaded = worlds.run(3, _load_optimizer_resharded, path)[0]
    assert saved.keys() == loaded.keys() and any(k.endswith("exp_avg_sq") for k in saved)
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k


def test_async_save_snapshots_and_commits_in_wait(worlds, tmp_path):
    before, loaded = worlds.run(2, _async_save, str(tmp_path / "c"))[0]
    assert_same_state(loaded, before)


def test_dtensor_state_dict_also_works_with_dcp(worlds, tmp_path):
    saved, loaded = worlds.run(2, _dcp_roundtrip, str(tmp_path / "dcp"))[0]
    assert_same_state(loaded, saved)
