"""``fleetserve launch``'s own logic: which policy it reports, and the example it prints."""

import json

import pytest

from fleetserve import launch
from fleetserve.launch import output as launch_output


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


@pytest.mark.parametrize("argv,router_keys", [
    ([], []),
    (["--api-key", "inst"], ["inst"]),  # keyed instances: the router gets their key for its own requests
    (["--api-key", "inst", "--router-args", "--api-key rk"], ["rk"]),  # the router's own key, alone
])
def test_router_gets_the_instances_key_unless_it_has_its_own(argv, router_keys):
    args, instance_args = launch.build_parser().parse_known_args(argv)
    router = launch.router_argv(args, instance_args)
    assert [router[i + 1] for i, tok in enumerate(router) if tok == "--api-key"] == router_keys


def test_admin_calls_send_the_key():
    import http.server
    import threading

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(200 if self.headers.get("Authorization") == "Bearer k1" else 401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/add_worker?url=x"
        assert launch._http(url, "POST", timeout=5, key="k1") == 200
        assert launch._http(url, "POST", timeout=5) == 401
        assert seen == ["Bearer k1", None]
    finally:
        srv.shutdown()
        srv.server_close()


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


# ------------------------------------------- --router-args: checked by the router's own parser first

def _main(monkeypatch, capsys, router_args: str):
    """``launch.main`` of 2 sim instances with ``--router-args router_args``: (exit code, stderr, started?)."""
    from helpers.kv_events_sub import free_port_block

    started = []
    monkeypatch.setattr(launch.Launcher, "run", lambda self: started.append(self) or 0)
    base = free_port_block(2)
    code = launch.main(["--worker-kind", "sim", "--workers", "2", "--port", "0", "--worker-base-port", str(base),
                        f"--router-args={router_args}"])
    return code, capsys.readouterr().err.strip(), bool(started), base


@pytest.mark.parametrize("router_args,line", [
    ("--cache-threshold 2", "--router-args: --cache-threshold must be in [0, 1]"),
    ("--cache-threshold x", "--router-args: argument --cache-threshold: invalid float value: 'x'"),
    ("--policy nope", "--router-args: argument --policy: invalid choice: 'nope' (choose from "),  # + the list
    ("--pd-disaggregation", "--router-args: --pd-disaggregation is not supported by fleetserve router"),
    ("--queue-size 5", "--router-args: --queue-size needs --max-concurrent-requests N (N >= 1): without a limit "
                       "nothing is queued or rate limited"),
    ("--no-such-flag 1", "--router-args: unrecognized arguments: --no-such-flag 1"),
    ("--api-key 'unclosed", "--router-args: No closing quotation: \"--api-key 'unclosed\""),
])
def test_a_bad_router_flag_is_refused_before_any_instance_starts(monkeypatch, capsys, router_args, line):
    code, err, started, _ = _main(monkeypatch, capsys, router_args)
    assert (code, started) == (2, False)
    assert "\n" not in err
    assert err == f"fleetserve launch: {line}" or line.endswith("(choose from ") and err.startswith(
        f"fleetserve launch: {line}")  # argparse quotes the choices or not, by Python version


def test_good_router_flags_pass_and_a_prometheus_port_joins_the_port_check(monkeypatch, capsys):
    code, err, started, _ = _main(monkeypatch, capsys, "--cache-threshold 0.5 --max-concurrent-requests 4")
    assert (code, err, started) == (0, "", True)
    code, err, started, base = _main(monkeypatch, capsys, "--prometheus-port 0")  # 0: any free port, no clash
    assert (code, started) == (0, True)
    from helpers.kv_events_sub import free_port_block

    base = free_port_block(2)
    monkeypatch.setattr(launch.Launcher, "run", lambda self: 0)
    code = launch.main(["--worker-kind", "sim", "--workers", "2", "--port", "0", "--worker-base-port", str(base),
                        f"--router-args=--prometheus-port {base + 1}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"fleetserve launch: --worker-base-port: worker1's HTTP port would listen on port {base + 1}, which is "
        f"already the router's metrics port (--router-args --prometheus-port); every port of the launch must differ")


def test_router_flags_the_policy_does_not_read_are_said_before_anything_starts(monkeypatch, capsys):
    from helpers.kv_events_sub import free_port_block

    started = []
    monkeypatch.setattr(launch.Launcher, "run", lambda self: started.append(self) or 0)
    code = launch.main(["--worker-kind", "sim", "--workers", "1", "--port", "0", "--worker-base-port",
                        str(free_port_block(1)), "--policy", "round_robin", "--router-args=--kv-load-weight 0.5"])
    assert (code, len(started)) == (0, 1)
    assert ("[launch] warning: --router-args: --kv-load-weight has no effect under --policy round_robin (read only "
            "under kv_aware)\n") in capsys.readouterr().out


# ------------------------------------------- --host / --port inside --router-args: launch follows them

def _launch(monkeypatch, capsys, argv, base=None):
    """``launch.main(argv)`` with 2 sim instances on ``base`` (default: a free block), nothing started:
    (code, out, err, launcher or None, base)."""
    from helpers.kv_events_sub import free_port_block

    started = []
    monkeypatch.setattr(launch.Launcher, "run", lambda self: started.append(self) or 0)
    base = base or free_port_block(2)
    code = launch.main(["--worker-kind", "sim", "--workers", "2", "--worker-base-port", str(base), *argv])
    out, err = capsys.readouterr()
    return code, out, err.strip(), (started[0] if started else None), base


def _last(cmd, flag):
    return cmd[len(cmd) - 1 - cmd[::-1].index(flag) + 1]


def test_a_router_port_in_router_args_is_where_launch_waits_and_points(monkeypatch, capsys):
    from helpers.kv_events_sub import free_port_block

    port = free_port_block(1)
    code, _, err, lau, base = _launch(monkeypatch, capsys, [f"--router-args=--port {port} --cache-threshold 0.5"])
    assert (code, err) == (0, "")
    assert lau.router_url == f"http://127.0.0.1:{port}"  # the readiness wait, admin calls and printed URL
    assert _last(lau.router.cmd, "--port") == str(port) and _last(lau.router.cmd, "--host") == "127.0.0.1"
    # a --port 0 there is picked here like launch's own, and the router gets the picked port, not 0
    code, out, err, lau, base = _launch(monkeypatch, capsys, ["--router-args", "--host 0.0.0.0 --port 0"])
    assert (code, err) == (0, "")
    picked = int(out.split("[launch] --router-args --port 0: the router will listen on port ")[1].split()[0])
    assert picked not in (0, base, base + 1)
    assert lau.router_url == f"http://0.0.0.0:{picked}"
    assert _last(lau.router.cmd, "--port") == str(picked) and _last(lau.router.cmd, "--host") == "0.0.0.0"
    assert _last(lau.workers[0].cmd, "--host") == "127.0.0.1"  # the instances stay on launch's --host


@pytest.mark.parametrize("router_args", ["", "--port 0", "--host 0.0.0.0 --port=0 --cache-threshold 0.5",
                                         "--port=0 --host=0.0.0.0"])
def test_the_router_argv_names_its_host_and_port_once(monkeypatch, capsys, router_args):
    code, _, err, lau, _ = _launch(monkeypatch, capsys, ["--port", "0", f"--router-args={router_args}"])
    assert (code, err) == (0, "")
    flags = [t.split("=", 1)[0] for t in lau.router.cmd if t.startswith("--")]
    assert flags.count("--host") == 1 and flags.count("--port") == 1
    port = lau.router.cmd[lau.router.cmd.index("--port") + 1]
    assert port != "0" and lau.router_url.endswith(f":{port}")  # the picked port, not the 0 asked for
    assert ("--cache-threshold" in lau.router.cmd) is ("--cache-threshold" in router_args)


def test_a_router_args_port_meets_the_port_checks_under_its_own_name(monkeypatch, capsys):
    import socket

    from helpers.kv_events_sub import free_port_block

    base = free_port_block(2)
    code, _, err, lau, _ = _launch(monkeypatch, capsys, [f"--router-args=--port {base + 1}"], base)
    assert (code, lau) == (2, None)
    assert err.startswith(f"fleetserve launch: --router-args --port {base + 1} is also an instance's port")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        held = s.getsockname()[1]
        code, _, err, lau, _ = _launch(monkeypatch, capsys, [f"--router-args=--port {held}"])
    assert (code, lau) == (2, None)
    assert err.startswith(f"fleetserve launch: --router-args --port {held}: cannot listen on 127.0.0.1:{held}: ")


@pytest.mark.parametrize("argv,line", [
    (["--port", "30001", "--router-args=--port 30002"],
     "--port 30001 and --router-args --port 30002 differ: give the router's port once (either flag alone sets it)"),
    (["--host", "127.0.0.1", "--router-args=--host 0.0.0.0"],
     "--host 127.0.0.1 and --router-args --host 0.0.0.0 differ: give the router's address once (launch's --host "
     "alone sets the instances' and the router's)"),
])
def test_launch_and_router_args_giving_the_router_two_addresses_is_refused(monkeypatch, capsys, argv, line):
    code, _, err, lau, _ = _launch(monkeypatch, capsys, argv)
    assert (code, err, lau) == (2, f"fleetserve launch: {line}", None)


def test_every_launch_flag_has_a_help_text():
    from fleetserve.launch import build_parser

    bare = [a.option_strings[0] for a in build_parser()._actions if a.option_strings and not a.help]
    assert bare == []


@pytest.mark.parametrize("host,line", [
    ("bad host", "--host 'bad host': 'bad host' is not a host name or IP address"),
    ("", "--host '': no host"),
    ("::1", "--host '::1': launch takes a host name or an IPv4 address, not an IPv6 address"),
])
def test_a_bad_host_is_launchs_own_flag_not_the_routers(monkeypatch, capsys, host, line):
    """The instances' and the router's URLs are made from --host, so a bad one is named as --host
    (it used to reach the router's flag check first and be blamed on --router-args)."""
    code, _, err, lau, _ = _launch(monkeypatch, capsys, ["--host", host])
    assert (code, err, lau) == (2, f"fleetserve launch: {line}", None)


@pytest.mark.parametrize("flags,line", [
    (["--dp-size", "0"], "--dp-size must be >= 1, got 0"),
    (["--dp-size", "two"], "--dp-size: invalid int value: 'two' (a sim-worker flag)"),
    (["--tokenizer", "bpe"], "--tokenizer: invalid choice: 'bpe' "),
    (["--max-total-tokens", "0"], "--max-total-tokens must be > 0, got 0"),
    (["--page-size", "3"], "--page-size (3) must divide --chunked-prefill-size "),
    (["--max-total-tokns", "9"], "unrecognized sim-worker flags: --max-total-tokns 9 (router flags go in --router-args \"...\")"),
])
def test_sim_instance_flags_are_checked_before_any_instance_starts(monkeypatch, capsys, flags, line):
    """--worker-kind sim used to start every instance with a bad flag and let each one die; now
    the sim-worker's own parser and checks refuse it first, in one line (in the launcher's process:
    they import no torch)."""
    code, _, err, lau, _ = _launch(monkeypatch, capsys, flags)
    assert (code, lau) == (2, None)
    assert "\n" not in err and err.startswith(f"fleetserve launch: {line}"), err
    assert err.count("fleetserve") == 1 and "error:" not in err  # one prefix, launch's
    code, _, err, lau, _ = _launch(monkeypatch, capsys, ["--stream-interval", "4", "--dp-size", "2"])
    assert (code, err) == (0, "") and lau is not None


def test_a_long_start_up_says_who_it_still_waits_for(monkeypatch, capsys):
    """No long silence while instances load: a line on stderr every PROGRESS_EVERY_S names the
    instances that do not answer /health yet."""
    import sys
    import time

    from helpers.kv_events_sub import free_port_block

    base = free_port_block(1)
    args = launch.build_parser().parse_args(["--worker-kind", "sim", "--workers", "1", "--worker-base-port", str(base),
                                      "--startup-timeout", "1"])
    lau = launch.Launcher(args, [])
    w = lau.workers[0]
    w.cmd = [sys.executable, "-c", "import time; time.sleep(5)"]  # alive, never healthy
    monkeypatch.setattr(launch, "PROGRESS_EVERY_S", 0.3)
    w.start()
    try:
        assert lau._wait_healthy([w], time.monotonic() + 1.0) is False
    finally:
        w.signal_group(9)
        w.proc.wait(5)
    assert launch_output.drain(5)  # the launcher's lines reach the terminal through its writer thread
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if line.startswith("[launch] still waiting for worker0 to answer /health (")]
    assert len(notes) >= 2 and notes[0].endswith(" s; --startup-timeout 1)"), err
    assert "not healthy within 1.0 s: worker0" in out


@pytest.mark.parametrize("argv,grace", [
    ([], "15"),
    (["--shutdown-grace", "40"], "40"),
    (["--shutdown-grace", "40", "--router-args", "--shutdown-grace-period-secs 7"], "7"),  # the router's own wins
])
def test_the_router_waits_for_its_requests_within_launchs_grace(argv, grace):
    """launch stops the router first and gives it --shutdown-grace for its requests in flight (its own default,
    180 s, would outlast launch's SIGKILL); a --router-args value comes later and wins (argparse: last one)."""
    from fleetserve.router.config import build_parser as router_parser

    args, instance_args = launch.build_parser().parse_known_args(argv)
    router = launch.router_argv(args, instance_args)
    assert [router[i + 1] for i, tok in enumerate(router) if tok == "--shutdown-grace-period-secs"][-1] == grace
    assert router_parser().parse_args(router).shutdown_grace_period_secs == float(grace)


@pytest.mark.parametrize("argv,line", [
    (["--router-args", "--worker-urls http://127.0.0.1:1"],
     "--router-args --worker-urls: launch registers its own instances with the router; add other workers once "
     "it runs (POST /add_worker?url=...), or start `fleetserve router` by itself"),
    (["--policy", "kv_aware", "--router-args", "--policy round_robin"],
     "--policy kv_aware and --router-args --policy round_robin differ: give the policy once"),
    (["--startup-timeout", "-5"], "--startup-timeout must be > 0 seconds, got -5"),
    (["--shutdown-grace", "-1"], "--shutdown-grace must be >= 0 seconds, got -1"),
    (["--log-dir", "/proc/nonexistent/x"], "--log-dir /proc/nonexistent/x: cannot create it: No such file or directory"),
])
def test_launch_values_a_user_trial_got_through_are_refused_in_one_line(monkeypatch, capsys, argv, line):
    """Each was accepted before: the router's own --worker-urls replaced launch's instances and it waited for
    workers launch knew nothing of; the two policies ran the router-args one silently; a negative timeout
    started everything and then gave up; an unwritable --log-dir ended in a traceback."""
    code, _, err, lau, _ = _launch(monkeypatch, capsys, argv)
    assert (code, err, lau) == (2, f"fleetserve launch: {line}", None)


def test_the_same_policy_given_both_ways_is_fine(monkeypatch, capsys):
    code, _, _, lau, _ = _launch(monkeypatch, capsys, ["--policy", "round_robin", "--router-args",
                                                       "--policy round_robin"])
    assert code == 0 and lau is not None


def test_a_signal_during_the_last_health_check_starts_no_router(monkeypatch, capsys):
    """Helper trial: SIGINT as the instances turned healthy still started the router, because the
    health wait ended with True in the same pass as the signal."""
    args = launch.build_parser().parse_args(["--worker-kind", "sim", "--workers", "1"])
    lau = launch.Launcher(args, [])
    started, stopped = [], []
    monkeypatch.setattr(launch.Child, "start", lambda self: started.append(self.name))
    monkeypatch.setattr(lau, "shutdown", lambda: stopped.append(True))

    def healthy_then_signal(children, deadline):
        lau._on_signal(2, None)  # SIGINT arrives during the check that finds the last one healthy
        return True

    monkeypatch.setattr(lau, "_wait_healthy", healthy_then_signal)
    assert lau.run() == 0
    assert started == ["worker0"] and stopped == [True]  # no router
    assert launch_output.drain(5)
    assert capsys.readouterr().out == "[launch] SIGINT: stopping\n"


def test_ctrl_c_during_the_checks_is_one_line(monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "check_router_args", interrupted)
    assert launch.main(["--worker-kind", "sim", "--workers", "1"]) == 130
    out, err = capsys.readouterr()
    assert err == "[launch] interrupted before any instance started\n" and "Traceback" not in out
