"""``kv_aware --dp-aware`` in front of a real 2-rank DP-attention ``fleetserve serve`` (tiny DeepSeek-V3,
TP 2 / DP 2, gloo): the rank named in the route header is the rank whose scheduler stats show the
request, and a prefix one rank caches sends the next request with it to that rank."""

import json
import re
import time
import urllib.request

import pytest

from helpers.kv_events_sub import free_port_block

pytestmark = pytest.mark.slow
PAGE = 4


def post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read()), r.headers


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def rank_prompt_tokens(engine):
    stats = json.loads(get(engine + "/get_server_info"))["scheduler_stats"]
    return {s["dp_rank"]: s["prompt_tokens_total"] for s in stats}


def wait_metric(router, pattern, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not re.search(pattern, text := get(router + "/metrics")):
        assert time.monotonic() < deadline, f"no {pattern!r} in:\n{text[-3000:]}"
        time.sleep(0.1)


@pytest.mark.timeout(300)
def test_dp_aware_route_header_names_the_rank_that_serves(procs, tiny_deepseek_v3_dir):
    ev = free_port_block(4)
    cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{ev + 2}"}
    engine, _ = procs.engine("--model-path", tiny_deepseek_v3_dir, "--dtype", "float32", "--max-total-tokens",
                             "1024", "--dist-timeout", "60", "--tp-size", "2", "--dp-size", "2",
                             "--enable-dp-attention", "--page-size", str(PAGE), "--kv-events-config", json.dumps(cfg),
                             timeout=200)
    router, _ = procs.router([engine], "--policy", "kv_aware", "--dp-aware", "--kv-speculative-ttl-secs", "0")
    for r in (0, 1):  # one subscription per rank (fallback until its first batch)
        wait_metric(router, rf'fleetserve_router_kv_stream_state{{dp_rank="{r}",state="fallback",'
                            rf'worker="{re.escape(engine)}"}} 1\.0')
    time.sleep(0.3)  # the SUB sockets connect (a late join is repaired by replay anyway)
    prefix = [256] + list(range(40, 40 + 6 * PAGE - 1))  # 6 pages
    # straight to rank 1: its cache holds the prefix; the router never saw this request
    deadline = time.monotonic() + 10
    while True:  # just after /health the DP relay may still answer 503
        try:
            post(engine + "/generate", {"input_ids": prefix + [9], "routed_dp_rank": 1,
                                        "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
            break
        except urllib.error.HTTPError as e:
            assert e.code == 503 and time.monotonic() < deadline
            time.sleep(0.1)
    wait_metric(router, rf'fleetserve_router_kv_index_blocks{{dp_rank="1",worker="{re.escape(engine)}"}} [6-9]\.0')

    before = rank_prompt_tokens(engine)
    ids = prefix + [11, 12]
    body, h = post(router + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2,
                                                                                "temperature": 0}})
    route = dict(p.split("=", 1) for p in h["x-fleetserve-route"].split("; "))
    assert route["dp_rank"] == "1" and route["branch"] == "exact"
    after = rank_prompt_tokens(engine)
    assert after[1] - before[1] == len(ids) and after[0] == before[0]  # rank 1 served it, rank 0 did not
    assert int(route["cached_tokens"]) == body["meta_info"]["cached_tokens"] == 6 * PAGE

    # a prompt no rank holds, both ranks idle: a tie (it goes to the rank chosen least recently, unless an
    # engine load snapshot still counts the last request); whichever rank takes it, its stats show it
    fresh = [256] + list(range(120, 140))  # within the tiny vocabulary
    body, h = post(router + "/generate", {"input_ids": fresh, "sampling_params": {"max_new_tokens": 2}})
    route = dict(p.split("=", 1) for p in h["x-fleetserve-route"].split("; "))
    last = rank_prompt_tokens(engine)
    rank = int(route["dp_rank"])
    assert last[rank] - after[rank] == len(fresh) and last[1 - rank] == after[1 - rank]
    assert int(route["cached_tokens"]) == body["meta_info"]["cached_tokens"] == 0
