"""Drop-in on the meshes large runs train on, side by side with PyTorch's FSDP2 (tests/support/parity.py).

torchtitan builds every mesh by unflattening one flat world mesh, composes FSDP with tensor and
sequence parallelism, and accumulates gradients over pipeline microbatches without sync. Losses,
parameters and collective counts must be bitwise PyTorch's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn

from fsdp2.models import Llama, LlamaConfig
from tests.support.models import llama_sequence_parallel
from tests.support.parity import CollectiveCounter, assert_same_layout, assert_same_params, twins

CFG = LlamaConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4, hidden_dim=48)

_PYTORCH_2_13 = hasattr(torch_fsdp, "DataParallelMeshDims")  # its FSDP2's newest public name


def _tp_meshes(kind: str):
    """(data-parallel mesh, TP mesh) of 4 ranks as 2 x 2: slices of one named mesh, or (torchtitan's
    way) of two meshes unflattened from a flat world mesh, whose root names neither dim."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind in ("named", "tp-first"):
        names = ("fsdp", "tp") if kind == "named" else ("tp", "fsdp")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        return mesh["fsdp"], mesh["tp"]
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (2, 2), ("fsdp", "tp"))
    loading = world._unflatten(0, (2, 2), ("batch", "tp"))
    return dense["fsdp"], loading["tp"]


def _tensor_parallel_side_by_side(rank, ws, kind, mixed_precision, microbatches, steps=2):
    """Llama with TP + sequence parallel on the TP mesh, fully_shard on the data-parallel mesh; each
    step accumulates ``microbatches`` backwards, gradient sync off for all but the last."""
    dp_mesh, tp_mesh = _tp_meshes(kind)
    mp = (
        torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else torch_fsdp.MixedPrecisionPolicy()
    )

    def shard(model, fully_shard):
        llama_sequence_parallel(model, tp_mesh)
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)

    theirs, ours = twins(lambda: Llama(CFG), shard)
    assert_same_layout(theirs, ours)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, CFG.vocab_size, (dp_size * microbatches, CFG.seq_len + 1), generator=g)
        mine = tokens[dp_rank * microbatches : (dp_rank + 1) * microbatches]  # TP peers share their batch
        results = []
        for model, opt in zip((theirs, ours), opts):
            losses = []
            with CollectiveCounter() as comm:
                for micro in range(microbatches):
                    model.set_requires_gradient_sync(micro == microbatches - 1)
                    loss = model.loss(mine[micro : micro + 1, :-1], mine[micro : micro + 1, 1:])
                    loss.backward()
                    losses.append(loss.detach())
            grads = [p.grad.full_tensor() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            results.append((torch.stack(losses), comm.counts, grads))
        (their_losses, their_comm, their_grads), (our_losses, our_comm, our_grads) = results
        assert torch.equal(their_losses, our_losses), (step, their_losses, our_losses)
        assert their_comm == our_comm, (step, their_comm, our_comm)
        for (name, _), a, b in zip(theirs.named_parameters(), their_grads, our_grads):
            assert torch.equal(a, b), f"step {step}: gradient of {name} differs from PyTorch FSDP2"
        assert_same_params(theirs, ours)


@pytest.mark.skipif(not _PYTORCH_2_13, reason="PyTorch < 2.13 cannot join meshes made by unflattening")
@pytest.mark.parametrize("kind", ["unflattened", "named", "tp-first"])
def test_tensor_parallel_on_meshes_made_by_unflattening_like_pytorch(worlds, kind):
    """torchtitan unflattens one world mesh into the FSDP mesh and (separately) the TP mesh; a named
    mesh may also list the TP dim first."""
    worlds.run(4, _tensor_parallel_side_by_side, kind, False, 1)


@pytest.mark.skipif(not _PYTORCH_2_13, reason="PyTorch < 2.13 cannot join meshes made by unflattening")
def test_partial_gradients_summed_over_microbatches_like_pytorch(worlds):
    """Norm weights replicated under sequence parallelism get pending-sum (Partial) gradients in
    bf16; across backwards without sync they add up in the reduce dtype and are reduced once."""
    worlds.run(4, _tensor_parallel_side_by_side, "unflattened", True, 3)


def _tp_mesh_of_another_root(rank, ws):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor

    from fsdp2 import FSDPUsageError, fully_shard

    dp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))["fsdp"]
    # A root listing the ranks in another order: its dims index other devices than dp_mesh's root's.
    tp_mesh = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("batch", "tp"))["tp"]
    model = Llama(CFG)
    llama_sequence_parallel(model, tp_mesh)
    block = model.blocks[0]
    before = dict(block.named_parameters())
    with pytest.raises(FSDPUsageError) as caught:
        fully_shard(block, mesh=dp_mesh)
    unchanged = all(p is before[n] and isinstance(p, DTensor) for n, p in block.named_parameters())
    return str(caught.value), unchanged


