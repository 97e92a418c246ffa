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


# ------------------------------------------------ every port of the launch, checked before any start

def _refused(monkeypatch, capsys, argv):
    """``launch.main(argv)``'s exit code and stderr; fails the test if it gets as far as starting a child."""
    def no_start(self):
        raise AssertionError("launch started its children despite a port collision")

    monkeypatch.setattr(launch.Launcher, "run", no_start)
    code = launch.main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("kv,dp,clash", [
    # worker1's endpoint (P + 1) is worker0's replay port
    ('{"publisher":"zmq","endpoint":"tcp://*:%d","replay_endpoint":"tcp://*:%d"}', 1, "worker0's replay_endpoint"),
    # with 2 DP ranks, worker0's rank 1 publishes on P + 1, its own rank 0's replay port
    ('{"publisher":"zmq","endpoint":"tcp://*:%d","replay_endpoint":"tcp://*:%d"}', 2, "worker0's endpoint (DP rank 1)"),
], ids=["another instance", "another DP rank"])
def test_a_replay_port_on_another_instances_endpoint_is_refused_before_any_start(monkeypatch, capsys, kv, dp, clash):
    from helpers.kv_events_sub import free_port_block

    base, p = free_port_block(2), free_port_block(8)
    cfg = kv % (p, p + 1)
    code, err = _refused(monkeypatch, capsys, ["--worker-kind", "sim", "--workers", "2", "--port", "0",
                                               "--worker-base-port", str(base), "--dp-size", str(dp),
                                               "--kv-events-config", cfg])
    assert code == 2
    line = err.strip()
    assert "\n" not in line and line.startswith("fleetserve launch: --kv-events-config: ")
    assert clash in line and f"port {p + 1}" in line


def test_a_kv_port_on_an_instance_http_port_is_refused(monkeypatch, capsys):
    from helpers.kv_events_sub import free_port_block

    base = free_port_block(2)
    cfg = '{"publisher":"zmq","endpoint":"tcp://*:%d"}' % (base + 1)  # worker0 publishes on worker1's HTTP port
    code, err = _refused(monkeypatch, capsys, ["--worker-kind", "sim", "--workers", "2", "--port", "0",
                                               "--worker-base-port", str(base), "--kv-events-config", cfg])
    assert code == 2
    assert err.strip() == (f"fleetserve launch: --kv-events-config: worker0's endpoint (DP rank 0) would listen on "
                           f"port {base + 1}, which is already worker1's HTTP port (--worker-base-port); every "
                           f"port of the launch must differ")


def test_port_plan_lists_every_bound_port_and_knows_hosts():
    from fleetserve.launch.port_plan import first_collision, kv_event_ports, plan

    argv = ["--dp-size", "2", "--kv-events-config",
            '{"publisher":"zmq","endpoint":"tcp://*:6000","replay_endpoint":"tcp://127.0.0.1:6100"}']
    got = [(p.owner, p.host, p.port) for p in kv_event_ports(argv, 2)]
    assert got == [("worker0's endpoint (DP rank 0)", "*", 6000), ("worker0's replay_endpoint (DP rank 0)", "127.0.0.1", 6100),
                   ("worker0's endpoint (DP rank 1)", "*", 6001), ("worker0's replay_endpoint (DP rank 1)", "127.0.0.1", 6101),
                   ("worker1's endpoint (DP rank 0)", "*", 6002), ("worker1's replay_endpoint (DP rank 0)", "127.0.0.1", 6102),
                   ("worker1's endpoint (DP rank 1)", "*", 6003), ("worker1's replay_endpoint (DP rank 1)", "127.0.0.1", 6103)]
    assert first_collision(plan("127.0.0.1", 30000, 31000, 2, argv)) is None
    # a PUB on a named host connects (to a collector): it takes no local port
    connect = ["--kv-events-config", '{"publisher":"zmq","endpoint":"tcp://10.0.0.1:31000"}']
    assert kv_event_ports(connect, 2) == []
    # the same port on two different named hosts does not collide; a wildcard meets every host
    replay = ["--kv-events-config", '{"publisher":"zmq","endpoint":"tcp://10.0.0.1:1","replay_endpoint":"tcp://10.0.0.2:31001"}']
    assert first_collision(plan("127.0.0.1", 30000, 31000, 2, replay)) is None
    assert "worker1's HTTP port" in first_collision(plan("0.0.0.0", 30000, 31000, 2, replay))


def test_a_kv_port_another_program_holds_is_refused_before_any_start(monkeypatch, capsys):
    import socket

    from helpers.kv_events_sub import free_port_block

    base = free_port_block(1)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        cfg = '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:9","replay_endpoint":"tcp://*:%d"}' % taken
        code, err = _refused(monkeypatch, capsys, ["--worker-kind", "sim", "--workers", "1", "--port", "0",
                                                   "--worker-base-port", str(base), "--kv-events-config", cfg])
    assert code == 2
    line = err.strip()
    assert "\n" not in line and line.startswith(
        f"fleetserve launch: --kv-events-config: worker0's replay_endpoint (DP rank 0) {taken}: cannot listen on ")


def test_default_config_for_kv_aware_skips_taken_and_busy_ports():
    """launch's own --kv-events-config for a kv_aware fleet: the first range from the start port whose
    every port (workers x DP size) is neither a launch HTTP port nor bound by another program."""
    import socket

    from fleetserve.launch.kv_ports import default_kv_events_config, given

    held = {5559}  # another program's port (a stand-in for the bind test, so the test needs no free range)
    cfg = json.loads(default_kv_events_config(["--dp-size", "2"], 2, set(), busy=held.__contains__))
    assert cfg == {"publisher": "zmq", "endpoint": "tcp://*:5560"}  # 5557..5560 hits 5559: the next try starts after it
    cfg = json.loads(default_kv_events_config([], 2, {5557}, busy=held.__contains__))
    assert cfg["endpoint"] == "tcp://*:5560"  # a launch HTTP port (5557) and the busy 5559 are both skipped
    assert default_kv_events_config([], 2, set(), busy=lambda q: True) is None
    assert default_kv_events_config([], 3, set(), start=65534, busy=lambda q: False) is None  # past 65535
    s = socket.socket()  # the default test binds for real: a port held here is skipped
    s.bind(("0.0.0.0", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        got = int(json.loads(default_kv_events_config([], 1, set(), start=port))["endpoint"].rsplit(":", 1)[1])
        assert got > port
    finally:
        s.close()
    assert given(["--kv-events-config", '{"publisher":"null"}']) and given(["--kv-events-config={}"])
    assert not given(["--dp-size", "2"])
