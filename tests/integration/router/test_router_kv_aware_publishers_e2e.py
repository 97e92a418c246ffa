"""``fleetserve router --policy kv_aware`` in front of OUR publishers, as separate processes.

Two ``fleetserve sim-worker`` workers publish their real radix caches' KV events
(``--kv-events-config``, ``--page-size 16``); the router finds the endpoints in
their ``/get_server_info``.  A prefix cached on worker B by a request that
bypassed the router sends the router's next request with that prefix to B, and
the route header's predicted cached tokens equal the engine's reported
``cached_tokens`` (``meta_info`` on ``/generate``, ``usage.prompt_tokens_details``
on ``/v1/completions``).
"""

import json
import re
import sys
import time
import urllib.request

import pytest

from helpers.kv_events_sub import free_port_block

PAGE = 16
FAST = ["--prefill-per-token-s", "0", "--prefill-overhead-s", "0", "--decode-base-s", "0.001",
        "--decode-per-req-s", "0", "--decode-per-ctx-token-s", "0"]


def post(url, body, headers=None, timeout=20):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read()), r.headers


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def route_fields(header: str) -> dict:
    return dict(part.split("=", 1) for part in header.split("; "))


def wait_metric(router: str, pattern: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = get(router + "/metrics")
        m = re.search(pattern, text)
        if m:
            return m.group(0)
        assert time.monotonic() < deadline, f"no {pattern!r} in /metrics:\n{text[-3000:]}"
        time.sleep(0.05)


def sim_workers(procs, n=2):
    http = free_port_block(n)
    ev = free_port_block(2 * n)
    # with a replay endpoint, a router that joins after a worker's first batch still reaches exact
    cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{ev + n}", "topic": "sim"}
    p = procs.spawn([sys.executable, "-m", "fleetserve.cli", "sim-worker", "--port", str(http), "--num-workers",
                     str(n), "--page-size", str(PAGE), "--kv-events-config", json.dumps(cfg), *FAST])
    urls = [f"http://127.0.0.1:{http + i}" for i in range(n)]
    wait_http = sys.modules[type(procs).__module__].wait_http  # the router tests' conftest
    for u in urls:
        wait_http(u + "/health", timeout=60, proc=p)  # it imports torch: slow on a shared, busy machine
    return urls


@pytest.mark.timeout(90)
def test_routing_follows_our_sim_workers_events_and_predicts_their_cached_tokens(procs):
    a, b = sim_workers(procs)
    eps = [json.loads(json.loads(get(w + "/get_server_info"))["kv_events_config"])["endpoint"] for w in (a, b)]
    assert int(eps[1].rsplit(":", 1)[1]) == int(eps[0].rsplit(":", 1)[1]) + 1  # worker i: port + i
    router, _ = procs.router([a, b], "--policy", "kv_aware", "--kv-speculative-ttl-secs", "0")
    for w in (a, b):
        wait_metric(router, rf'fleetserve_router_kv_stream_state{{dp_rank="0",state="(fallback|exact|degraded)",'
                            rf'worker="{re.escape(w)}"}} 1\.0')
    time.sleep(0.3)  # the SUB sockets connect (slow joiner)

    # a direct request to B, bypassing the router, caches 4 pages of this prefix there
    prefix = list(range(1000, 1000 + 4 * PAGE))
    body, _ = post(b + "/generate", {"input_ids": prefix + [7], "sampling_params": {"max_new_tokens": 2}})
    assert body["meta_info"]["cached_tokens"] == 0
    # B's events reach the router: 4 stored blocks (or more: the output tokens' page is not full)
    wait_metric(router, rf'fleetserve_router_kv_index_blocks{{dp_rank="0",worker="{re.escape(b)}"}} [4-9]\.0')
    assert re.search(rf'fleetserve_router_kv_stream_state{{dp_rank="0",state="exact",worker="{re.escape(b)}"}} 1\.0',
                     get(router + "/metrics"))

    # through the router: the prefix goes to B, and the predicted cached tokens are B's own count
    body, h = post(router + "/generate", {"input_ids": prefix + [8, 9], "sampling_params": {"max_new_tokens": 2}})
    route = route_fields(h["x-fleetserve-route"])
    assert route["target"] == b and route["branch"] == "exact" and route["prompt_tokens"] == str(4 * PAGE + 2)
    assert body["meta_info"]["worker_id"] == b[len("http://"):]
    assert int(route["cached_tokens"]) == body["meta_info"]["cached_tokens"] == 4 * PAGE

    # OpenAI completions with a token-id prompt: usage.prompt_tokens_details.cached_tokens
    body, h = post(router + "/v1/completions", {"prompt": prefix[:3 * PAGE] + [5], "max_tokens": 2})
    route = route_fields(h["x-fleetserve-route"])
    assert route["target"] == b
    assert int(route["cached_tokens"]) == body["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * PAGE

    # the whole prompt is cached pages: the engine still computes the last token, so it reports one page
    # less, and so does the prediction
    body, h = post(router + "/v1/completions", {"prompt": prefix, "max_tokens": 2})
    route = route_fields(h["x-fleetserve-route"])
    assert route["target"] == b
    assert int(route["cached_tokens"]) == body["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * PAGE

    # the router judged its own guesses: three answers from B, all exact
    text = get(router + "/metrics")
    h = "fleetserve_router_cache_prediction_abs_error_tokens"
    assert f'{h}_count{{worker="{b}"}} 3.0' in text and f'{h}_sum{{worker="{b}"}} 0.0' in text
    assert f'fleetserve_router_cache_reported_tokens_total{{worker="{b}"}} {float(4 * PAGE + 6 * PAGE)}' in text

    # a new prefix cached directly on A moves the next request to A
    other = list(range(5000, 5000 + 2 * PAGE))
    post(a + "/generate", {"input_ids": other + [1], "sampling_params": {"max_new_tokens": 2}})
    wait_metric(router, rf'fleetserve_router_kv_index_blocks{{dp_rank="0",worker="{re.escape(a)}"}} [2-9]\.0')
    body, h = post(router + "/generate", {"input_ids": other + [2, 3], "sampling_params": {"max_new_tokens": 2}})
    route = route_fields(h["x-fleetserve-route"])
    assert route["target"] == a
    assert int(route["cached_tokens"]) == body["meta_info"]["cached_tokens"] == 2 * PAGE


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kv_aware_in_front_of_fleetserve_serve_with_page_size_16(procs, smollm2_p16_engine):
    """A real engine (built-in model, ``--page-size 16``: the router tests' shared ``smollm2_p16_engine``)
    beside a sim-worker: a chat prefix cached on the engine by a direct request sends the routed chat
    there, and the router's tokenization (the chat template) predicts exactly the engine's
    ``usage.prompt_tokens_details.cached_tokens``."""
    from fleetserve.models.tokenizer import tokenizer_dir

    engine, _ = smollm2_p16_engine  # loaded before the sim-worker starts (its 20 s start-up window)
    assert json.loads(get(engine + "/get_server_info"))["page_size"] == PAGE
    (sim,) = sim_workers(procs, 1)
    path = tokenizer_dir()
    # the engine-loads correction stays on (default interval, 1 s)
    router, _ = procs.router([sim, engine], "--policy", "kv_aware", "--kv-speculative-ttl-secs", "0",
                             "--tokenizer-path", path)
    wait_metric(router, rf'fleetserve_router_kv_stream_state{{dp_rank="0",state="(fallback|exact|degraded)",'
                        rf'worker="{re.escape(engine)}"}} 1\.0')
    time.sleep(0.3)
    system = {"role": "system", "content": "You are a terse assistant. " + " ".join(
        f"Rule {i}: answer in as few words as you can." for i in range(12))}
    direct = {"messages": [system, {"role": "user", "content": "Name a colour."}], "max_tokens": 2,
              "temperature": 0}
    body, _ = post(engine + "/v1/chat/completions", direct, timeout=120)  # CPU, first request
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert prompt_tokens > 4 * PAGE
    wait_metric(router, rf'fleetserve_router_kv_index_blocks{{dp_rank="0",worker="{re.escape(engine)}"}} '
                        rf'([4-9]|\d\d+)\.0')
    # the router has polled the engine since the direct request ended: a fresh snapshot says it is idle.
    # (A snapshot polled while that request ran used to stay in use for 3 intervals and send the routed
    # request to the sim-worker; a poll that fails now drops it: tests/unit/router/test_kv_aware_engine_loads.py.)
    wait_metric(router, rf'fleetserve_router_kv_engine_load_tokens{{dp_rank="0",worker="{re.escape(engine)}"}} '
                        rf'0\.0')
    routed = {"messages": [system, {"role": "user", "content": "Name a fruit."}], "max_tokens": 2,
              "temperature": 0}
    body, h = post(router + "/v1/chat/completions", routed, timeout=120)
    route = route_fields(h["x-fleetserve-route"])
    assert route["target"] == engine and route["branch"] == "exact"
    assert int(route["prompt_tokens"]) == body["usage"]["prompt_tokens"]  # the router's ids are the engine's
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 4 * PAGE and cached % PAGE == 0
    assert int(route["cached_tokens"]) == cached


@pytest.mark.timeout(90)
def test_engine_loads_steer_away_from_a_worker_busy_with_traffic_the_router_never_saw(procs):
    import threading

    a, b = sim_workers(procs)
    fixed, _ = procs.router([a, b], "--policy", "kv_aware", "--kv-loads-interval-secs", "0.2")
    blind, _ = procs.router([a, b], "--policy", "kv_aware", "--kv-loads-interval-secs", "0")
    # a long request straight to A: A's engine holds ~2k prompt tokens plus its growing output
    hog = threading.Thread(target=post, args=(a + "/generate", {
        "input_ids": list(range(3000, 5000)), "sampling_params": {"max_new_tokens": 4000}}), kwargs={"timeout": 60})
    hog.start()
    try:
        wait_metric(fixed, rf'fleetserve_router_kv_engine_load_tokens{{dp_rank="0",worker="{re.escape(a)}"}} '
                           rf'\d{{4,}}\.0')
        fresh = {"input_ids": list(range(9000, 9040)), "sampling_params": {"max_new_tokens": 2}}
        _, h = post(fixed + "/generate", fresh)
        assert route_fields(h["x-fleetserve-route"])["target"] == b
        # the router that reads no engine load sees two idle workers: a tie, and at its first decision
        # the tie goes to registration order (no worker chosen yet)
        _, h = post(blind + "/generate", {**fresh, "input_ids": list(range(9100, 9140))})
        assert route_fields(h["x-fleetserve-route"])["target"] == a
    finally:
        hog.join(60)