def test_tensor_parallel_mesh_of_another_root_is_explained(worlds):
    message, unchanged = worlds.run(4, _tp_mesh_of_another_root)[0]
    assert "attn_norm.weight" in message and "DeviceMesh((tp=2)" in message, message
    assert "shares no root mesh" in message and "Slice the data-parallel and tensor-parallel meshes" in message
    assert unchanged


# -- one fully_shard call over two meshes: torchtitan's expert-parallel MoE -----------------------------


class _LocalExperts(nn.Module):
    """Experts whose weights are DTensors split across the expert-parallel mesh (``Shard(0)``): each
    rank computes with its own experts, weighted by their router gates (no token dispatch)."""

    def __init__(self, n=4, dim=8, hidden=16):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, dim, hidden) * 0.1)
        self.w2 = nn.Parameter(torch.randn(n, hidden, dim) * 0.1)

    def forward(self, h, gate):
        w1, w2 = self.w1.to_local(), self.w2.to_local()
        first = self.w1.device_mesh.get_local_rank() * w1.shape[0]
        gate = gate[:, first : first + w1.shape[0]]
        out = torch.einsum("bd,edf->bef", h, w1).relu()
        return (torch.einsum("bef,efd->bed", out, w2) * gate.unsqueeze(-1)).sum(1)


class _MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense, self.router, self.experts = nn.Linear(8, 8), nn.Linear(8, 4), _LocalExperts()

    def forward(self, x):
        h = self.dense(x)
        return x + self.experts(h, self.router(h).softmax(-1))


