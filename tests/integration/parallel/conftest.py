"""Gloo rank pools for the multi-rank engine tests (started once per session)."""

import pytest

from fleetserve.distributed.rank_pool import RankPool


@pytest.fixture(scope="session")
def engine_pool2():
    with RankPool(world_size=2, timeout_s=30) as pool:
        yield pool


@pytest.fixture(scope="session")
def engine_pool4():
    with RankPool(world_size=4, timeout_s=30) as pool:
        yield pool
