"""Children of ``fleetserve launch`` die with it, however it dies: SIGKILL (no clean-up in
launch runs; the kernel's parent-death signal ends them) and SIGHUP (a clean stop)."""

import os
import signal
import socket
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from launch_helpers import LaunchProc, alive, descendants  # noqa: E402


def _free_ports() -> tuple[int, int]:
    """A router port and a base port p with p and p + 1 free."""
    for _ in range(50):
        socks = []
        try:
            for port in (0, 0):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            base = socks[1].getsockname()[1]
            if base >= 65535:
                continue
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", base + 1))
            return socks[0].getsockname()[1], base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def _start() -> tuple[LaunchProc, set[int]]:
    port, base = _free_ports()
    lp = LaunchProc(["--worker-kind", "sim", "--workers", "2", "--port", str(port), "--worker-base-port", str(base)])
    lp.wait_for(rf"router ready: http://127\.0\.0\.1:{port}", 60)
    every = set(lp.pids().values())
    assert len(every) == 3
    for p in list(every):
        every |= descendants(p)
    return lp, every


def _left(pids: set[int], timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    return sorted(p for p in pids if alive(p))


@pytest.mark.timeout(120)
def test_sigkill_of_launch_takes_every_child_down():
    lp, every = _start()
    try:
        lp.proc.kill()
        lp.proc.wait(timeout=10)
        assert _left(every, timeout=10) == []
    finally:
        for p in every:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_sighup_of_launch_is_a_clean_stop():
    lp, every = _start()
    try:
        lp.proc.send_signal(signal.SIGHUP)
        assert lp.stop(timeout=30) == 0
        assert any("SIGHUP: stopping" in line for line in lp.lines)
        assert any("all processes stopped" in line for line in lp.lines)
        assert _left(every, timeout=10) == []
    finally:
        for p in every:
            if alive(p):
                os.kill(p, signal.SIGKILL)
