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


@pytest.mark.parametrize("argv,key", [
    ([], None),
    (["--api-key", "inst"], "inst"),  # instances' key: the router forwards the client's header to them
    (["--router-args", "--api-key rk"], "rk"),  # the router's own key is the one a client must send
    (["--api-key", "inst", "--router-args", "--api-key=rk --policy random"], "rk"),
])
def test_printed_example_carries_the_key_a_client_needs(argv, key):
    args, instance_args = launch.build_parser().parse_known_args(argv)
    assert launch.client_api_key(args, instance_args) == key
    line = launch.curl_example("http://127.0.0.1:8000", launch.client_api_key(args, instance_args))
    assert line.startswith("curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json'")
    assert (f"-H 'Authorization: Bearer {key}'" in line) is (key is not None)
    assert line.endswith(f"-d '{launch.EXAMPLE_BODY}'")


@pytest.mark.parametrize("argv,flags", [
    ([], ["--disable-uvicorn-access-log"]),
    (["--access-log"], []),
    (["--worker-kind", "sim"], []),
    (["--worker-kind", "sim", "--access-log"], ["--access-log"]),
])
def test_access_log_off_unless_asked(argv, flags):
    args = launch.build_parser().parse_args(argv)
    assert launch.access_log_flags(args) == flags
    instance = launch.Launcher(args, []).workers[0].cmd
    assert [f for f in instance if "access-log" in f] == flags


def test_serve_knows_the_access_log_flag():
    from fleetserve.entrypoints.serve import build_parser

    assert build_parser().parse_args(["--disable-uvicorn-access-log"]).disable_uvicorn_access_log is True
    assert build_parser().parse_args([]).disable_uvicorn_access_log is False


def test_prefixed_lines():
    from fleetserve.launch.output import prefixed

    assert prefixed("worker0", b"INFO: up\n") == "[worker0] INFO: up\n"
    assert prefixed("router", b"no newline") == "[router] no newline\n"
    assert prefixed("router", b"bad \xff byte\n") == "[router] bad \ufffd byte\n"


def test_picked_router_port_is_free_and_not_an_instance_port():
    from fleetserve.entrypoints.ports import port_busy_error

    port = launch.pick_router_port("127.0.0.1", range(31000, 31002))
    assert 1 <= port <= 65535 and port not in range(31000, 31002)
    assert port_busy_error("--port", "127.0.0.1", port) is None
