"""fsdp2.optim.step_on_local_shards: bitwise the plain optimizer step on DTensors, at plain-tensor speed.

Exact equality throughout: the same element-wise kernels run on the same local values, only
without DTensor dispatch. Every parity check also asserts the steps really ran on local shards
(``local_steps``), so a silent fallback to the DTensor path cannot pass for parity.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.checkpoint.ckpt_helpers import make_model, mesh_1d, mesh_2d, shard


class OutOfPlaceMomentum(torch.optim.Optimizer):
    """Element-wise, but replaces its state tensor every step instead of updating it in place."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["buf"] = p.grad.clone() if "buf" not in state else state["buf"] * 0.5 + p.grad
                p.sub_(group["lr"] * state["buf"])


OPTIMIZERS = {
    "out_of_place": OutOfPlaceMomentum,
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adamw_foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
    "adam_amsgrad": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
    "sgd_momentum_foreach": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True),
    "sgd_plain": lambda params: torch.optim.SGD(params, lr=0.1),  # no state at all
}


def _params(seed: int, meshes):
    """DTensor parameters on 2 ranks: uneven and empty shards, Shard(1), Replicate, an HSDP-style
    (Replicate, Shard(0)) on a 2-D mesh, one frozen, one that never gets a gradient, and a plain one."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh, mesh2 = meshes
    g = torch.Generator().manual_seed(seed)
    specs = [
        ((5, 3), mesh, [Shard(0)]),  # 3 + 2 rows
        ((1, 4), mesh, [Shard(0)]),  # rank 1 holds 0 rows
        ((6,), mesh, [Shard(0)]),
        ((3, 4), mesh, [Shard(1)]),
        ((2, 2), mesh, [Replicate()]),
        ((4, 2), mesh2, [Replicate(), Shard(0)]),
        ((3, 3), mesh, [Shard(0)]),  # frozen
        ((2, 5), mesh, [Shard(0)]),  # never has a gradient
    ]
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(shape, generator=g), m, p)) for shape, m, p in specs]
    params[6].requires_grad_(False)
    params.append(torch.nn.Parameter(torch.randn(3, generator=g)))  # not a DTensor
    return params


def _give_grads(params, step: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        if not p.requires_grad or i == 7:
            continue
        full = torch.randn(p.shape, generator=g)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full


def _state_snapshot(opt):
    """state_dict() as comparable data: per entry its type, placements, global shape and local values."""
    from torch.distributed.tensor import DTensor

    out = {}
    for index, entries in opt.state_dict()["state"].items():
        for key, value in entries.items():
            if isinstance(value, DTensor):
                out[index, key] = ("DTensor", value.placements, tuple(value.shape), value.to_local().clone())
            elif isinstance(value, torch.Tensor):
                out[index, key] = ("Tensor", None, tuple(value.shape), value.clone())
            else:
                out[index, key] = (type(value).__name__, None, None, value)
    return out


def _same(a, b) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        (ta, pa, sa, va), (tb, pb, sb, vb) = a[k], b[k]
        if (ta, pa, sa) != (tb, pb, sb):
            return False
        if not (torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb):
            return False
    return True


def _parity(rank, world_size, name):
    from fsdp2.optim import step_on_local_shards

    meshes = (mesh_1d(world_size), mesh_2d(1, world_size))
    ref_params, fast_params = _params(0, meshes), _params(0, meshes)
    extra_ref, extra_fast = _params(1, meshes)[:3], _params(1, meshes)[:3]  # added as a second group
    # The plain parameter in a group of its own: foreach and fused kernels refuse a list mixing
    # tensors and DTensors on the DTensor path.
    ref, fast = (OPTIMIZERS[name]([{"params": ps[:-1]}, {"params": ps[-1:]}]) for ps in (ref_params, fast_params))
    handle = step_on_local_shards(fast, elementwise=name == "out_of_place")
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in (ref, fast)]
    results = []
    for step in range(4):
        if step == 2:
            ref.add_param_group({"params": extra_ref, "lr": 0.05})
            fast.add_param_group({"params": extra_fast, "lr": 0.05})
        for params in (
            (ref_params + (extra_ref if step >= 2 else [])),
            (fast_params + (extra_fast if step >= 2 else [])),
        ):
            _give_grads(params, step)
        ref.step()
        fast.step()
        for s in schedulers:
            s.step()
        ref.zero_grad()
        fast.zero_grad()
        pairs = list(zip(ref_params + extra_ref, fast_params + extra_fast))
        results.append(
            all(torch.equal(_local(a), _local(b)) for a, b in pairs)
            and _same(_state_snapshot(ref), _state_snapshot(fast))
            and [g["lr"] for g in ref.param_groups] == [g["lr"] for g in fast.param_groups]
        )
    # Between steps the aliases hold no gradient (it would keep the freed DTensor grads alive).
    grads_released = all(alias.grad is None for _, alias in handle.aliases)
    return results, handle.local_steps, grads_released


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bitwise_parity_with_the_dtensor_step(worlds, name):
    for results, local_steps, grads_released in worlds.run(2, _parity, name):
        assert results == [True] * 4
        assert local_steps == 4
        assert grads_released


def _changes_between_steps(rank, world_size, name):
    """Between local steps, change what a kept presentation was made from, the same way on a
    DTensor-path optimizer: a replaced state entry, load_state_dict, a swapped local shard, a
    parameter frozen, one without a gradient for a step. Every step must see the change."""
    from torch.distributed.tensor import distribute_tensor

    from fsdp2.optim import step_on_local_shards

    meshes = (mesh_1d(world_size), mesh_2d(1, world_size))
    ref_params, fast_params = _params(0, meshes), _params(0, meshes)
    ref, fast = (OPTIMIZERS[name]([{"params": ps[:-1]}, {"params": ps[-1:]}]) for ps in (ref_params, fast_params))
    handle = step_on_local_shards(fast, elementwise=name == "out_of_place")

    def change(step, params, opt):
        if step == 3:  # a state entry replaced by a new DTensor
            entries = opt.state[params[0]]
            key = next(k for k, v in entries.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
            entries[key] = entries[key] * 0.5 + 1.0
        elif step == 4:  # the whole state replaced, from a copy of the other optimizer's
            saved = ref.state_dict()
            state = {
                i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in e.items()}
                for i, e in saved["state"].items()
            }
            opt.load_state_dict({**saved, "state": state})
        elif step == 5:  # a parameter's local shard swapped (as module.to() or swap_tensors do)
            p = params[2]
            torch.utils.swap_tensors(
                p, torch.nn.Parameter(distribute_tensor(torch.full(p.shape, 0.25), p.device_mesh, p.placements))
            )
        elif step == 6:  # frozen from now on
            params[0].requires_grad_(False)

    results = []
    for step in range(8):
        for params, opt in ((ref_params, ref), (fast_params, fast)):
            change(step, params, opt)
            _give_grads(params, step)
            if step == 2:
                params[3].grad = None  # no gradient this step
        ref.step()
        fast.step()
        ref.zero_grad()
        fast.zero_grad()
        results.append(
            all(torch.equal(_local(a), _local(b)) for a, b in zip(ref_params, fast_params))
            and _same(_state_snapshot(ref), _state_snapshot(fast))
        )
    return results, handle.local_steps


@pytest.mark.parametrize("name", ["adamw", "adamw_foreach", "out_of_place", "sgd_momentum"])
def test_changes_between_steps_are_seen_as_on_dtensors(worlds, name):
    """The presentation a local step keeps from step to step is rebuilt whenever what it was made
    from changed (fails if a kept one is trusted: the step updates the old state or shard)."""
    for results, local_steps in worlds.run(2, _changes_between_steps, name):
        assert results == [True] * 8
        assert local_steps == 8


def _step_calls(world_size: int, n_params: int, local: bool) -> int:
    """Python calls of the third of three SGD-with-momentum steps over ``n_params`` parameters:
    DTensor parameters stepped on local shards, or plain tensors of the same local shapes."""
    import cProfile
    import pstats

    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp2.optim import step_on_local_shards

    mesh = mesh_1d(world_size)
    full = [torch.randn(4 * world_size, 3) for _ in range(n_params)]
    if local:
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
    else:
        params = [torch.nn.Parameter(t[:4].clone()) for t in full]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if local:
        step_on_local_shards(opt)
    for _ in range(3):  # the first creates the state, the second presents it, the third reuses that
        for p in params:
            p.grad = torch.ones_like(p)
        profile = cProfile.Profile()
        profile.enable()
        opt.step()
        profile.disable()
    return sum(calls for _, calls, *_ in pstats.Stats(profile).stats.values())


def test_a_local_step_adds_no_python_call_per_parameter(fake_world):
    """A steady local step costs the optimizer's own calls plus a few per step, none per parameter
    (fails before the kept presentation: ~55 calls per parameter, dict lookups keyed by tensors)."""
    fake_world(4)
    extra = {n: _step_calls(4, n, local=True) - _step_calls(4, n, local=False) for n in (8, 32)}
    assert extra[32] == extra[8], extra
    assert extra[8] < 40, extra


def _scalar_param_falls_back_until_it_has_state(rank, world_size):
    from torch.distributed.tensor import Replicate, distribute_tensor

    from fsdp2.optim import step_on_local_shards

    mesh = mesh_1d(world_size)
    made = [torch.nn.Parameter(distribute_tensor(torch.tensor(1.5), mesh, [Replicate()])) for _ in range(2)]
    ref, fast = (torch.optim.AdamW([p], lr=0.1) for p in made)
    handle = step_on_local_shards(fast)
    for step in range(3):
        for p in made:
            p.grad = distribute_tensor(torch.tensor(0.25 * (step + 1)), mesh, [Replicate()])
        ref.step()
        fast.step()
    return torch.equal(made[0].to_local(), made[1].to_local()) and _same(
        _state_snapshot(ref), _state_snapshot(fast)
    ), handle.local_steps


def test_scalar_param_takes_the_dtensor_path_until_its_state_exists(worlds):
    for same, local_steps in worlds.run(2, _scalar_param_falls_back_until_it_has_state):
        assert same and local_steps == 2


# -- checkpoint round trip through fsdp2.checkpoint ---------------------------------------------


def _train(model, optimizer, steps, first_step, rank):
    for step in range(first_step, first_step + steps):
        torch.manual_seed(1000 + 100 * rank + step)
        optimizer.zero_grad()
        model(torch.randn(4, 16)).square().sum().backward()
        optimizer.step()


def _resume(rank, world_size, path):
    import fsdp2.checkpoint as ck
    from fsdp2.optim import step_on_local_shards

    def job(seed):
        model = shard(make_model(seed), mesh_1d(world_size))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
        return model, opt, step_on_local_shards(opt)

    model, opt, handle = job(0)
    ref_model = shard(make_model(0), mesh_1d(world_size))
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    _train(model, opt, 2, 0, rank)
    _train(ref_model, ref_opt, 2, 0, rank)
    same_names = _same(_state_snapshot(ref_opt), _state_snapshot(opt))
    ck.save(path, model, opt)
    _train(model, opt, 2, 2, rank)
    expected = [p.to_local().clone() for p in model.parameters()]

    model2, opt2, handle2 = job(7)
    ck.load(path, model2, opt2)
    _train(model2, opt2, 2, 2, rank)
    resumed = all(torch.equal(a, b.to_local()) for a, b in zip(expected, model2.parameters()))
    return same_names, resumed, handle.local_steps, handle2.local_steps


def test_checkpoint_round_trip_resumes_bitwise(worlds, tmp_path):
    for same_names, resumed, steps_before, steps_after in worlds.run(2, _resume, str(tmp_path / "c")):
        assert same_names and resumed
        assert (steps_before, steps_after) == (4, 2)


# -- misuse --------------------------------------------------------------------------------------


def test_refuses_an_optimizer_not_known_to_be_elementwise():
    from fsdp2.optim import step_on_local_shards

    opt = torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(2))])
    step_before = opt.step
    with pytest.raises(ValueError, match="LBFGS is not known to update each element"):
        step_on_local_shards(opt)
    assert opt.step == step_before  # untouched
    step_on_local_shards(opt, elementwise=True)  # the caller vouches for it


def test_refuses_a_second_install_and_remove_restores_the_plain_step():
    from fsdp2.optim import step_on_local_shards

    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    handle = step_on_local_shards(opt)
    with pytest.raises(ValueError, match="already steps on local shards"):
        step_on_local_shards(opt)
    handle.remove()
    p.grad = torch.ones(2)
    opt.step()
    assert torch.equal(p.detach(), torch.zeros(2)) and handle.local_steps == 0
    step_on_local_shards(opt)  # a removed one can be replaced


# -- the default ---------------------------------------------------------------------------------


class AdamWSubclass(torch.optim.AdamW):
    """May override step() with anything: the default leaves subclasses alone."""


def _default_vs_dtensor_step(rank, world_size):
    from fsdp2.optim import step_on_dtensors
    from fsdp2.optim.local_step import _HANDLE_ATTR

    models = [shard(make_model(0), mesh_1d(world_size)) for _ in range(3)]
    default, dtensor, subclass = (
        cls(m.parameters(), lr=1e-2, weight_decay=0.1)
        for cls, m in zip((torch.optim.AdamW, torch.optim.AdamW, AdamWSubclass), models)
    )
    step_on_dtensors(dtensor)
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])  # no fully_shard parameter
    plain.param_groups[0]["params"][0].grad = torch.ones(2)
    for model, opt in zip(models, (default, dtensor, subclass)):
        _train(model, opt, 3, 0, rank)
    plain.step()
    handle = getattr(default, _HANDLE_ATTR, None)
    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(models[0].parameters(), models[1].parameters()))
    return (
        same and _same(_state_snapshot(default), _state_snapshot(dtensor)),
        handle is not None and handle.by_default and handle.local_steps,
        [getattr(o, _HANDLE_ATTR, None) is None for o in (dtensor, subclass, plain)],
    )


def test_by_default_fully_shard_optimizers_step_on_local_shards_bitwise(worlds):
    """An element-wise torch.optim optimizer over fully_shard parameters steps on local shards
    from its second step without being told (the first is under way when the default sees it),
    bitwise as on DTensors; opted-out, subclassed and non-fsdp2 optimizers are left alone."""
    for same, local_steps, untouched in worlds.run(2, _default_vs_dtensor_step):
        assert same
        assert local_steps == 2
        assert untouched == [True, True, True]


def test_an_explicit_install_after_the_default_returns_its_step():
    from fsdp2.optim import step_on_dtensors, step_on_local_shards
    from fsdp2.optim.local_step import LocalShardStep

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    installed = LocalShardStep(opt, by_default=True)
    assert step_on_local_shards(opt) is installed
    step_on_dtensors(opt)
    assert not installed.active


def _hooks_see_dtensors_under_the_default(rank, world_size):
    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from fsdp2.optim.local_step import _HANDLE_ATTR

    seen = []

    def record(optimizer, args, kwargs):
        seen.append(all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]))

    results = {}
    for where in ("optimizer", "global"):
        model = shard(make_model(0), mesh_1d(world_size))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train(model, opt, 2, 0, rank)  # the default is installed by now
        handle = (
            opt.register_step_pre_hook(record) if where == "optimizer" else register_optimizer_step_post_hook(record)
        )
        seen.clear()
        _train(model, opt, 2, 0, rank)
        handle.remove()
        _train(model, opt, 1, 0, rank)
        results[where] = (list(seen), getattr(opt, _HANDLE_ATTR).local_steps)
    return results


def test_the_default_leaves_step_hooks_the_dtensors_pytorch_shows_them(worlds):
    """Code that runs inside step() sees DTensor parameters, as on PyTorch's FSDP2: with a step
    hook on the optimizer or a global one, the default steps on DTensors; without, locally again."""
    for results in worlds.run(2, _hooks_see_dtensors_under_the_default):
        for where, (seen, local_steps) in results.items():
            assert seen == [True, True], where
            assert local_steps == 2, where  # step 2 (before the hook) and step 5 (after it) went local


def _switched_off_and_on(rank, world_size):
    from fsdp2.optim import set_local_shard_steps, step_on_local_shards
    from fsdp2.optim.local_step import _HANDLE_ATTR

    running_model = shard(make_model(0), mesh_1d(world_size))
    running = torch.optim.AdamW(running_model.parameters(), lr=1e-2)
    _train(running_model, running, 2, 0, rank)  # the default is installed by now, step 2 went local
    handle = getattr(running, _HANDLE_ATTR)
    set_local_shard_steps(False)
    try:
        later_model = shard(make_model(1), mesh_1d(world_size))  # a fully_shard call while off
        later = torch.optim.AdamW(later_model.parameters(), lr=1e-2)
        explicit_model = shard(make_model(2), mesh_1d(world_size))
        explicit = torch.optim.AdamW(explicit_model.parameters(), lr=1e-2)
        asked = step_on_local_shards(explicit)
        for model, opt in ((running_model, running), (later_model, later), (explicit_model, explicit)):
            _train(model, opt, 2, 2, rank)
        off = (handle.local_steps, getattr(later, _HANDLE_ATTR, None) is None, asked.local_steps)
    finally:
        set_local_shard_steps(True)
    _train(running_model, running, 1, 4, rank)
    _train(later_model, later, 2, 4, rank)  # the default sees it at the first, steps the second locally
    later_handle = getattr(later, _HANDLE_ATTR, None)
    on = (handle.local_steps, later_handle is not None and later_handle.by_default and later_handle.local_steps)
    return off, on


def test_set_local_shard_steps_turns_the_default_off_and_on_process_wide(worlds):
    """Off: no optimizer gets the local-shard step by default (also after a fully_shard call made
    while off), one that had it steps on DTensors, an explicit step_on_local_shards still works;
    on again: the default resumes for both."""
    for off, on in worlds.run(2, _switched_off_and_on):
        assert off == (1, True, 2)
        assert on == (2, 1)


def test_set_local_shard_steps_takes_a_bool():
    from fsdp2.optim import set_local_shard_steps

    with pytest.raises(TypeError, match="True or False"):
        set_local_shard_steps(0)


# -- the default's scope: optimizers over anything but fsdp2 shards ------------------------------


@contextlib.contextmanager
def _default_off():
    """The default's hook removed for a block (as if fully_shard had never run)."""
    from fsdp2.optim import set_local_shard_steps

    set_local_shard_steps(False)
    try:
        yield
    finally:
        set_local_shard_steps(True)


