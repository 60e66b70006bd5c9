import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from dist_pool import DistPool  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def pools():
    """pools(W) -> a DistPool of W gloo ranks, shared by the whole session."""
    made: dict[int, DistPool] = {}

    def get(world_size: int) -> DistPool:
        if world_size not in made:
            made[world_size] = DistPool(world_size)
        return made[world_size]

    yield get
    for pool in made.values():
        pool.close()


@pytest.fixture
def clean_env(monkeypatch):
    """An environment with no launcher variables, for World parsing tests."""
    for key in list(os.environ):
        if key in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "GROUP_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ) or key.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL")):
            monkeypatch.delenv(key, raising=False)
    return monkeypatch
