"""``fleetserve launch`` gives each instance its own KV-event ports (launch/kv_ports.py)."""

import json

import pytest

from fleetserve import launch
from fleetserve.launch.kv_ports import check_kv_event_ports, dp_size, instance_kv_events_args

CFG = '{"publisher":"zmq","endpoint":"tcp://*:6000","replay_endpoint":"tcp://*:6100","topic":"kv"}'


def _cfg(argv):
    for i, tok in enumerate(argv):
        if tok == "--kv-events-config":
            return json.loads(argv[i + 1])
        if tok.startswith("--kv-events-config="):
            return json.loads(tok.split("=", 1)[1])
    raise AssertionError(argv)


@pytest.mark.parametrize("extra,ranks", [([], 1), (["--dp-size", "2"], 2), (["--dp=3"], 3)])
def test_instance_i_is_moved_up_by_i_times_its_dp_size(extra, ranks):
    argv = ["--kv-events-config", CFG, *extra]
    assert dp_size(argv) == ranks
    for i in range(3):
        cfg = _cfg(instance_kv_events_args(argv, i))
        assert cfg["endpoint"] == f"tcp://*:{6000 + i * ranks}"
        assert cfg["replay_endpoint"] == f"tcp://*:{6100 + i * ranks}"
        assert cfg["topic"] == "kv" and cfg["publisher"] == "zmq"  # the rest unchanged


def test_every_port_of_a_fleet_is_distinct():
    argv = ["--kv-events-config", CFG, "--dp-size", "2"]
    ports = []
    for i in range(4):
        base = int(_cfg(instance_kv_events_args(argv, i))["endpoint"].rsplit(":", 1)[1])
        ports += [base + r for r in range(2)]  # the engine adds the DP rank
    assert ports == list(range(6000, 6008))


def test_joined_form_and_other_flags_are_kept():
    argv = ["--model-path", "m", f"--kv-events-config={CFG}", "--page-size", "4"]
    out = instance_kv_events_args(argv, 1)
    assert out[:2] == ["--model-path", "m"] and out[3:] == ["--page-size", "4"]
    assert out[2].startswith("--kv-events-config=") and _cfg(out)["endpoint"] == "tcp://*:6001"


def test_ipc_endpoints_get_an_instance_suffix():
    argv = ["--kv-events-config", '{"publisher":"zmq","endpoint":"ipc:///tmp/kv"}']
    assert _cfg(instance_kv_events_args(argv, 0))["endpoint"] == "ipc:///tmp/kv"
    assert _cfg(instance_kv_events_args(argv, 2))["endpoint"] == "ipc:///tmp/kv_w2"


@pytest.mark.parametrize("argv", [[], ["--kv-events-config", '{"publisher":"null","endpoint":"tcp://*:6000"}']])
def test_nothing_to_publish_leaves_the_arguments_alone(argv):
    assert instance_kv_events_args(argv, 3) == argv


def test_a_port_past_65535_is_refused_in_one_line_naming_the_flag():
    argv = ["--kv-events-config", '{"publisher":"zmq","endpoint":"tcp://*:65534"}', "--dp-size", "2"]
    assert check_kv_event_ports(argv, 1) is None  # 65534, 65535
    bad = check_kv_event_ports(argv, 2)
    assert bad.startswith("--kv-events-config") and "65537" in bad and "\n" not in bad
    assert check_kv_event_ports(["--kv-events-config", "{nope"], 2).startswith("--kv-events-config: not valid JSON")


@pytest.mark.parametrize("kind", ["engine", "sim"])
def test_launcher_commands_carry_each_instance_its_own_config(kind):
    args, rest = launch.build_parser().parse_known_args(
        ["--worker-kind", kind, "--workers", "2", "--kv-events-config", CFG])
    workers = launch.Launcher(args, rest).workers
    assert [_cfg(w.cmd)["endpoint"] for w in workers] == ["tcp://*:6000", "tcp://*:6001"]
