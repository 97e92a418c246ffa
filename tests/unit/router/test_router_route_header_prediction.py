"""``x-fleetserve-route`` on every policy, and the predicted-vs-reported cached tokens in ``/metrics``."""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from fleetserve.router.prediction import PredictionStats, reported_cached_tokens
from fleetserve.router.route_header import format_route, text_cached_tokens, text_prompt_tokens
from fleetserve.router.routing_text import ids_text


# ------------------------------------------------------------ the report in the raw bytes
@pytest.mark.parametrize("data, want", [
    (b'{"usage":{"prompt_tokens":70,"prompt_tokens_details":{"cached_tokens":48}}}', 48),
    (b'{"usage": {"prompt_tokens_details": {"cached_tokens" :  0}}, "worker_id": "w"}', 0),
    (b'{"text":"x","meta_info":{"prompt_tokens":9,"cached_tokens":7,"e2e_latency":0.1}}', 7),
    (b'{"usage":{"prompt_tokens_details":{"cached_tokens":null}}}', None),
    (b'{"usage":{"prompt_tokens":5,"completion_tokens":2}}', None),
    # the key inside a JSON string is escaped, so it never matches
    (b'{"choices":[{"text":"say \\"cached_tokens\\": 99"}],"usage":{"prompt_tokens":3}}', None),
    # a stream tail: the last report wins (SGLang sends meta_info in every chunk)
    (b'data: {"meta_info":{"cached_tokens":3}}\n\ndata: {"meta_info":{"cached_tokens":16}}\n\ndata: [DONE]\n\n', 16),
    (b'{"cached_tokens":', None),
])
def test_reported_cached_tokens_reads_the_last_report(data, want):
    assert reported_cached_tokens(data) == want


def test_prediction_stats_buckets_sums_and_unreported():
    st = PredictionStats()
    st.observe(64, 64)  # exact: bucket 0
    st.observe(10, 40)  # 30 off: bucket <= 64
    st.observe(5, None)
    assert st.count == 2 and st.error_sum == 30 and st.unreported == 1
    assert (st.predicted, st.reported) == (74, 104)
    assert st.buckets[0] == 1 and st.buckets[3] == 1  # buckets (0, 1, 16, 64, ...)


def test_text_forms_count_tokens_and_cap_at_prompt_minus_one():
    t = ids_text(list(range(10)))
    assert text_prompt_tokens(t) == 10
    assert text_cached_tokens(t, 1 + 6) == 6  # the marker character is not a token
    assert text_cached_tokens(t, len(t)) == 9  # all held: the engine still computes the last token
    assert text_prompt_tokens("x" * 41) == 11 and text_cached_tokens("x" * 41, 40) == 10
    assert format_route("http://a:1", None, "hit", None, 5) == \
        "target=http://a:1; dp_rank=-; branch=hit; cached_tokens=-; prompt_tokens=5"


# ------------------------------------------------------------ through a router
def reporting_worker(name: str):
    """A worker that reports the ``cached_tokens`` the request asks for (``"report"`` in its body)."""

    async def answer(req: web.Request):
        body = await req.json()
        if body.get("refuse"):  # the engine refuses it (bad model, bad value, busy): nothing is cached
            return web.json_response({"error": {"message": "refused", "code": None}}, status=body["refuse"])
        rep = body.get("report")
        usage = {"prompt_tokens": 10, "completion_tokens": 1,
                 "prompt_tokens_details": None if rep is None else {"cached_tokens": rep}}
        if req.path == "/generate":
            doc = {"text": "ok", "meta_info": {"cached_tokens": rep, "worker": name}}
        else:
            doc = {"choices": [{"index": 0, "text": "ok"}], "usage": usage, "worker": name}
        if not body.get("stream"):
            return web.json_response(doc)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for piece in ("a", "b"):
            await resp.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": piece}]}).encode() + b"\n\n")
            await asyncio.sleep(0.01)
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    async def health(_req):
        return web.Response(text="OK")

    app.router.add_get("/health", health)
    app.router.add_post("/generate", answer)
    app.router.add_post("/v1/completions", answer)
    return app


