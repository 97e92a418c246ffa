"""``fleetserve serve`` with two DP-attention ranks (TP 2, DP 2, gloo): both ranks appear in
``/v1/loads`` and ``/metrics``, and a request naming its rank (``routed_dp_rank`` in the
body, or the ``X-data-parallel-rank`` header) is served by that rank and no other."""

import os
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.engine.rank_supervisor import free_port
from helpers.serve_process import serve_process

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def base(tiny_deepseek_v3_dir, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("dp_loads") / "serve.log"
    with open(log_path, "w+") as log, serve_process(
            [sys.executable, "-m", "fleetserve.cli", "serve", "--model-path", tiny_deepseek_v3_dir,
            "--dtype", "float32", "--max-total-tokens", "1024", "--port", str(port),
            "--dist-timeout", "60", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention",
            "--log-level", "warning"],
            f"http://127.0.0.1:{port}", log, env=dict(os.environ, OMP_NUM_THREADS="1")) as url:
        yield url


def post(url, body, headers=None, timeout=60):
    # Just after /health turns OK the relay may still be connecting (503); nothing else is retried.
    deadline = time.monotonic() + 5
    while True:
        r = httpx.post(url, json=body, headers=headers or {}, timeout=timeout)
        if r.status_code != 503 or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def loads(base):
    body = httpx.get(f"{base}/v1/loads", timeout=10).json()
    return {d["dp_rank"]: d for d in body["loads"]}, body


def prompt_tokens(base):
    stats = httpx.get(f"{base}/get_server_info", timeout=10).json()["scheduler_stats"]
    return {s["dp_rank"]: s["prompt_tokens_total"] for s in stats}


def wait_idle(base):
    deadline = time.monotonic() + 15
    while True:
        per, _ = loads(base)
        if all(d["num_total_reqs"] == 0 and d["num_used_tokens"] == 0 for d in per.values()):
            return per
        assert time.monotonic() < deadline, per
        time.sleep(0.05)


def test_both_ranks_reported_and_routed_requests_land_on_their_rank(base):
    info = httpx.get(f"{base}/get_server_info", timeout=10).json()
    assert (info["dp_size"], info["enable_dp_attention"], info["page_size"]) == (2, True, 1)
    per, body = loads(base)
    assert sorted(per) == [0, 1] and body["dp_rank_count"] == 2 and body["num_accelerators"] == 1
    assert all(d["num_total_reqs"] == 0 for d in per.values())

    before = prompt_tokens(base)
    ids = [256, 72, 101, 108, 108, 111]
    r = post(f"{base}/generate", {"input_ids": ids, "routed_dp_rank": 1,
                                  "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200, r.text
    after = prompt_tokens(base)
    assert after[1] - before[1] == len(ids) and after[0] == before[0]

    r = post(f"{base}/v1/completions", {"prompt": ids + [33], "max_tokens": 3},
             headers={"X-data-parallel-rank": "1"})
    assert r.status_code == 200, r.text
    again = prompt_tokens(base)
    assert again[1] - after[1] == len(ids) + 1 and again[0] == after[0]

    r = post(f"{base}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                             "routed_dp_rank": 0}, headers={"x-data-parallel-rank": "0"})
    assert r.status_code == 200, r.text
    last = prompt_tokens(base)
    assert last[0] - again[0] == r.json()["usage"]["prompt_tokens"] > 0 and last[1] == again[1]

    # header beats body (SGLang's order)
    r = post(f"{base}/generate", {"input_ids": ids, "routed_dp_rank": 0, "sampling_params": {"max_new_tokens": 1}},
             headers={"X-Data-Parallel-Rank": "1"})
    assert r.status_code == 200
    assert prompt_tokens(base) == {0: last[0], 1: last[1] + len(ids)}
    wait_idle(base)


def test_a_long_request_shows_on_its_rank_only_then_leaves(base):
    results = []
    body = {"input_ids": [256, 1, 2, 3, 4, 5, 6, 7], "routed_dp_rank": 1,
            "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}
    t = threading.Thread(target=lambda: results.append(post(f"{base}/generate", body, timeout=180)))
    t.start()
    deadline = time.monotonic() + 60
    while True:
        per, body_ = loads(base)
        if per[1]["num_running_reqs"] == 1:
            break
        assert time.monotonic() < deadline, per
        time.sleep(0.02)
    assert per[0]["num_running_reqs"] == 0 and per[0]["num_used_tokens"] == 0
    assert per[1]["num_used_tokens"] >= 8 and body_["aggregate"]["total_running_reqs"] == 1
    one = httpx.get(f"{base}/v1/loads?dp_rank=1", timeout=10).json()["loads"]
    assert [d["dp_rank"] for d in one] == [1]
    text = httpx.get(f"{base}/metrics", timeout=10).text
    running = {s.labels["dp_rank"]: s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "sglang:num_running_reqs"}
    assert running["1"] == 1 and running["0"] == 0
    t.join(180)
    assert results[0].status_code == 200 and len(results[0].json()["output_ids"]) == 300
    per = wait_idle(base)
    assert all(d["num_waiting_uncached_tokens"] == 0 and d["token_usage"] == 0.0 for d in per.values())


@pytest.mark.parametrize("body, headers, message", [
    ({"routed_dp_rank": 2}, {}, "routed_dp_rank=2 out of range [0, 2)"),
    ({"routed_dp_rank": -1}, {}, "routed_dp_rank=-1 out of range [0, 2)"),
    ({}, {"X-data-parallel-rank": "2"}, "routed_dp_rank=2 out of range [0, 2)"),
    ({}, {"X-data-parallel-rank": "1.5"}, "Invalid X-Data-Parallel-Rank header: must be an integer, got '1.5'"),
])
def test_out_of_range_rank_is_400_naming_the_range(base, body, headers, message):
    for path, base_body in (("/generate", {"input_ids": [1, 2]}), ("/v1/completions", {"prompt": [1, 2]})):
        r = post(f"{base}{path}", {**base_body, **body}, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["message"] == message, (path, r.text)
    r = httpx.get(f"{base}/v1/loads?dp_rank=2", timeout=10)
    assert r.status_code == 400 and "out of range [0, 2)" in r.json()["error"]["message"]
    wait_idle(base)
