"""``fleetserve launch`` with one real engine instance (SmolLM2): a chat request through
the router, then SIGTERM stops the launcher, router, engine and its scheduler processes.
The instance's lines come prefixed ``[worker0]``, without uvicorn's access log."""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from launch_helpers import LaunchProc, alive, chat, descendants, free_ports  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(290)
def test_launch_engine_serves_and_stops_clean():
    PORT, BASE = free_ports(1)
    lp = LaunchProc(["--workers", "1", "--port", str(PORT), "--worker-base-port", str(BASE),
                     "--startup-timeout", "240", "--shutdown-grace", "15", "--max-total-tokens", "4096"])
    every: set[int] = set()
    try:
        lp.wait_for(r"router ready", 250)
        pids = lp.pids()
        assert set(pids) == {"worker0", "router"}
        every = set(pids.values()) | {lp.proc.pid}
        for p in pids.values():
            every |= descendants(p)
        assert len(every) >= 4  # launcher, router, HTTP process, at least one scheduler process
        status, body = chat(f"http://127.0.0.1:{PORT}", "What is the capital of France?", max_tokens=6, timeout=120)
        assert status == 200
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 6
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert body["choices"][0]["message"]["content"]
    finally:
        code = lp.stop(timeout=60)
    assert code == 0, lp.lines[-20:]
    assert any(x.startswith("[worker0] ") and "serving SmolLM2" in x for x in lp.lines), lp.lines[-40:]
    assert not [x for x in lp.lines if "POST /v1/chat/completions" in x or "GET /health" in x]
    deadline = time.monotonic() + 15
    while any(alive(p) for p in every) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in every if alive(p)] == []
