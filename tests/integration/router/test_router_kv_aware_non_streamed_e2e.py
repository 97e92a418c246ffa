"""A non-streamed request in its decode steps leaves kv_aware's queued prefill once the worker's
``/v1/loads`` shows its queue empty (``num_waiting_reqs``), instead of counting as queued prefill
until its whole answer arrives (a ``fleetserve sim-worker`` behind a real router)."""

import json
import re
import sys
import threading
import time
import urllib.request

import pytest

from helpers.kv_events_sub import free_port_block

# prefill at once, then 0.1 s per decode step: 40 tokens take ~4 s
SLOW_DECODE = ["--prefill-per-token-s", "0", "--prefill-overhead-s", "0", "--decode-base-s", "0.1",
               "--decode-per-req-s", "0", "--decode-per-ctx-token-s", "0", "--tokenizer", "smollm2"]
QUEUED = "fleetserve_router_kv_worker_active_prefill_tokens"


def metric(router: str, name: str) -> float | None:
    with urllib.request.urlopen(router + "/metrics", timeout=10) as r:
        m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", r.read().decode(), re.M)
    return float(m.group(1)) if m else None


@pytest.mark.timeout(120)
def test_a_decoding_non_streamed_request_leaves_the_queued_prefill(procs):
    from fleetserve.models.tokenizer import tokenizer_dir

    http = free_port_block(1)
    p = procs.spawn([sys.executable, "-m", "fleetserve.cli", "sim-worker", "--port", str(http), *SLOW_DECODE])
    sim = f"http://127.0.0.1:{http}"
    sys.modules[type(procs).__module__].wait_http(sim + "/health", timeout=60, proc=p)
    router, _ = procs.router([sim], "--policy", "kv_aware", "--tokenizer-path", tokenizer_dir(),
                             "--kv-loads-interval-secs", "0.2")
    answer = {}

    def send():
        body = {"prompt": "Tell me a long story about a lighthouse keeper and the sea.", "max_tokens": 40,
                "ignore_eos": True}
        req = urllib.request.Request(router + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer["body"] = json.loads(r.read())
            answer["at"] = time.monotonic()

    t = threading.Thread(target=send)
    sent = time.monotonic()
    t.start()
    seen = []  # (seconds since sent, queued prefill tokens) while the answer is out
    while t.is_alive() and time.monotonic() - sent < 30:
        seen.append((time.monotonic() - sent, metric(router, QUEUED + '{dp_rank="-",worker="' + sim + '"}')))
        time.sleep(0.1)
    t.join(timeout=60)
    assert answer["body"]["usage"]["completion_tokens"] == 40
    took = answer["at"] - sent
    assert took > 3.0, took  # 40 decode steps of 0.1 s
    queued = [q for _, q in seen if q]
    assert queued and queued[0] > 0, seen  # counted as queued prefill at first
    # the router never sees a first byte of a non-streamed answer, yet the queue emptied while it decoded:
    # at least 1 s before the answer ended (a snapshot taken >= KNOWN_AFTER_S = 1 s after the send)
    zero_at = next(s for s, q in seen if s > 0.5 and q == 0)
    assert zero_at < took - 1.0, (zero_at, took, seen)
    assert metric(router, "fleetserve_router_kv_inferred_prefills_total") == 1.0
