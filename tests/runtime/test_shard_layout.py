"""Property tests of the shard layout: sharding then gathering (or reducing) gives the tensor back.

The in-process tests simulate every rank's copies with no communication; the multi-process
ones run the real collectives through fully_shard and DTensor on the shared gloo worlds.
"""

import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp2.layout.shard_layout import ShardLayout

shapes = st.lists(st.integers(0, 9), min_size=1, max_size=4)


@st.composite
def shape_dim_world(draw):
    shape = draw(shapes)
    dim = draw(st.integers(0, len(shape) - 1))
    world = draw(st.integers(1, 9))
    return torch.Size(shape), dim, world


@settings(max_examples=300, deadline=None)
@given(shape_dim_world())
def test_local_shards_match_torch_chunk(case):
    """Our shards are DTensor's Shard(dim) shards: torch.chunk pieces, then empty ranks."""
    shape, dim, world = case
    full = torch.arange(shape.numel(), dtype=torch.float32).view(shape)
    chunks = torch.chunk(full, world, dim) if shape[dim] else ()
    for rank in range(world):
        layout = ShardLayout(shape, dim, world, rank)
        expected = chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)
        assert torch.equal(layout.local_slice(full), expected)
        assert layout.local_shape == expected.shape


@settings(max_examples=300, deadline=None)
@given(shape_dim_world())
def test_gather_then_reduce_round_trip(case):
    shape, dim, world = case
    full = torch.randn(shape)
    layouts = [ShardLayout(shape, dim, world, r) for r in range(world)]
    n = layouts[0].padded_shard_numel

    # All-gather: every rank writes its padded slot; the gathered rows rebuild the full tensor.
    gathered = torch.full((world, n), float("nan"))
    for layout in layouts:
        layout.shard_rows(gathered[layout.rank]).copy_(layout.local_slice(full))
    rebuilt = layouts[0].copy_full_out(gathered, torch.empty(world * n))
    assert torch.equal(rebuilt, full)
    # The compiled step decodes from the parameter's columns of wider rows: the same tensor,
    # contiguous as the copy (kernels pick their path by strides).
    rows = torch.zeros(world, n + 3)
    rows[:, 1 : n + 1] = gathered
    decoded = layouts[0].full_from_rank_rows(rows[:, 1 : n + 1])
    assert torch.equal(decoded, full) and decoded.is_contiguous()

    # Reduce-scatter: each rank's slot holds exactly its rows of the (summed) full tensor.
    slots = torch.full((world, n), float("nan"))
    layouts[0].copy_full_in(full, slots)
    assert not slots.isnan().any(), "padding must be zeroed, it is summed across ranks"
    for layout in layouts:
        assert torch.equal(layout.shard_rows(slots[layout.rank]), layout.local_slice(full))


def _round_trip_on_world(rank, world_size, shape, dim):
    """fully_shard a module holding one parameter of ``shape``; gather it back two ways."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from fsdp2 import fully_shard

    torch.manual_seed(1)
    holder = nn.Module()
    holder.weight = nn.Parameter(torch.randn(shape))
    original = holder.weight.detach().clone()
    fully_shard(holder, mesh=init_device_mesh("cpu", (world_size,)), shard_placement_fn=lambda p: Shard(dim))
    sharded = holder.weight
    layout = ShardLayout(torch.Size(shape), dim, world_size, rank)
    assert sharded.to_local().shape == layout.local_shape
    # DTensor's own gather agrees with our metadata (placements, global shape, uneven tails).
    assert torch.equal(sharded.full_tensor(), original)
    holder.unshard()
    assert torch.equal(holder.weight, original)
    holder.reshard()
    assert holder.weight is sharded
    return True


@settings(max_examples=12, deadline=None)
@given(world_size=st.sampled_from([2, 3, 4]), shape=st.lists(st.integers(1, 7), min_size=1, max_size=3), data=st.data())
def test_fully_shard_round_trip_on_real_ranks(worlds, world_size, shape, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    assert all(worlds.run(world_size, _round_trip_on_world, shape, dim))


@settings(max_examples=300, deadline=None)
@given(shape_dim_world(), st.booleans())
def test_copy_in_views_fill_slots_as_copy_full_in(case, strided):
    """The reduce-scatter copy-in through views built once (reused while the buffer's storage is
    freed and regrown) writes exactly what copy_full_in writes: rows in rank slots, zero padding."""
    shape, _, world = case
    layout = ShardLayout(shape, 0, world, 0)
    n = layout.padded_shard_numel
    # The parameter's block of a wider bucket buffer (strided rows), or a buffer of its own.
    buffer = torch.full((world, n + 3 if strided else n), float("nan"))
    slots = buffer[:, 1 : 1 + n] if strided else buffer
    views = layout.copy_in_views(slots)
    buffer.untyped_storage().resize_(0)
    buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
    buffer.fill_(float("nan"))
    for _ in range(2):  # reused: the second fill sees the first's values, not fresh NaNs
        full = torch.randn(shape)
        for zero in views.padding:
            zero.zero_()
        for destination, source in zip(views.destinations, views.sources(full), strict=True):
            destination.copy_(source)
        expected = torch.full((world, n), float("nan"))
        layout.copy_full_in(full, expected)
        assert torch.equal(slots, expected)


@settings(max_examples=300, deadline=None)
@given(shape_dim_world())
def test_ranks_with_rows_are_exactly_the_ranks_holding_real_rows(case):
    """Copy-out on CPU copies only the first ``ranks_with_rows`` rank slots: every rank before
    them holds real rows, none after them does."""
    shape, dim, world = case
    layout = ShardLayout(shape, dim, world, 0)
    holding = [rank for rank in range(world) if layout.rows_of(rank)]
    assert holding == list(range(layout.ranks_with_rows))
