"""fsdp2.optim.Muon and the whole-matrix exchange (fsdp2.optim.whole_matrix).

Parity: a GPT sharded with fully_shard and stepped by ``fsdp2.optim.Muon`` (AdamW group for
embeddings, head, biases and norms) against an unsharded replica stepped by ``torch.optim.Muon``
+ ``torch.optim.AdamW``, fp32, every parameter compared after each of 5 steps. The replica steps
on the sharded model's gradients (gathered), so the optimizers alone could make them differ; the
tolerance is **zero**: an owner runs the same bfloat16 Newton-Schulz on the same whole matrix.

Why the replica does not compute its own gradients: they differ from the reduce-scattered ones in
summation order (~1e-7), and Newton-Schulz in bfloat16 turns one flipped input rounding into
output changes of several bfloat16 ulps. Unsharded ``torch.optim.Muon`` against itself, once on
the whole batch and once on the sum of two half-batch gradients, already drifts 1.4e-4 after one
step and 7e-4 after five on this model (and fsdp2 end to end: 1.4e-4 and 1e-3, the same noise).

Work: every matrix is orthogonalized exactly once per shard group, the busiest rank does at most
1.2/N of the Newton-Schulz flops, and ``count_comm`` sees exactly ``expected_comm_bytes()``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp2.models import GPT, GPTConfig
from fsdp2.optim import Muon, WholeMatrixSchedule, gather_apply, muon_param_groups
from fsdp2.optim.muon import default_use_muon
from fsdp2.optim.newton_schulz import newton_schulz, newton_schulz_flops
from fsdp2.optim.whole_matrix import balance

# Uneven on purpose: 36-wide layers and 67 vocab rows don't split evenly over 4 ranks.
TINY = GPTConfig(vocab_size=67, seq_len=16, dim=36, n_layers=2, n_heads=3)
STEPS = 5
BATCH_PER_RANK = 2
ADAMW_LR = 3e-3


@dataclass(frozen=True)
class Case:
    lr: float = 0.02
    nesterov: bool = True
    adjust_lr_fn: str | None = None
    shard_dim: int = 0
    hsdp: bool = False  # 2 x (world / 2) mesh: replicate x shard


CASES = {
    "default": Case(),
    "plain-momentum-match-rms": Case(nesterov=False, adjust_lr_fn="match_rms_adamw", lr=0.002),
    "shard-dim-1": Case(shard_dim=1),
    "hsdp": Case(hsdp=True),
}


def _mesh(world_size: int, case: Case):
    from torch.distributed.device_mesh import init_device_mesh

    if case.hsdp:
        return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world_size,))


def _shard(model: GPT, mesh, shard_dim: int) -> GPT:
    from torch.distributed.tensor import Shard

    from fsdp2 import fully_shard

    place = lambda p: Shard(shard_dim if p.dim() > shard_dim else 0)  # noqa: E731
    for block in model.blocks:
        fully_shard(block, mesh=mesh, shard_placement_fn=place)
    return fully_shard(model, mesh=mesh, shard_placement_fn=place)


def _torch_optimizers(model: GPT, case: Case) -> list[torch.optim.Optimizer]:
    """The usual recipe with torch's optimizers: Muon for hidden matrices, AdamW for the rest."""
    rule = default_use_muon(model)
    named = list(model.named_parameters())
    return [
        torch.optim.Muon(
            [p for n, p in named if rule(n, p)], lr=case.lr, nesterov=case.nesterov, adjust_lr_fn=case.adjust_lr_fn
        ),
        torch.optim.AdamW([p for n, p in named if not rule(n, p)], lr=ADAMW_LR, weight_decay=0.1),
    ]


def _muon(model: GPT, case: Case) -> Muon:
    return Muon(
        muon_param_groups(model), lr=case.lr, nesterov=case.nesterov, adjust_lr_fn=case.adjust_lr_fn, adamw_lr=ADAMW_LR
    )