def _unrelated_optimizer_steps(rank, world_size):
    """Two identical optimizers over plain tensors, and two over PyTorch FSDP2's DTensors, in a
    process where fully_shard has run: one of each pair steps with fsdp2's default registered, the
    other with it removed. Per kind: bitwise the same, the same attributes, the class's own step,
    and the host work of a steady step (ATen ops, bytes, Python calls by file) with and without."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp2.tools import count_host_work

    shard(make_model(0), mesh_1d(world_size))  # fsdp2 parameters exist: the default is on

    def plain_params():
        return list(make_model(0).parameters())

    def torch_fsdp2_params():
        return list(torch_fully_shard(make_model(0), mesh=mesh_1d(world_size)).parameters())

    results = {}
    for kind, build in (("plain", plain_params), ("pytorch_fsdp2", torch_fsdp2_params)):
        params = [build(), build()]
        opts = [torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True) for ps in params]

        def step(i):
            for p in params[i]:
                p.grad = torch.full_like(p, 0.25)
            opts[i].step()

        for _ in range(3):
            step(0)
            with _default_off():
                step(1)
        with_default = count_host_work(lambda: step(0))
        with _default_off():
            without = count_host_work(lambda: step(1))
        extra_calls = {
            file.rpartition("/")[2]: with_default.calls_by_file.get(file, 0) - without.calls_by_file.get(file, 0)
            for file in {*with_default.calls_by_file, *without.calls_by_file}
        }
        results[kind] = dict(
            same=all(torch.equal(_local(a), _local(b)) for a, b in zip(*params))
            and _same(_state_snapshot(opts[0]), _state_snapshot(opts[1])),
            same_attributes=sorted(vars(opts[0])) == sorted(vars(opts[1])),
            own_step="step" not in vars(opts[0]),
            same_ops=(with_default.ops, with_default.bytes_by_op) == (without.ops, without.bytes_by_op),
            extra_calls={file: n for file, n in extra_calls.items() if n},
        )
    return results


def test_the_default_leaves_optimizers_over_other_tensors_as_they_are(worlds):
    """Optimizers over plain tensors or PyTorch FSDP2's DTensors step bitwise as without fsdp2, with
    nothing written on them and the same ops; the default's global hook adds its own Python call
    per step and nothing else (fails when it marks the optimizers it looks at, an attribute and a
    dict lookup per step)."""
    for results in worlds.run(2, _unrelated_optimizer_steps):
        for kind, result in results.items():
            assert result == dict(
                same=True,
                same_attributes=True,
                own_step=True,
                same_ops=True,
                extra_calls={"local_step.py": 1},
            ), kind


def test_the_default_hook_exists_from_the_first_fully_shard_until_switched_off():
    """Importing fsdp2 registers nothing with torch.optim; the first fully_shard registers one global
    step pre-hook (no more for later calls), set_local_shard_steps(False) removes it, True restores it."""
    import subprocess
    import sys

    code = """
import torch, torch.distributed as dist
from torch.optim.optimizer import _global_optimizer_pre_hooks as hooks
from torch.testing._internal.distributed.fake_pg import FakeStore
import fsdp2, fsdp2.optim
counts = [len(hooks)]
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
modules = []
for _ in range(2):
    modules.append(fsdp2.fully_shard(torch.nn.Linear(4, 4)))
    counts.append(len(hooks))
fsdp2.optim.set_local_shard_steps(False)
counts.append(len(hooks))
fsdp2.optim.set_local_shard_steps(True)
counts.append(len(hooks))
print(counts)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[0, 1, 1, 0, 1]"
