"""``fleetserve router --policy kv_aware`` as its own process: a vLLM-layout publisher named by
``--kv-events-endpoint`` steers routing, and SIGTERM still ends the router cleanly."""

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PUBLISHER = Path(__file__).resolve().parents[2] / "helpers" / "kv_publisher.py"
PREFIX = list(range(200, 264))


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read()), r.headers.get("x-fleetserve-route")


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_kv_aware_router_process_follows_flag_endpoint_events(procs):
    pub = subprocess.Popen([sys.executable, str(PUBLISHER), "--layout", "vllm", "--block-size", "16"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(pub.stdout.readline())["endpoint"].rsplit(":", 1)[1]
        w0, _ = procs.worker("w0")
        w1, _ = procs.worker("w1")
        router, rp = procs.router([w0, w1], "--policy", "kv_aware", "--kv-speculative-ttl-secs", "0",
                                  "--kv-events-endpoint", f"{w1}=tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 20
        while f'fleetserve_router_kv_stream_state{{dp_rank="0",state="fallback",worker="{w1}"}}' not in \
                get(router + "/metrics"):
            assert time.monotonic() < deadline, "no subscription"
            time.sleep(0.1)
        time.sleep(0.3)  # the SUB connects
        pub.stdin.write(json.dumps({"op": "store", "tokens": PREFIX}) + "\n")
        pub.stdin.flush()
        assert json.loads(pub.stdout.readline())["ok"]
        want = f'fleetserve_router_kv_index_blocks{{dp_rank="0",worker="{w1}"}} 4.0'
        while want not in get(router + "/metrics"):
            assert time.monotonic() < deadline, "blocks not indexed"
            time.sleep(0.1)
        body, route = post(router + "/generate", {"input_ids": PREFIX + [1]})
        assert body["worker"] == "w1"
        assert route == f"target={w1}; dp_rank=-; branch=exact; cached_tokens=64; prompt_tokens=65"
        rp.send_signal(signal.SIGTERM)
        assert rp.wait(timeout=15) == 0
    finally:
        pub.stdin.close()
        pub.wait(timeout=5)