class _MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_MoEBlock() for _ in range(2))
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _expert_meshes():
    """torchtitan's meshes on 4 ranks: the dense 'fsdp' mesh and the sparse (efsdp, ep) mesh, both
    unflattened from one flat world mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (4,), ("fsdp",))
    sparse = world._unflatten(0, (2, 2), ("efsdp", "ep"))
    return dense["fsdp"], sparse["efsdp"], sparse["ep"]


def _experts_on_their_mesh(rank, ws, expert_placement, explicit_prefetch, steps=2, microbatches=2):
    """Each block is one fully_shard call: experts on the efsdp mesh (``Shard(0)``, or ``Shard(1)``
    as torchtitan chooses when efsdp * ep > num_experts), the rest on the dense mesh, through
    ShardPlacementResult; explicit prefetch across the blocks as torchtitan sets it with EP."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp2 import clip_grad_norm_

    dp_mesh, efsdp_mesh, ep_mesh = _expert_meshes()
    dp_info, efsdp_info = FSDPMeshInfo(dp_mesh, shard_mesh_dim=0), FSDPMeshInfo(efsdp_mesh, shard_mesh_dim=0)
    placement = Shard(expert_placement)

    def shard(model, fully_shard):
        for block in model.blocks:
            for name in ("w1", "w2"):
                weight = getattr(block.experts, name)
                setattr(block.experts, name, nn.Parameter(distribute_tensor(weight.detach(), ep_mesh, [Shard(0)])))
            experts = set(block.experts.parameters())

            def placement_fn(p, experts=experts):
                if p in experts:
                    return ShardPlacementResult(placement, efsdp_info)
                return ShardPlacementResult(Shard(0), dp_info)

            fully_shard(block, mesh=dp_mesh, shard_placement_fn=placement_fn)
        fully_shard(model, mesh=dp_mesh)
        if explicit_prefetch:
            first, second = model.blocks
            first.set_modules_to_forward_prefetch([second])
            second.set_modules_to_backward_prefetch([first])

    theirs, ours = twins(_MoENet, shard)
    assert_same_layout(theirs, ours)
    views = [torch_fsdp.fully_shard.state(m.blocks[0])._fsdp_param_groups for m in (theirs, ours)]
    assert [len(v) for v in views] == [2, 2], views
    for model in (theirs, ours):  # the one-group accessor refuses, in both
        with pytest.raises(AssertionError, match="_fsdp_param_groups"):
            torch_fsdp.fully_shard.state(model.blocks[0])._fsdp_param_group
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(ws, microbatches, 4, 8, generator=g)[rank]
        y = torch.randint(0, 3, (ws, microbatches, 4), generator=g)[rank]
        results = []
        for model, opt in zip((theirs, ours), opts):
            with CollectiveCounter() as comm:
                losses = []
                for micro in range(microbatches):
                    model.set_requires_gradient_sync(micro == microbatches - 1)
                    loss = torch.nn.functional.cross_entropy(model(x[micro]), y[micro])
                    loss.backward()
                    losses.append(loss.detach())
                norm = clip_grad_norm_(model.parameters(), max_norm=0.5)
            grads = [p.grad.full_tensor() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            results.append((torch.stack(losses), norm, comm.counts, grads))
        (l1, n1, c1, g1), (l2, n2, c2, g2) = results
        assert torch.equal(l1, l2) and torch.equal(n1, n2), (step, l1, l2, n1, n2)
        assert c1 == c2, (step, c1, c2)
        for (name, _), a, b in zip(theirs.named_parameters(), g1, g2):
            assert torch.equal(a, b), f"step {step}: gradient of {name} differs from PyTorch FSDP2"
        assert_same_params(theirs, ours)


@pytest.mark.skipif(not _PYTORCH_2_13, reason="PyTorch < 2.13 has no ShardPlacementResult")
@pytest.mark.parametrize("expert_placement, explicit_prefetch", [(0, True), (1, False)])
def test_one_call_over_two_meshes_like_pytorch(worlds, expert_placement, explicit_prefetch):
    worlds.run(4, _experts_on_their_mesh, expert_placement, explicit_prefetch)


def _build_two_mesh_net(seed, fully_shard_fn=None):
    """_MoENet sharded as in _experts_on_their_mesh (Shard(0) experts), built from ``seed``, by
    fsdp2's fully_shard unless ``fully_shard_fn`` is given."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp2 import fully_shard

    fully_shard = fully_shard_fn or fully_shard
    dp_mesh, efsdp_mesh, ep_mesh = _expert_meshes()
    efsdp_info = FSDPMeshInfo(efsdp_mesh, shard_mesh_dim=0)
    torch.manual_seed(seed)
    model = _MoENet()
    for block in model.blocks:
        for name in ("w1", "w2"):
            weight = getattr(block.experts, name)
            setattr(block.experts, name, nn.Parameter(distribute_tensor(weight.detach(), ep_mesh, [Shard(0)])))
        experts = set(block.experts.parameters())
        fully_shard(
            block,
            mesh=dp_mesh,
            shard_placement_fn=lambda p, experts=experts: (
                ShardPlacementResult(None, efsdp_info) if p in experts else None
            ),
        )
    return fully_shard(model, mesh=dp_mesh)


def _checkpoint_over_two_meshes(rank, ws, path):
    """fsdp2.checkpoint saves a call over two meshes (unflattened from one world mesh, as
    torchtitan's) and loads it back into a model built from another seed."""
    from fsdp2 import checkpoint

    def full(model):
        return {k: v.full_tensor() for k, v in model.state_dict().items()}

    source = _build_two_mesh_net(seed=1)
    expected = full(source)
    checkpoint.save(path, source)
    target = _build_two_mesh_net(seed=2)
    assert any(not torch.equal(v, expected[k]) for k, v in full(target).items())
    checkpoint.load(path, target)
    return [k for k, v in full(target).items() if not torch.equal(v, expected[k])]


@pytest.mark.skipif(not _PYTORCH_2_13, reason="PyTorch < 2.13 has no ShardPlacementResult")
def test_checkpoint_of_one_call_over_two_meshes(worlds, tmp_path):
    differing = worlds.run(4, _checkpoint_over_two_meshes, str(tmp_path / "ckpt"))[0]
    assert differing == [], f"loaded back differently: {differing}"


def _mesh_without_the_calls_ranks(rank, ws):
    from types import SimpleNamespace

    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.tensor import DTensor

    from fsdp2 import FSDPUsageError, fully_shard

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    half = DeviceMesh("cpu", [0, 1], mesh_dim_names=("efsdp",))  # ranks 2 and 3 are not in it
    # PyTorch's FSDPMeshInfo cannot even be built on a rank outside its mesh: the fields it reads.
    info = SimpleNamespace(mesh=half, shard_mesh_dim=0, replicate_mesh_dim=None)
    block = _MoEBlock()
    experts = set(block.experts.parameters())
    with pytest.raises(FSDPUsageError) as caught:
        fully_shard(
            block, mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(None, info) if p in experts else None
        )
    unchanged = not any(isinstance(p, DTensor) for p in block.parameters()) and not isinstance(
        block, torch_fsdp.FSDPModule
    )
    return str(caught.value), unchanged


@pytest.mark.skipif(not _PYTORCH_2_13, reason="PyTorch < 2.13 has no ShardPlacementResult")
def test_shard_placement_result_on_a_mesh_without_the_calls_ranks_is_explained(worlds):
    for message, unchanged in worlds.run(4, _mesh_without_the_calls_ranks):
        assert "parameter experts.w1 on mesh DeviceMesh((efsdp=2)" in message, message
        assert "do not contain the call's data-parallel ranks [0, 1, 2, 3]" in message, message
        assert "Give it a mesh sliced or unflattened from the mesh the data-parallel mesh comes from" in message
        assert unchanged


def _compiled_over_two_meshes(rank, ws, steps=2, microbatches=2):
    """The compiled whole step (aot_eager) over calls on two meshes against eager fsdp2, from the
    same weights: losses, gradients and parameters bitwise, with accumulation without sync."""
    import torch._dynamo

    torch._dynamo.reset()
    eager, traced = _build_two_mesh_net(seed=0), _build_two_mesh_net(seed=0)
    assert len(traced.blocks[0]._fsdp_state.groups) == 2
    compiled = torch.compile(traced, backend="aot_eager", fullgraph=True)
    runs = []
    for model, run in ((eager, eager), (traced, compiled)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses, grads = [], []
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(ws, microbatches, 4, 8, generator=g)[rank]
            for micro in range(microbatches):
                model.set_requires_gradient_sync(micro == microbatches - 1)
                loss = run(x[micro]).pow(2).mean()
                loss.backward()
                losses.append(loss.detach())
            grads.append([p.grad.full_tensor() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        runs.append((torch.stack(losses), grads, [p.detach().full_tensor() for p in model.parameters()]))
    torch._dynamo.reset()
    (l1, g1, p1), (l2, g2, p2) = runs
    assert torch.equal(l1, l2), (l1, l2)
    for step, (a, b) in enumerate(zip(g1, g2)):
        for (name, _), x, y in zip(eager.named_parameters(), a, b):
            assert torch.equal(x, y), f"step {step}: compiled gradient of {name} differs from eager"
    for (name, _), x, y in zip(eager.named_parameters(), p1, p2):
        assert torch.equal(x, y), name


@pytest.mark.slow  # dynamo traces of whole steps
@pytest.mark.skipif(not _PYTORCH_2_13, reason="PyTorch < 2.13 has no ShardPlacementResult")
def test_compiled_whole_step_over_a_call_on_two_meshes_equals_eager(worlds):
    """One fully_shard call over two meshes under the compiled whole step: each mesh's group
    gathers and reduces in the graph as eager's does (the root call keeps all its groups)."""
    worlds.run(4, _compiled_over_two_meshes)


class _RecordingComm:
    """A user's all-gather or reduce-scatter (PyTorch's ``AllGather`` / ``ReduceScatter``
    protocols) running c10d's, noting the ranks of each process group it is called with."""

    def __init__(self, kind):
        self.kind = kind
        self.groups: set[tuple[int, ...]] = set()

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        import torch.distributed as dist

        self.groups.add(tuple(dist.get_process_group_ranks(group)))
        if self.kind == "all_gather":
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _custom_comms_per_group(rank, ws):
    """On a call over two meshes, custom collectives and the all-reduce hook apply to each group,
    with that group's process group (PyTorch's FSDP2 refuses them there): the same training as
    without them, bitwise."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    plain, hooked = _build_two_mesh_net(seed=0), _build_two_mesh_net(seed=0)
    gather, scatter, reduced = _RecordingComm("all_gather"), _RecordingComm("reduce_scatter"), []
    for block in hooked.blocks:
        block.set_custom_all_gather(gather)
        block.set_custom_reduce_scatter(scatter)
        block.set_all_reduce_hook(lambda output: reduced.append(output.numel()))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, hooked)]
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(ws, 4, 8, generator=g)[rank]
        losses = []
        for model, opt in zip((plain, hooked), opts):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(*losses), (step, losses)
    assert_same_params(plain, hooked)
    theirs = _build_two_mesh_net(seed=0, fully_shard_fn=torch_fully_shard)
    refused = []
    for method, value in (
        ("set_custom_all_gather", gather),
        ("set_custom_reduce_scatter", scatter),
        ("set_all_reduce_hook", lambda output: None),
    ):
        with pytest.raises(ValueError, match="multiple param groups"):
            getattr(theirs.blocks[0], method)(value)
        refused.append(method)
    return sorted(gather.groups), sorted(scatter.groups), len(reduced), refused


@pytest.mark.skipif(not _PYTORCH_2_13, reason="PyTorch < 2.13 has no ShardPlacementResult")
def test_custom_collectives_and_all_reduce_hook_apply_to_each_group(worlds):
    gathered_over, scattered_over, hooked, refused = worlds.run(4, _custom_comms_per_group)[0]
    # Rank 0's groups: the dense mesh (all 4 ranks) and its efsdp mesh (ranks 0 and 2).
    assert gathered_over == scattered_over == [(0, 1, 2, 3), (0, 2)], (gathered_over, scattered_over)
    assert hooked == 2 * 2 * 2  # steps x blocks x groups
    assert len(refused) == 3


def _reshard_to_subgroup_on_unflattened_mesh(rank, ws):
    """reshard_after_forward=2 on a 4-rank data-parallel mesh unflattened from a flat world mesh
    (its root names no dim of it), and on one call over that mesh and an expert mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    dp_mesh = world._unflatten(0, (1, 4), ("pp", "dp_shard"))["dp_shard"]

    def shard(model, fully_shard):
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=2)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=2)

    theirs, ours = twins(lambda: Llama(CFG), shard)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=g)[rank : rank + 1]
        counts = []
        for model, opt in zip((theirs, ours), opts):
            with CollectiveCounter() as comm:
                model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
            counts.append(comm.counts)
            opt.step()
            opt.zero_grad()
        assert counts[0] == counts[1], (step, counts)
        assert_same_params(theirs, ours)


def test_reshard_after_forward_int_on_a_mesh_unflattened_from_a_world_mesh_like_pytorch(worlds):
    worlds.run(4, _reshard_to_subgroup_on_unflattened_mesh)
