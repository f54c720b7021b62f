"""reshard_after_forward=k: after forward each rank keeps 1/k of a group; backward gathers over k ranks."""

import pytest
import torch

from fsdp2.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=67, seq_len=16, dim=36, n_layers=2, n_heads=3)


def _forward_then_backward(rank, world_size, k):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from fsdp2 import fully_shard
    from fsdp2.runtime import collectives

    model = GPT(CFG)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=k)
    fully_shard(model, mesh=mesh)

    gather_group_sizes = []
    real_all_gather = collectives.all_gather

    def recording_all_gather(output, input, group, async_op):
        gather_group_sizes.append(dist.get_world_size(group))
        return real_all_gather(output, input, group, async_op)

    collectives.all_gather = recording_all_gather
    try:
        tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
        loss = model.loss(tokens, tokens)
        group = model.blocks[0]._fsdp_state.group
        after_forward = group.state
        kept = sum(t.numel() for t in group._subgroup_rows)
        gathered = world_size * group.gather.gathered_numel_per_rank
        params_are_shards = all(isinstance(p, DTensor) for p in model.blocks[0].parameters())
        forward_sizes = list(gather_group_sizes)
        loss.backward()
        backward_sizes = gather_group_sizes[len(forward_sizes) :]
    finally:
        collectives.all_gather = real_all_gather
    return {
        "after_forward": after_forward.name,
        "after_backward": group.state.name,
        "kept_fraction": kept / gathered,
        "params_are_shards": params_are_shards,
        "forward_sizes": forward_sizes,
        "backward_sizes": backward_sizes,
        "grads": all(p.grad is not None for p in model.parameters()),
    }


@pytest.mark.parametrize("k", [2])
def test_keeps_one_kth_and_gathers_over_k_ranks(worlds, k):
    result = worlds.run(4, _forward_then_backward, k)[0]
    assert result["after_forward"] == "PARTIALLY_SHARDED"
    assert result["kept_fraction"] == pytest.approx(1 / k)
    assert result["params_are_shards"]
    # Forward: root + 2 blocks gather over all 4 ranks; backward: the 2 blocks over k ranks.
    assert result["forward_sizes"] == [4, 4, 4]
    assert result["backward_sizes"] == [k, k]
    assert result["after_backward"] == "SHARDED"
    assert result["grads"]


def test_full_reshard_gathers_over_all_ranks_in_backward(worlds):
    result = worlds.run(4, _forward_then_backward, True)[0]
    assert result["after_forward"] == "SHARDED"
    assert result["backward_sizes"] == [4, 4]


def _subgroups_of_two_default_meshes(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2 import fully_shard

    model = GPT(CFG)
    for block in model.blocks:  # a mesh object per call, as fully_shard's default mesh makes
        fully_shard(block, mesh=init_device_mesh("cpu", (world_size,)), reshard_after_forward=2)
    subgroups = [block._fsdp_state.group.reshard_after_forward.subgroup for block in model.blocks]
    return [(s.group.group_name, s.across.group_name) for s in subgroups]


def test_fully_shard_calls_over_the_same_ranks_share_their_subgroups(worlds):
    """Creating process groups is collective and slow: equal meshes, even as distinct objects,
    reuse the subgroups the first call made."""
    first, second = worlds.run(4, _subgroups_of_two_default_meshes)[0]
    assert first == second and first[0] != first[1]
