"""A kv_aware router with SmolLM2's tokenizer in front of a ``fleetserve sim-worker`` with its
default ``word`` tokenizer: the worker's reported prompt tokens disagree with the router's, so
after two answers it is routed ``branch=fallback ... reason=tokenizer`` (one warning, a metric)
instead of ``branch=exact`` with 0 predicted cached tokens forever (issue 12 b)."""

import json
import re
import time
import urllib.request

import pytest


FAST = ["--prefill-per-token-s", "0", "--prefill-overhead-s", "0", "--decode-base-s", "0.001",
        "--decode-per-req-s", "0", "--decode-per-ctx-token-s", "0"]


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read()), r.headers.get("x-fleetserve-route")


def metrics(url):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.mark.timeout(120)
def test_word_tokenized_sim_worker_is_routed_by_the_tree_with_reason_tokenizer(procs):
    from fleetserve.models.tokenizer import tokenizer_dir

    sim = procs.sim_with_events(*FAST)
    router, rp = procs.router([sim], "--policy", "kv_aware", "--tokenizer-path", tokenizer_dir(),
                              "--kv-speculative-ttl-secs", "0")
    deadline = time.monotonic() + 20
    while f'fleetserve_router_kv_stream_state{{dp_rank="0",state="fallback",worker="{sim}"}}' not in metrics(router):
        assert time.monotonic() < deadline, "no subscription"
        time.sleep(0.1)
    time.sleep(0.3)  # the SUB connects
    system = {"role": "system", "content": "You are a terse assistant who answers in one word."}
    post(sim + "/v1/chat/completions", {"messages": [system, {"role": "user", "content": "Hi."}], "max_tokens": 2})
    while f'fleetserve_router_kv_stream_state{{dp_rank="0",state="exact",worker="{sim}"}} 1.0' not in metrics(router):
        assert time.monotonic() < deadline, "the stream never became exact"
        time.sleep(0.1)
    routes, counts = [], []
    for q in ("Name a colour.", "Name a fruit.", "Name a tree."):
        body, route = post(router + "/v1/chat/completions",
                           {"messages": [system, {"role": "user", "content": q}], "max_tokens": 2})
        routes.append(dict(part.split("=", 1) for part in route.split("; ")))
        counts.append((int(routes[-1]["prompt_tokens"]), body["usage"]["prompt_tokens"]))
    assert all(ours != theirs for ours, theirs in counts), counts  # word ids vs SmolLM2's: other counts
    assert [r["branch"] for r in routes[:2]] == ["exact", "exact"]  # before the verdict: trusted
    assert "reason" not in routes[0] and "reason" not in routes[1]
    third = routes[2]
    assert (third["branch"], third["reason"]) == ("fallback", "tokenizer")
    # the tree knows the shared system prompt went to this worker: a guess above 0 (exact said 0)
    assert int(third["cached_tokens"]) > 0
    text = metrics(router)
    assert f'fleetserve_router_kv_tokenizer_mismatch{{worker="{sim}"}} 1.0' in text
    assert f'fleetserve_router_kv_prompt_token_checks_total{{result="disagreed",worker="{sim}"}} 3.0' in text
    assert re.search(r'fleetserve_router_kv_decisions_total\{branch="fallback"\} [1-9]', text)
    rp.terminate()
    rp.wait(timeout=15)
    rp.log.seek(0)
    log = rp.log.read().decode()
    assert log.count("counts other prompt tokens than the router's tokenizer") == 1, log[-2000:]
