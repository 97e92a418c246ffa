"""A `fleetserve serve` whose rank process dies (SIGKILL, as the OOM killer sends) says so in one
log line, ends the stream in flight with an error event and exits non-zero; Ctrl-C stops it without a
traceback."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest


def _rank_children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    return [c for c in out if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tmp_path_factory):
    """``{test name: (process, stderr path)}``: each test's own fresh server, both started at once so
    that their start-ups overlap (the Ctrl-C one in its own session, as a terminal's job would be)."""
    flags = {"killed": (["--max-total-tokens", "4096"], False), "ctrl_c": (["--max-total-tokens", "512"], True)}
    out, files = {}, []
    try:
        for name, (extra, session) in flags.items():
            err_path = tmp_path_factory.mktemp(f"rank_death_{name}") / "stderr.txt"
            files.append(open(err_path, "w"))
            proc = subprocess.Popen([sys.executable, "-m", "fleetserve.cli", "serve", "--model-path", tiny_llama_dir,
                                     "--port", "0", *extra, "--log-level", "info"],
                                    env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                                    stderr=files[-1], start_new_session=session)
            out[name] = (proc, err_path)
        yield out
    finally:
        for f in files:
            f.close()
        for proc, _ in out.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.timeout(300)
def test_rank_killed_mid_stream(servers):
    proc, err_path = servers["killed"]
    try:
        end, port = time.monotonic() + 240, None  # both servers start together
        while port is None:
            assert proc.poll() is None, err_path.read_text()[-2000:]
            m = re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+) ", err_path.read_text())
            if m:
                port = int(m.group(1))
            assert time.monotonic() < end
            time.sleep(0.2)
        assert port > 0  # --port 0 is logged as the port the OS picked
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        ranks = _rank_children(proc.pid)
        assert len(ranks) == 1
        body = {"input_ids": [5, 6, 7], "stream": True,
                "sampling_params": {"max_new_tokens": None, "temperature": 0, "ignore_eos": True}}
        with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
            next(events)
            os.kill(ranks[0], signal.SIGKILL)
            rest = list(events)
        assert "[DONE]" not in rest
        assert json.loads(rest[-1])["error"]["code"] == "engine_unavailable"
        assert proc.wait(timeout=30) == 1
        lines = [ln for ln in err_path.read_text().splitlines() if "exited with code" in ln]
        assert len(lines) == 1 and re.search(
            rf"ERROR fleetserve.serve: scheduler process fleetserve-[\w-]+ \(pid {ranks[0]}\) exited with code -9 "
            r"\(SIGKILL\); stopping the server", lines[0]), lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(300)
def test_ctrl_c_stops_cleanly_without_a_traceback(servers):
    """Ctrl-C in a terminal: SIGINT to the whole process group (server and ranks)."""
    proc, err_path = servers["ctrl_c"]
    try:
        end = time.monotonic() + 240  # both servers start together
        while "serving " not in err_path.read_text():
            assert proc.poll() is None, err_path.read_text()[-2000:]
            assert time.monotonic() < end
            time.sleep(0.2)
        ranks = _rank_children(proc.pid)
        assert ranks
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        text = err_path.read_text()
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
        assert "interrupted: stopped" in text
        end = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{r}") for r in ranks) and time.monotonic() < end:
            time.sleep(0.1)
        assert not any(os.path.exists(f"/proc/{r}") for r in ranks)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
