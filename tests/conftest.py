import pytest
from hypothesis import settings

from tests.harness import WorldPool

# `--hypothesis-profile long`: the differential tester's slow test runs this many programs.
settings.register_profile("long", max_examples=2000)


@pytest.fixture(scope="session")
def worlds():
    """``worlds.run(world_size, fn, *args)`` runs ``fn(rank, world_size, *args)`` on every rank."""
    pool = WorldPool()
    yield pool
    pool.close()


@pytest.fixture
def fake_world():
    """``fake_world(n)``: this process becomes rank 0 of a fake process group of n ranks
    (collectives do nothing), torn down after the test."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group leaked into this test process"

    def init(world_size: int):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()
    # DTensor's sharding-propagation caches key on mesh equality, which ignores the root mesh:
    # without clearing them, the next fake world's TP parameters come back on this world's meshes.
    from torch.distributed.tensor import debug

    getattr(debug, "_clear_sharding_prop_cache", debug._clear_python_sharding_prop_cache)()