def _batch(step: int, world_size: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, TINY.vocab_size, (BATCH_PER_RANK * world_size, TINY.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _backward_side_by_side(rank: int, world_size: int, model: GPT, reference: GPT, step: int) -> None:
    """Gradients of the sharded model on this rank's rows; the reference gets them gathered."""
    tokens, targets = _batch(step, world_size)
    rows = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    model.loss(tokens[rows], targets[rows]).backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        r.grad = p.grad.full_tensor()


def _step(optimizers: list[torch.optim.Optimizer]) -> None:
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


def _diffs(model: GPT, reference: GPT) -> dict[str, float]:
    return {
        n: (p.full_tensor() - r).abs().max().item()
        for (n, p), r in zip(model.named_parameters(), reference.parameters())
    }


def _matrices(model: GPT) -> list[torch.Tensor]:
    rule = default_use_muon(model)
    return [p for n, p in model.named_parameters() if rule(n, p)]


def train_side_by_side(rank: int, world_size: int, case: Case, steps: int = STEPS, optimizer: str = "fsdp2") -> dict:
    """Per step: the largest difference of each parameter from the reference, and the bytes
    all-to-all'ed (measured and expected); at the end, the Newton-Schulz flops this rank ran.

    ``optimizer="torch"``: torch.optim.Muon + AdamW stepping the DTensor shards instead of ours.
    """
    from fsdp2.tools.comm_stats import count_comm

    torch.manual_seed(0)
    reference = GPT(TINY)
    model = _shard(copy.deepcopy(reference), _mesh(world_size, case), case.shard_dim)
    opts = [_muon(model, case)] if optimizer == "fsdp2" else _torch_optimizers(model, case)
    ref_opts = _torch_optimizers(reference, case)
    record = {"diffs": [], "comm": [], "expected_comm": []}
    for step in range(steps):
        _backward_side_by_side(rank, world_size, model, reference, step)
        if optimizer == "fsdp2":
            record["expected_comm"].append(opts[0].expected_comm_bytes())
        with count_comm() as stats:
            _step(opts)
        record["comm"].append((stats.bytes["all_to_all"], stats.calls["all_to_all"]))
        _step(ref_opts)
        record["diffs"].append(_diffs(model, reference))
    matrices = _matrices(reference)
    record["ns_flops"] = getattr(opts[0], "newton_schulz_flops", None)
    record["total_flops"] = steps * sum(newton_schulz_flops(p.shape, 5) for p in matrices)
    record["matrix_numel"] = sum(p.numel() for p in matrices)
    return record


def _assert_parity(diffs: list[dict], atol: float = 0.0) -> None:
    for step, d in enumerate(diffs):
        name, worst = max(d.items(), key=lambda kv: kv[1])
        assert worst <= atol, f"step {step}: {name} differs by {worst:.3g}"


def _assert_work(results: list[dict], shard_size: int) -> None:
    """Newton-Schulz flops split over each shard group; all-to-all bytes exactly as predicted."""
    for r in results:
        assert [b for b, _ in r["comm"]] == r["expected_comm"]
        assert {calls for _, calls in r["comm"]} == {2 if shard_size > 1 else 0}
    total = results[0]["total_flops"]
    for start in range(0, len(results), shard_size):  # the ranks of a shard group are consecutive
        group = results[start : start + shard_size]
        flops = [r["ns_flops"] for r in group]
        assert sum(flops) == total, "every matrix is orthogonalized exactly once per shard group"
        assert max(flops) <= 1.2 * total / shard_size, flops
        if shard_size > 1:  # to the owners and back: 2 x the matrices in bfloat16, + a status per rank pair
            assert sum(r["comm"][0][0] for r in group) == 2 * (2 * group[0]["matrix_numel"] + shard_size**2)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parity_with_unsharded_torch_muon(worlds, world_size):
    results = worlds.run(world_size, train_side_by_side, CASES["default"])
    _assert_parity(results[0]["diffs"])
    _assert_work(results, shard_size=world_size)


@pytest.mark.parametrize("case", ["plain-momentum-match-rms", "shard-dim-1", "hsdp"])
def test_parity_options_and_meshes(worlds, case):
    results = worlds.run(4, train_side_by_side, CASES[case])
    _assert_parity(results[0]["diffs"])
    _assert_work(results, shard_size=2 if CASES[case].hsdp else 4)


def test_torch_muon_on_the_shards_fails_the_parity_check(worlds):
    """Why fsdp2.optim.Muon exists, and proof that the check can fail: torch.optim.Muon stepping the
    DTensor shards of the same model, on the same gradients, is already off after one step."""
    diffs = worlds.run(2, train_side_by_side, Case(), 1, "torch")[0]["diffs"]
    with pytest.raises(AssertionError, match="step 0"):
        _assert_parity(diffs, atol=1e-5)


# -- checkpoint round trip, resharded ------------------------------------------------------------


def _train_and_save(rank: int, world_size: int, path: str, steps: int) -> None:
    """fsdp2 model + Muon and the reference side by side; both saved (the reference with torch.save)."""
    from fsdp2 import checkpoint

    torch.manual_seed(0)
    reference = GPT(TINY)
    model = _shard(copy.deepcopy(reference), _mesh(world_size, Case()), 0)
    opt, ref_opts = _muon(model, Case()), _torch_optimizers(reference, Case())
    for step in range(steps):
        _backward_side_by_side(rank, world_size, model, reference, step)
        _step([opt, *ref_opts])
    checkpoint.save(path, model, opt, extra={"step": steps})
    if rank == 0:
        torch.save({"model": reference.state_dict(), "opts": [o.state_dict() for o in ref_opts]}, f"{path}.ref.pt")


def _resume_and_compare(rank: int, world_size: int, path: str, steps: int) -> list[dict]:
    from fsdp2 import checkpoint

    torch.manual_seed(1)  # other initial weights: the checkpoints must overwrite them
    reference = GPT(TINY)
    model = _shard(GPT(TINY), _mesh(world_size, Case()), 0)
    opt, ref_opts = _muon(model, Case()), _torch_optimizers(reference, Case())
    start = checkpoint.load(path, model, opt)["step"]
    saved = torch.load(f"{path}.ref.pt")
    reference.load_state_dict(saved["model"])
    for ref_opt, state in zip(ref_opts, saved["opts"]):
        ref_opt.load_state_dict(state)
    assert all("momentum_buffer" in opt.state[p] for g in opt.param_groups if g["use_muon"] for p in g["params"])
    diffs = []
    for step in range(start, steps):
        _backward_side_by_side(rank, world_size, model, reference, step)
        _step([opt, *ref_opts])
        diffs.append(_diffs(model, reference))
    return diffs


def test_checkpoint_resume_on_another_world_size(worlds, tmp_path):
    """Save after 2 steps on 2 ranks; load on 4 ranks (momentum and Adam state resharded) and
    step twice more: still bitwise the unsharded torch.optim.Muon's parameters."""
    path = str(tmp_path / "ckpt")
    worlds.run(2, _train_and_save, path, 2)
    _assert_parity(worlds.run(4, _resume_and_compare, path, 4)[0])


# -- the whole-matrix exchange on its own ----------------------------------------------------------


def _whole_matrix_transform(i: int, whole: torch.Tensor) -> torch.Tensor:
    """Depends on every element of the whole tensor (a row-shard transform would differ)."""
    if whole.ndim == 1:
        return whole.cumsum(0) * (i + 1)
    flat = whole.reshape(whole.shape[0], -1)
    return (flat.cumsum(0).cumsum(1) + i).reshape(whole.shape)


def exchange_matches_local(rank: int, world_size: int, specs: list, hsdp: bool, seed: int) -> list[int]:
    """Every spec ``(shape, shard_dim)`` (``shard_dim=None``: a plain tensor) through gather_apply,
    compared with the transform applied to the whole tensor locally. Returns the indices this
    rank transformed."""
    from torch.distributed.tensor import DTensor, Shard

    from fsdp2.layout.shard_layout import ShardLayout

    mesh = _mesh(world_size, Case(hsdp=hsdp))
    g = torch.Generator().manual_seed(seed)
    wholes = [torch.randn(shape, generator=g) for shape, _ in specs]
    tensors = []
    for whole, (shape, dim) in zip(wholes, specs):
        if dim is None:
            tensors.append(whole.clone())
            continue
        shard_mesh_dim = mesh.ndim - 1
        layout = ShardLayout(whole.shape, dim, mesh.size(shard_mesh_dim), mesh.get_local_rank(shard_mesh_dim))
        placements = (Shard(dim),) if mesh.ndim == 1 else (mesh_replicate(), Shard(dim))
        tensors.append(
            DTensor.from_local(
                layout.local_slice(whole).clone(),
                mesh,
                placements,
                run_check=False,
                shape=whole.shape,
                stride=whole.stride(),
            )
        )
    seen = []

    def fn(i, whole):
        seen.append(i)
        assert torch.equal(whole, wholes[i]), f"tensor {i} arrived wrong at its owner"
        return _whole_matrix_transform(i, whole)

    results = gather_apply(fn, tensors)
    schedule = WholeMatrixSchedule(tensors)  # the owners gather_apply used, and every step would
    group_rank = mesh.get_local_rank(mesh.ndim - 1)
    assert sorted(seen) == [i for i in range(len(specs)) if schedule.owner(i) in (None, group_rank)]
    for i, (result, whole) in enumerate(zip(results, wholes)):
        expected = _whole_matrix_transform(i, whole)
        if isinstance(result, DTensor):
            assert result.placements == tensors[i].placements
            layout = ShardLayout(
                whole.shape,
                specs[i][1],
                result.device_mesh.size(mesh.ndim - 1),
                result.device_mesh.get_local_rank(mesh.ndim - 1),
            )
            expected = layout.local_slice(expected)
            result = result.to_local()
        torch.testing.assert_close(result, expected, rtol=0, atol=0, msg=lambda m: f"tensor {i}: {m}")
    return seen


def mesh_replicate():
    from torch.distributed.tensor import Replicate

    return Replicate()


_shapes = st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)
_specs = st.lists(
    _shapes.flatmap(lambda s: st.tuples(st.just(s), st.sampled_from([None, *range(len(s))]))), min_size=1, max_size=6
)


@settings(max_examples=8, deadline=None)
@given(specs=_specs, hsdp=st.booleans(), seed=st.integers(0, 2**16))
def test_gather_apply_on_any_shapes_and_shard_dims(worlds, specs, hsdp, seed):
    """Uneven and smaller-than-world shards, any shard dim, plain tensors, FSDP and HSDP meshes:
    each tensor arrives whole at exactly one rank per shard group, and every rank gets its exact
    shard of the result."""
    seen = worlds.run(4, exchange_matches_local, specs, hsdp, seed)
    shard_size = 2 if hsdp else 4
    for start in range(0, 4, shard_size):
        group = [i for ranks in seen[start : start + shard_size] for i in ranks]
        plain = [i for i, (_, dim) in enumerate(specs) if dim is None]
        sharded = [i for i in range(len(specs)) if i not in plain]
        assert sorted(group) == sorted(sharded + plain * shard_size)


def _failing_transform(rank: int, world_size: int) -> str:
    from torch.distributed.tensor import DTensor, Shard

    mesh = _mesh(world_size, Case())
    t = DTensor.from_local(torch.ones(2, 4), mesh, (Shard(0),), run_check=False, shape=(4, 4), stride=(4, 1))
    with pytest.raises((ValueError, RuntimeError)) as err:
        gather_apply(lambda i, w: w[:1], [t])
    return str(err.value)


def test_a_failing_transform_raises_on_every_rank(worlds):
    """The owner raises its own error; the other ranks learn of it from the return trip (no hang)."""
    owner, other = worlds.run(2, _failing_transform)
    assert "returned shape (1, 4) for tensor 0 of shape (4, 4)" in owner
    assert "failed on rank(s) [0]" in other


# -- Newton-Schulz, owners, bad input (single process) ----------------------------------------------


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), steps=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_newton_schulz_is_bitwise_torchs_and_counts_its_flops(rows, cols, steps, seed):
    from torch.optim._muon import _zeropower_via_newtonschulz
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    coefficients = (3.4445, -4.7750, 2.0315)
    expected = _zeropower_via_newtonschulz(x.clone(), coefficients, steps, 1e-7)
    with FlopCounterMode(display=False) as counter:
        ours = newton_schulz(x, coefficients, steps, 1e-7)
    assert torch.equal(ours, expected)
    assert counter.get_total_flops() == newton_schulz_flops((rows, cols), steps)


