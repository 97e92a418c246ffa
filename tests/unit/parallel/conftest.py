"""Shared gloo rank pools for the parallel unit tests (started once per session)."""

import pytest

from fleetserve.distributed.rank_pool import RankPool


@pytest.fixture(scope="session")
def pool2():
    with RankPool(world_size=2, timeout_s=20) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool4():
    with RankPool(world_size=4, timeout_s=20) as pool:
        yield pool
