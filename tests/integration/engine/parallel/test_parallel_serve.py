"""``fleetserve serve`` with several ranks: HTTP answers equal transformers', requests spread
over DP ranks, TP ranks stay in step, and a killed rank takes the instance down with a clear error."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from parallel_jobs import hf_greedy  # noqa: E402

from fleetserve.engine.rank_supervisor import free_port  # noqa: E402

PROMPTS = [[256, 72, 101, 108, 108], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
N_NEW = 8


@pytest.fixture(scope="module")
def ref(tiny_deepseek_v3_dir):
    """transformers' greedy tokens (and logits rows) for ``PROMPTS``: once for the module's servers."""
    return hf_greedy(tiny_deepseek_v3_dir, PROMPTS, N_NEW)


def _http(url, body=None, timeout=30):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _start(model_dir, log_path, *flags):
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "fleetserve.cli", "serve", "--model-path", model_dir,
                             "--dtype", "float32", "--max-total-tokens", "512", "--port", str(port),
                             "--dist-timeout", "30", *flags], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError("server exited during start-up:\n" + open(log_path).read()[-3000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError("server did not become healthy:\n" + open(log_path).read()[-3000:])


def _free_block(n):
    """A port p with p .. p + n - 1 all free a moment ago."""
    import socket

    for _ in range(50):
        p = free_port()
        socks = []
        try:
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p + k))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no block of free ports")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(") ")[1][0] != "Z"


def _generate(port, ids, **sp):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True, **sp}}
    deadline = time.monotonic() + 3
    while True:
        try:
            return _http(f"http://127.0.0.1:{port}/generate", body)
        except urllib.error.HTTPError as e:
            # Just after /health turns OK, the relay may still be connecting to the HTTP
            # side's freshly bound socket (503 "not accepting requests"); nothing else is retried.
            if e.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_dp_attention_ep_server_spreads_requests_and_dies_cleanly(tiny_deepseek_v3_dir, ref, tmp_path):
    log_path = str(tmp_path / "serve.log")
    proc, port = _start(tiny_deepseek_v3_dir, log_path, "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention",
                        "--ep-size", "2", "--moe-a2a-backend", "all_to_all")
    try:
        for ids, (want, _) in zip(PROMPTS, ref):
            assert _generate(port, ids)["output_ids"] == want
        info = _http(f"http://127.0.0.1:{port}/get_server_info")
        per_rank = {s["dp_rank"]: s for s in info["scheduler_stats"]}
        assert sorted(per_rank) == [0, 1]                      # round robin: one request each
        assert [per_rank[d]["prompt_tokens_total"] for d in (0, 1)] == [len(PROMPTS[0]), len(PROMPTS[1])]
        assert per_rank[0]["kv_bytes_per_token"] == per_rank[1]["kv_bytes_per_token"] > 0
        pid = int(re.search(r"rank 1 \(pid (\d+)\) ready", open(log_path).read()).group(1))
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=20) == 1
        assert f"rank 1 (pid {pid}) was killed by SIGKILL; the other ranks were stopped" in open(log_path).read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_tp2_server_keeps_ranks_in_step(tiny_deepseek_v3_dir, ref, tmp_path):
    log_path = str(tmp_path / "serve.log")
    proc, port = _start(tiny_deepseek_v3_dir, log_path, "--tp-size", "2")
    try:
        for ids, (want, _) in zip(PROMPTS, ref):
            assert _generate(port, ids)["output_ids"] == want
        # Sampled tokens: both ranks draw from one seed, so they stay in step and answer.
        sampled = _generate(port, PROMPTS[0], temperature=0.9)["output_ids"]
        assert len(sampled) == N_NEW
        assert _http(f"http://127.0.0.1:{port}/flush_cache", {})["success"] is True
        stats = _http(f"http://127.0.0.1:{port}/get_server_info")["scheduler_stats"]
        assert len(stats) == 1 and stats[0]["kv_cached_tokens"] == 0 and stats[0]["generation_tokens_total"] == 3 * N_NEW
        pids = [int(p) for p in re.findall(r"rank \d \(pid (\d+)\) ready", open(log_path).read())]
        assert len(pids) == 2
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        # No rank outlives the server, however it ended.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_two_nodes_on_one_machine(tiny_deepseek_v3_dir, ref, tmp_path):
    """--nnodes 2: node 1 runs its rank only and reaches node 0's process group and relay over
    TCP; when node 1 goes away, node 0 fails fast too."""
    addr = f"127.0.0.1:{_free_block(4)}"  # rendezvous + the relay's 3 ports after it
    flags = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2", "--nnodes", "2",
             "--dist-init-addr", addr]
    log1 = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen([sys.executable, "-m", "fleetserve.cli", "serve", "--model-path", tiny_deepseek_v3_dir,
                              "--dtype", "float32", "--max-total-tokens", "512", "--dist-timeout", "30",
                              "--node-rank", "1", *flags], stdout=log1, stderr=subprocess.STDOUT)
    node0 = None
    try:
        node0, port = _start(tiny_deepseek_v3_dir, str(tmp_path / "node0.log"), "--node-rank", "0", *flags)
        for ids, (want, _) in zip(PROMPTS, ref):
            assert _generate(port, ids)["output_ids"] == want
        deadline = time.monotonic() + 20  # node 1 logs its ranks' readiness on its own schedule
        while "node 1: ranks [1] ready" not in open(tmp_path / "node1.log").read():
            assert time.monotonic() < deadline, open(tmp_path / "node1.log").read()[-2000:]
            time.sleep(0.2)
        node1.kill()
        assert node0.wait(timeout=30) == 1
        assert "rank 0 (pid" in open(tmp_path / "node0.log").read()
    finally:
        for p in (node0, node1):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(5)