@settings(max_examples=50, deadline=None)
@given(costs=st.lists(st.floats(0, 1e6), max_size=40), ranks=st.integers(1, 16))
def test_balance_is_within_one_item_of_the_mean(costs, ranks):
    owners = balance(costs, ranks)
    loads = [0.0] * ranks
    for cost, owner in zip(costs, owners):
        loads[owner] += cost
    # Greedy largest-first: the busiest rank's last item came when it was the least loaded.
    assert max(loads) <= sum(costs) / ranks + max(costs, default=0) + 1e-6
    assert owners == balance(costs, ranks)


def test_single_process_matches_torch_bitwise():
    torch.manual_seed(0)
    reference = GPT(TINY)
    model = copy.deepcopy(reference)
    ref_opts = _torch_optimizers(reference, Case())
    opt = _muon(model, Case())
    for step in range(3):
        tokens, targets = _batch(step, 1)
        for m in (model, reference):
            m.loss(tokens, targets).backward()
        for o in (opt, *ref_opts):
            o.step()
            o.zero_grad()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, r), name


def test_flatten_orthogonalizes_conv_kernels_as_matrices():
    torch.manual_seed(0)
    kernel = torch.nn.Parameter(torch.randn(6, 3, 2, 2))
    matrix = torch.nn.Parameter(kernel.detach().reshape(6, 12).clone())
    with pytest.raises(ValueError, match=r"shape \(6, 3, 2, 2\).*flatten=True"):
        Muon([kernel])
    ours, torchs = Muon([kernel], lr=0.02, flatten=True), torch.optim.Muon([matrix], lr=0.02)
    for _ in range(2):
        grad = torch.randn(6, 12)
        kernel.grad, matrix.grad = grad.reshape(6, 3, 2, 2).clone(), grad.clone()
        ours.step()
        torchs.step()
    assert torch.equal(kernel.detach().reshape(6, 12), matrix.detach())


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda m: Muon(m.parameters()), r"parameter of shape \(36,\).*use_muon"),
        (lambda m: Muon(m.named_parameters()), r"'blocks.0.ln1.weight'.*use_muon"),
        (lambda m: Muon(muon_param_groups(m), adjust_lr_fn="sqrt"), "adjust_lr_fn 'sqrt'"),
        (lambda m: Muon(muon_param_groups(m), ns_steps=100), "ns_steps"),
        (lambda m: Muon(muon_param_groups(m), momentum=-1), "momentum"),
        (lambda m: Muon(muon_param_groups(m), adamw_betas=(0.9, 1.0)), "betas"),
    ],
)
def test_bad_arguments_are_refused(make, message):
    model = GPT(TINY)
    with pytest.raises(ValueError, match=message):
        make(model)


