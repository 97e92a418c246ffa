"""What ``fleetserve launch`` shows: every child's line on this terminal prefixed with its
name, no per-request access lines unless ``--access-log``, and ``--log-dir`` keeping each
child's own lines (unprefixed) in ``<dir>/<name>.log`` as well."""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from launch_helpers import LaunchProc, chat, free_ports  # noqa: E402

ACCESS = re.compile(r"POST /v1/chat/completions")


def _run(tmp_path, extra):
    port, base = free_ports(2)
    lp = LaunchProc(["--worker-kind", "sim", "--workers", "2", "--port", str(port), "--worker-base-port", str(base),
                     "--log-dir", str(tmp_path), "--shutdown-grace", "10", *extra])
    try:
        lp.wait_for(r"\[launch\] router ready", 60)
        for i in range(4):
            status, body = chat(f"http://127.0.0.1:{port}", f"hello {i} " + "word " * (20 * i), max_tokens=3)
            assert status == 200 and body["usage"]["completion_tokens"] == 3
    finally:
        code = lp.stop()
    assert code == 0, lp.lines[-20:]
    return lp, base


@pytest.mark.timeout(120)
def test_lines_prefixed_no_access_log_and_log_dir(tmp_path):
    lp, base = _run(tmp_path, [])
    for i in (0, 1):
        line = f"[worker{i}] sim-worker: 1 worker(s) on http://127.0.0.1:{base + i}"
        assert any(x.startswith(line) for x in lp.lines), lp.lines
    assert any(x.startswith("[router] ") and "fleetserve router on http://127.0.0.1:" in x for x in lp.lines)
    # every line is the launcher's own or a child's, named
    assert all(re.match(r"\[(launch|router|worker[01])\] ", x) for x in lp.lines), lp.lines
    assert not any(ACCESS.search(x) for x in lp.lines)

    w0 = (tmp_path / "worker0.log").read_text().splitlines()
    assert w0[0].startswith(f"sim-worker: 1 worker(s) on http://127.0.0.1:{base}")  # unprefixed
    assert [f"[worker0] {x}" for x in w0] == [x for x in lp.lines if x.startswith("[worker0] ")]
    router = (tmp_path / "router.log").read_text()
    assert "fleetserve router on http://127.0.0.1:" in router and "[router]" not in router


@pytest.mark.timeout(120)
def test_access_log_flag_turns_request_lines_on(tmp_path):
    lp, _ = _run(tmp_path, ["--access-log"])
    hits = [x for x in lp.lines if ACCESS.search(x)]
    # at least the 4 requests (a router retry on a loaded machine may add one)
    assert len(hits) >= 4, lp.lines
    assert [x for x in hits if not re.match(r"\[worker[01]\] ", x)] == [], lp.lines
    files = (tmp_path / "worker0.log").read_text() + (tmp_path / "worker1.log").read_text()
    assert len(ACCESS.findall(files)) == len(hits)
