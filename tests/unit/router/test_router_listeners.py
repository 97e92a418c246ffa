"""Where the router listens: loopback by default (as sglang-router), each listener on its own host flag."""

import asyncio
import gc
import logging

import pytest

from fleetserve.router import cli as router_cli
from fleetserve.router.config import parse_args


async def bound_addresses(argv, monkeypatch, caplog):
    """Run ``serve`` on ``argv`` until ready; the (host, port) each listener is bound to, in start order."""
    started = []
    real = router_cli.start_server

    async def recording(routes, host, port, *a, **kw):
        srv = await real(routes, host, port, *a, **kw)
        started.append(srv.sockets[0].getsockname()[:2])
        return srv

    monkeypatch.setattr(router_cli, "start_server", recording)
    ready, stop = asyncio.Event(), asyncio.Event()
    with caplog.at_level(logging.INFO, logger="fleetserve.router"):
        task = asyncio.ensure_future(router_cli.serve(parse_args(argv), ready, stop))
        await asyncio.wait_for(ready.wait(), 10)
        stop.set()
        assert await asyncio.wait_for(task, 10) == 0
    gc.unfreeze()
    return started


def test_default_hosts_are_loopback():
    cfg = parse_args([])
    assert (cfg.host, cfg.prometheus_host, cfg.prometheus_port) == ("127.0.0.1", "127.0.0.1", None)
    assert parse_args(["--host", "0.0.0.0", "--prometheus-host", "::1"]).prometheus_host == "::1"


@pytest.mark.timeout(30)
async def test_both_listeners_bind_loopback_by_default_and_log_the_real_ports(monkeypatch, caplog):
    got = await bound_addresses(["--port", "0", "--prometheus-port", "0"], monkeypatch, caplog)
    assert [h for h, _ in got] == ["127.0.0.1", "127.0.0.1"]
    assert all(p > 0 for _, p in got)
    text = caplog.text
    assert f"fleetserve router on http://127.0.0.1:{got[0][1]}," in text
    assert f"metrics also on http://127.0.0.1:{got[1][1]}/metrics" in text


@pytest.mark.timeout(30)
async def test_metrics_listener_follows_prometheus_host_not_host(monkeypatch, caplog):
    got = await bound_addresses(["--host", "0.0.0.0", "--port", "0", "--prometheus-port", "0"], monkeypatch, caplog)
    assert [h for h, _ in got] == ["0.0.0.0", "127.0.0.1"]


def test_prometheus_port_out_of_range_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--prometheus-port", "70000"])
    assert e.value.code == 2
    assert "--prometheus-port must be in 0..65535, got 70000" in capsys.readouterr().err


@pytest.mark.timeout(30)
async def test_disable_health_check_logs_no_startup_wait(monkeypatch, caplog):
    await bound_addresses(["--port", "0", "--disable-health-check", "--worker-urls", "http://127.0.0.1:9"],
                          monkeypatch, caplog)
    assert "waiting up to" not in caplog.text
    assert "health checks off: adding 1 worker(s) without waiting: http://127.0.0.1:9" in caplog.text


@pytest.mark.timeout(30)
async def test_duplicate_worker_urls_are_said_once(monkeypatch, caplog):
    await bound_addresses(["--port", "0", "--disable-health-check", "--worker-urls", "http://127.0.0.1:9",
                           "127.0.0.1:9/"], monkeypatch, caplog)
    assert "--worker-urls names http://127.0.0.1:9 more than once: it is one worker" in caplog.text
    assert "0 workers" not in caplog.text and ", 1 workers" in caplog.text


@pytest.mark.timeout(30)
async def test_a_busy_port_exits_2_like_every_other_start_up_error(caplog):
    """fleetserve router, serve, launch and sim-worker all answer a busy port with exit code 2
    (it was 1 here and in serve, 2 in launch)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="fleetserve.router"):
            code = await asyncio.wait_for(router_cli.serve(parse_args(["--port", str(port)])), 10)
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port} (--host/--port): address already in use" in caplog.text