def test_default_split_puts_embeddings_head_and_vectors_in_adamw():
    groups = muon_param_groups(GPT(GPTConfig(**{**TINY.__dict__, "tie_weights": True})))
    muon = {n for n, _ in groups[0]["params"]}
    adamw = {n for n, _ in groups[1]["params"]}
    assert muon == {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")}
    assert {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "blocks.0.mlp.0.bias"} <= adamw
    assert groups[1]["use_muon"] is False


def _tensor_parallel_refused(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from fsdp2 import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    with pytest.raises(ValueError, match="tensor-parallel \\+ FSDP") as err:
        Muon(model.named_parameters())
    return str(err.value)


def test_tensor_parallel_parameters_are_refused_with_a_clear_error(worlds):
    message = worlds.run(4, _tensor_parallel_refused)[0]
    assert "'0.weight'" in message and "use_muon" in message


def test_steps_in_a_fake_process_group(fake_world):
    """The benchmark's setting: rank 0 of 8 simulated (collectives leave garbage, never a failure
    status); rank 0 runs exactly the Newton-Schulz flops of the matrices it owns."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2.tools.comm_stats import count_comm

    fake_world(8)
    model = _shard(GPT(TINY), init_device_mesh("cpu", (8,)), 0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = _muon(model, Case())
    expected = opt.expected_comm_bytes()
    with count_comm() as stats:
        opt.step()
    assert stats.bytes["all_to_all"] == expected > 0
    assert opt.newton_schulz_flops == opt._schedule.cost_on_this_rank() > 0
