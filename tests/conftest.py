import pytest

from tests.harness import WorldPool


@pytest.fixture(scope="session")
def worlds():
    """``worlds.run(world_size, fn, *args)`` runs ``fn(rank, world_size, *args)`` on every rank."""
    pool = WorldPool()
    yield pool
    pool.close()
