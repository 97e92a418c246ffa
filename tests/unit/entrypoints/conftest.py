"""Fixtures of the entrypoint-level unit tests (the fake runner lives in helpers.fake_runner)."""

import pytest

from helpers.fake_runner import make_scheduler


@pytest.fixture
def make_sched():
    return make_scheduler
