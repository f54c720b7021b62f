"""Regression guards on the host work of a training step, as exact counts (fsdp2.tools.host_work).

Counts of dispatched ops and Python calls do not depend on the CPU's kernels, its thread count
or the load, so they can bound host work in tests where times cannot. Each step runs on rank 0
of a simulated world (fsdp2.tools.noop_pg: collectives that do nothing).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp2.models import GPT, GPTConfig
from fsdp2.tools.host_work import FSDP_CODE, count_host_work
from fsdp2.tools.noop_pg import init_noop_process_group

# 16 rows split evenly over 8 ranks; over 1024 every parameter is padded to one row per rank.
CFG = GPTConfig(vocab_size=64, seq_len=8, dim=16, n_layers=2, n_heads=2)


def _gpt(cfg: GPTConfig = CFG):
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    return model, model.blocks, lambda: model.loss(tokens[:, :-1], tokens[:, 1:])


def _mlp(groups: int, linears_per_group: int, width: int):
    """``groups`` blocks of ``linears_per_group`` Linear layers (two parameters each)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(*[nn.Linear(width, width) for _ in range(linears_per_group)]) for _ in range(groups)]
    model = nn.Sequential(*blocks)
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(0))
    return model, blocks, lambda: model(x).square().mean()


def _step_work(world_size: int, build=_gpt, fully_shard=None, optimizer: bool = True):
    """Host work of one AdamW training step of ``build()``'s model, every block and the root
    fully_shard'ed, on rank 0 of ``world_size`` no-op ranks (``optimizer=False``: forward and
    backward only)."""
    from torch.distributed.device_mesh import init_device_mesh

    if fully_shard is None:
        from fsdp2 import fully_shard

    assert not dist.is_initialized(), "a process group leaked into this test process"
    init_noop_process_group(world_size)
    try:
        model, blocks, loss = build()
        mesh = init_device_mesh("cpu", (world_size,))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            loss().backward()
            if optimizer:
                opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # lazy init and the optimizer's state are one-off work
        return count_host_work(step)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def work_by_world():
    return {n: _step_work(n) for n in (8, 1024)}


def test_ops_per_step_are_flat_in_the_world_size(work_by_world):
    """Padding (every tensor one row per rank at 1024) adds no per-parameter copies or slices:
    the padded reduce-scatter copy-in is fused per bucket like the even one."""
    even, padded = work_by_world[8].ops, work_by_world[1024].ops
    assert padded <= 1.02 * even, f"ops per step: {padded} at 1024 ranks vs {even} at 8"


@pytest.fixture(scope="module")
def forward_backward_work_by_world():
    return {n: _step_work(n, optimizer=False) for n in (8, 1024)}


def test_padding_is_not_zeroed_for_the_reduce_scatter(forward_backward_work_by_world):
    """The reduce-scatter's padding lands only in padding of the reduced shards, which nothing
    reads without a user's hook: at 1024 ranks (every parameter padded to one row per rank)
    backward zeroes no more bytes than at 8 (no padding); zeroing the padding cost 33x the
    gradients' bytes."""
    even, padded = (
        sum(forward_backward_work_by_world[n].bytes_by_op.get(op, 0) for op in ("fill_", "zero_", "_foreach_zero_"))
        for n in (8, 1024)
    )
    assert padded <= even, f"bytes zeroed per forward + backward: {padded} at 1024 ranks vs {even} at 8"


def test_padding_adds_no_bytes_copied(forward_backward_work_by_world):
    """Copy-out writes only the rank slots holding real rows into the unsharded parameters, so
    a forward + backward at 1024 ranks (every parameter padded to one row per rank) writes no
    more bytes than at 8 (no padding); writing every padded slot wrote 13x as many."""
    even, padded = (forward_backward_work_by_world[n].bytes_written for n in (8, 1024))
    assert padded <= even, f"bytes written per forward + backward: {padded} at 1024 ranks vs {even} at 8"


def test_fsdp2_python_calls_per_step_are_flat_in_the_world_size(work_by_world):
    even, padded = (work_by_world[n].calls_in(FSDP_CODE) for n in (8, 1024))
    assert padded <= 1.05 * even, f"fsdp2's Python calls per step: {padded} at 1024 ranks vs {even} at 8"


def test_fsdp2_python_calls_per_step_grow_with_groups_not_parameters():
    """4x the parameters in each of the same groups (more, smaller tensors) adds almost no Python
    calls in fsdp2: the per-parameter work of unshard, reshard and reduce is batched per group."""
    few, many = (_step_work(8, lambda m=m, w=w: _mlp(3, m, w)).calls_in(FSDP_CODE) for m, w in ((2, 32), (8, 16)))
    assert many <= 1.1 * few, f"fsdp2's Python calls per step: {many} with 4x the parameters per group vs {few}"


def test_fsdp2_python_calls_per_step_are_a_fraction_of_pytorch_fsdp2s():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ours = _step_work(8).calls_in(FSDP_CODE)
    theirs = _step_work(8, fully_shard=torch_fully_shard).calls_in(FSDP_CODE)
    assert ours <= 0.5 * theirs, f"Python calls per step in FSDP code: fsdp2 {ours}, PyTorch FSDP2 {theirs}"


def test_bytes_written_count_what_ops_write():
    """In-place and fresh outputs count their bytes; views and allocations write nothing."""
    a, b = torch.zeros(4, 8), torch.ones(4, 8)

    def step():
        a.copy_(b)  # 128 bytes, in place
        torch.add(a, b)  # 128 bytes, a fresh output
        a.view(32)
        torch.empty(100)
        torch._foreach_zero_([a[:2], b[:1]])  # 64 + 32 bytes, through views

    work = count_host_work(step)
    assert work.bytes_by_op == {"copy_": 128, "add": 128, "_foreach_zero_": 96}
    assert work.bytes_written == 352
