"""``fleetserve launch``'s own logic: which policy it reports, and the example it prints."""

import json

import pytest

from fleetserve import launch


@pytest.mark.parametrize("argv,policy", [
    ([], "cache_aware"),
    (["--policy", "random"], "random"),
    (["--router-args", "--policy round_robin --cache-threshold 0.5"], "round_robin"),
    (["--policy", "random", "--router-args=--policy=power_of_two"], "power_of_two"),
    (["--router-args", "--cache-threshold 0.5"], "cache_aware"),
])
def test_reported_policy_is_the_one_the_router_runs(argv, policy):
    args = launch.build_parser().parse_args(argv)
    assert launch.effective_policy(args) == policy


def test_printed_example_is_greedy_json():
    body = json.loads(launch.EXAMPLE_BODY)
    assert body["temperature"] == 0 and body["max_tokens"] == 32
    assert body["messages"][0]["role"] == "user"