def metric(text: str, name: str, worker: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'worker="{worker}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


async def test_cache_aware_header_and_prediction_error_per_worker(start_app, InProcessRouter):
    runners, urls = [], []
    for n in ("w0", "w1"):
        rn, u = await start_app(reporting_worker(n))
        runners.append(rn)
        urls.append(u)
    try:
        async with InProcessRouter(worker_urls=urls, policy="cache_aware") as r, aiohttp.ClientSession() as s:
            prompt = list(range(100, 132))  # 32 token ids: routed on their text form, a character per token
            # first time: a miss, nothing predicted; the engine says 0
            async with s.post(r.url + "/v1/completions", json={"prompt": prompt, "report": 0}) as resp:
                route = resp.headers["x-fleetserve-route"]
                first = (await resp.json())["worker"]
            target = urls[int(first[1])]
            assert route == f"target={target}; dp_rank=-; branch=miss; cached_tokens=0; prompt_tokens=32"
            # the same 32 + 8 more: a hit, 32 predicted (the tree), and the engine says 24 (it evicted a bit)
            async with s.post(r.url + "/v1/completions", json={"prompt": prompt + list(range(8)),
                                                               "report": 24}) as resp:
                route = resp.headers["x-fleetserve-route"]
                assert (await resp.json())["worker"] == first
            assert route == f"target={target}; dp_rank=-; branch=hit; cached_tokens=32; prompt_tokens=40"
            # streamed, SGLang /generate with input_ids: the last usage chunk is the report
            async with s.post(r.url + "/v1/completions", json={"prompt": prompt + list(range(8)), "report": 40,
                                                               "stream": True}) as resp:
                route = resp.headers["x-fleetserve-route"]
                await resp.read()
            assert "branch=hit; cached_tokens=39; prompt_tokens=40" in route  # all held: at most prompt - 1
            async with s.post(r.url + "/generate", json={"input_ids": prompt[:20], "report": 19}) as resp:
                assert "branch=hit; cached_tokens=19; prompt_tokens=20" in resp.headers["x-fleetserve-route"]
            # a worker that does not report: counted apart
            async with s.post(r.url + "/v1/completions", json={"prompt": prompt}) as resp:
                assert resp.status == 200
            async with s.get(r.url + "/metrics") as resp:
                text = await resp.text()
            h = "fleetserve_router_cache_prediction_abs_error_tokens"
            assert metric(text, h + "_count", target) == 4
            assert metric(text, h + "_sum", target) == 0 + 8 + 1 + 0
            assert metric(text, "fleetserve_router_cache_predicted_tokens_total", target) == 0 + 32 + 39 + 19
            assert metric(text, "fleetserve_router_cache_reported_tokens_total", target) == 0 + 24 + 40 + 19
            assert metric(text, "fleetserve_router_cache_unreported_total", target) == 1
            assert f'{h}_bucket{{le="0.0",worker="{target}"}} 2.0' in text
            assert f'{h}_bucket{{le="16.0",worker="{target}"}} 4.0' in text
    finally:
        for rn in runners:
            await rn.cleanup()


@pytest.mark.parametrize("no_header", [False, True])
async def test_round_robin_shows_its_branch_and_makes_no_guess(start_app, InProcessRouter, no_header):
    rn, u = await start_app(reporting_worker("w0"))
    try:
        async with InProcessRouter(worker_urls=[u], policy="round_robin", no_route_header=no_header) as r, \
                aiohttp.ClientSession() as s:
            async with s.post(r.url + "/v1/completions", json={"prompt": "hello there", "report": 3}) as resp:
                route = resp.headers.get("x-fleetserve-route")
            if no_header:
                assert route is None
            else:
                assert route == f"target={u}; dp_rank=-; branch=round_robin; cached_tokens=-; prompt_tokens=3"
            async with s.get(r.url + "/metrics") as resp:
                text = await resp.text()
            assert metric(text, "fleetserve_router_cache_prediction_abs_error_tokens_count", u) is None
    finally:
        await rn.cleanup()


@pytest.mark.parametrize("status", [400, 404, 429, 503])
@pytest.mark.parametrize("policy, sticky", [("cache_aware", False), ("cache_aware", True), ("kv_aware", False)])
async def test_a_refused_request_leaves_no_entry_in_the_tree(start_app, InProcessRouter, status, policy, sticky):
    """A worker that answers 4xx (or busy) never cached the prompt: the tree entry its decision made is
    taken back, so the next request with that prompt is predicted 0 cached tokens, as the engine reports.
    ``sticky``: the decision came from ``--sticky-sessions`` (which inserts into the same tree)."""
    rn, u = await start_app(reporting_worker("w0"))
    extra = {"sticky_sessions": True} if sticky else {}
    headers = {"x-smg-routing-key": "s1"} if sticky else {}
    try:
        async with InProcessRouter(worker_urls=[u], policy=policy, **extra) as r, \
                aiohttp.ClientSession(headers=headers) as s:
            kept = list(range(200, 216))
            async with s.post(r.url + "/v1/completions", json={"prompt": kept, "report": 0}) as resp:
                assert resp.status == 200
            prompt = kept + list(range(300, 316))  # shares 16 with what the worker holds
            async with s.post(r.url + "/v1/completions", json={"prompt": prompt, "refuse": status}) as resp:
                assert resp.status == status
            held = r.router.policy.tree.prefix_match_tenant(ids_text(prompt), u)
            assert held == len(ids_text(kept))  # the refused tail is gone, the prefix the worker held stays
            async with s.post(r.url + "/v1/completions", json={"prompt": prompt, "report": 16}) as resp:
                assert resp.status == 200
                route = resp.headers["x-fleetserve-route"]
            tree = r.router.policy.tree
            if sticky:
                assert "branch=session" in route
            else:
                assert "; cached_tokens=16; prompt_tokens=32" in route  # not 31: the refused one left nothing
            assert tree.tenant_size(u) == tree.total_size == len(ids_text(prompt))  # each character once
            async with s.get(r.url + "/metrics") as resp:
                text = await resp.text()
            h = "fleetserve_router_cache_prediction_abs_error_tokens"
            assert metric(text, h + "_sum", u) == 0
    finally:
        await rn.cleanup()
