"""fsdp2.tools.noop_pg: collectives that communicate nothing, counted; an fsdp2 training step on 64 simulated ranks."""

import pytest
import torch
import torch.distributed as dist

from fsdp2.tools.noop_pg import NoopProcessGroup, init_noop_process_group, noop_calls


@pytest.fixture
def noop_world():
    """``noop_world(n)``: this process becomes rank 0 of n no-op ranks, torn down after the test."""
    assert not dist.is_initialized(), "a process group leaked into this test process"
    yield init_noop_process_group
    if dist.is_initialized():
        dist.destroy_process_group()


def _sentinels(*shapes):
    return [torch.full(shape, float(i + 1)) for i, shape in enumerate(shapes)]


def test_collectives_leave_every_buffer_as_it_was_and_are_counted(noop_world):
    pg = noop_world(64)
    assert isinstance(pg, NoopProcessGroup) and pg.size() == 64 and pg.rank() == 0
    ag_out, ag_in, rs_out, rs_in, ar, bc, a2a_out, a2a_in = _sentinels(
        (64 * 3,), (3,), (3,), (64 * 3,), (5,), (5,), (64,), (64,)
    )
    in_place_out = torch.zeros(64 * 3)
    in_place_out[3:6] = 9.0  # slot 1 (another rank's) must keep what it held
    buffers = [ag_out, ag_in, rs_out, rs_in, ar, bc, a2a_out, a2a_in, in_place_out]
    before = [b.clone() for b in buffers]

    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    gather_single(ag_out, ag_in)
    gather_single(in_place_out, in_place_out[:3])  # fsdp2's in-place form: our input is our slot
    work = scatter_single(rs_out, rs_in, async_op=True)
    assert work.wait()
    dist.all_reduce(ar)
    dist.broadcast(bc, src=0)
    dist.all_to_all_single(a2a_out, a2a_in)
    dist.all_gather(list(ag_out.chunk(64)), ag_in)
    dist.barrier()

    for buffer, old in zip(buffers, before):
        assert torch.equal(buffer, old)
    assert pg.calls == {
        "all_gather": 3,
        "reduce_scatter": 1,
        "all_reduce": 1,
        "broadcast": 1,
        "all_to_all": 1,
        "barrier": 1,
    }


def test_dtensor_and_sub_groups_reach_the_noop_groups(noop_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    noop_world(16)
    mesh = init_device_mesh("cpu", (4, 4), mesh_dim_names=("replicate", "shard"))
    assert all(isinstance(mesh.get_group(d), NoopProcessGroup) for d in ("replicate", "shard"))
    before = noop_calls()
    full = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0), Shard(0)]).full_tensor()  # functional all-gathers
    assert full.shape == (32, 3)
    DTensor.from_local(torch.ones(4, 3), mesh["shard"], [Partial()]).redistribute(mesh["shard"], [Shard(0)])
    counted = noop_calls() - before
    assert counted == {"all_gather": 2, "reduce_scatter": 1}


def _train_step(model, opt, tokens):
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _sharded_gpt(world_size: int):
    """A 2-block GPT, each block and the root fully_shard'ed over the whole (simulated) world."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2 import fully_shard
    from fsdp2.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=67, seq_len=16, dim=32, n_layers=2, n_heads=2)
    mesh = init_device_mesh("cpu", (world_size,))
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, cfg


def test_fsdp2_training_step_at_world_64_issues_exactly_its_collectives(noop_world):
    from fsdp2.tools.comm_stats import count_comm

    pg = noop_world(64)
    model, cfg = _sharded_gpt(64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
    _train_step(model, opt, tokens)
    for _ in range(2):
        before = pg.calls.copy()
        with count_comm() as issued:
            _train_step(model, opt, tokens)
        # Blocks are gathered for forward and again for backward, the root once; one
        # reduce-scatter per group; nothing else (no barrier, no all-reduce without HSDP).
        assert issued.calls["all_gather"] == 2 * cfg.n_layers + 1
        assert pg.calls - before == {"all_gather": 2 * cfg.n_layers + 1, "reduce_scatter": cfg.n_layers + 1}
    assert all(p.to_local().shape[0] <= 2 for p in model.parameters())  # 1/64 of every dim-0


def test_compiled_fsdp2_step_reaches_the_noop_groups(noop_world):
    """torch.compile(fullgraph=True) over fully_shard (the traced path): its graph's collectives
    reach the no-op group's Python methods too. The ``*_out`` collectives the traced path uses on
    C++ process groups would go to the fake backend underneath (which refuses), so it keeps the
    functional ones for a process group implemented in Python."""
    import torch._dynamo

    pg = noop_world(4)
    model, cfg = _sharded_gpt(4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
    try:
        before = pg.calls.copy()
        logits = compiled(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    finally:
        torch._dynamo.reset()
    assert pg.calls - before == {"all_gather": 2 * cfg.n_layers + 1, "reduce_scatter": cfg.n_layers + 1}
    assert all(p.grad is not None for p in model.parameters())
