"""The client's ``X-data-parallel-rank`` (vLLM's DP-rank header) reaches the worker through the router.

The worker is an in-process aiohttp app that checks the header as ``fleetserve serve --dp-size 2``
does (entrypoints/validation.py: 400 ``routed_dp_rank=R out of range [0, 2)``) and records every
value it got.  Under ``kv_aware --dp-aware`` the client's header wins over the router's rank, as a
client's own ``routed_dp_rank`` later in the body does, and only one header reaches the worker.
"""

import asyncio

import aiohttp
import orjson
import pytest
from aiohttp import web

from fleetserve.router.kv_events.policy import KvAwarePolicy, RouteKey, names_client_rank

DP_SIZE = 2


def dp_worker_app(seen: list) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        ranks = request.headers.getall("X-data-parallel-rank", [])
        seen.append((ranks, body.get("routed_dp_rank")))
        if ranks:
            rank = int(ranks[0])
            if not 0 <= rank < DP_SIZE:
                return web.json_response({"error": {"message": f"routed_dp_rank={rank} out of range [0, {DP_SIZE})",
                                                    "type": "invalid_request_error", "param": None, "code": None}},
                                         status=400)
        return web.json_response({"text": "ok"})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "fake", "dp_size": DP_SIZE})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", generate)
    app.router.add_get("/get_server_info", info)
    app.router.add_get("/health", health)
    return app


@pytest.fixture
async def dp_worker(recording_worker):
    async with recording_worker(dp_worker_app) as got:
        yield got


async def post(s, url, body, headers=None):
    async with s.post(url, json=body, headers=headers) as r:
        return r.status, await r.read()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
async def test_client_dp_rank_header_reaches_the_worker(dp_worker, InProcessRouter, policy):
    wurl, seen = dp_worker
    async with InProcessRouter(worker_urls=[wurl], policy=policy) as r, aiohttp.ClientSession() as s:
        st, body = await post(s, r.url + "/generate", {"text": "hi"}, {"X-data-parallel-rank": "5"})
        assert (st, orjson.loads(body)) == (400, {"error": {"message": "routed_dp_rank=5 out of range [0, 2)",
                                                            "type": "invalid_request_error", "param": None,
                                                            "code": None}})
        st, body = await post(s, r.url + "/v1/completions", {"prompt": "hi"}, {"x-data-parallel-rank": "1"})
        assert (st, orjson.loads(body)) == (200, {"text": "ok"})
        st, _ = await post(s, r.url + "/generate", {"text": "hi"})  # none sent: none passed on
        assert st == 200
    assert seen == [(["5"], None), (["1"], None), ([], None)]


@pytest.mark.timeout(30)
async def test_dp_aware_client_header_wins_and_is_the_only_one_sent(dp_worker, InProcessRouter):
    wurl, seen = dp_worker
    async with InProcessRouter(worker_urls=[wurl], policy="kv_aware", dp_aware=True,
                               kv_speculative_ttl_secs=0) as r, aiohttp.ClientSession() as s:
        for _ in range(100):  # its dp_size from /get_server_info: ranks 0 and 1
            if tuple(r.router.policy.ranks(wurl)) == (0, 1):
                break
            await asyncio.sleep(0.05)
        st, _ = await post(s, r.url + "/generate", {"input_ids": [1, 2, 3]})
        assert st == 200
        assert seen[-1] == (["0"], 0)  # the router's own choice, in the header and first in the body
        st, body = await post(s, r.url + "/generate", {"input_ids": [1, 2, 3]}, {"X-data-parallel-rank": "5"})
        assert (st, orjson.loads(body)["error"]["message"]) == (400, "routed_dp_rank=5 out of range [0, 2)")
        assert seen[-1][0] == ["5"]  # the client's header alone (a rank no worker has: the router's stays in the body)
        st, _ = await post(s, r.url + "/generate", {"input_ids": [1, 2, 3]}, {"X-data-parallel-rank": "1"})
        assert st == 200 and seen[-1] == (["1"], 1)  # the router routes to the rank the client named


@pytest.mark.timeout(30)
@pytest.mark.parametrize("named", [{"header": "1"}, {"routed_dp_rank": 1}, {"data_parallel_rank": 1},
                                   {"header": "0", "routed_dp_rank": 1}])
async def test_dp_aware_routes_and_charges_the_rank_the_client_named(dp_worker, InProcessRouter, named):
    """Helper trial: a client's ``routed_dp_rank`` 0 ran on rank 0 while the router's header said rank 1
    and its load counted the request there.  Now the named rank is the router's decision: the route
    header, the rank it sends and the load it counts (the header wins over the body, as in the engine)."""
    wurl, seen = dp_worker
    want = int(named.get("header", named.get("routed_dp_rank", named.get("data_parallel_rank"))))
    body = {"input_ids": [1, 2, 3], **{k: v for k, v in named.items() if k != "header"}}
    headers = {"X-data-parallel-rank": named["header"]} if "header" in named else None
    async with InProcessRouter(worker_urls=[wurl], policy="kv_aware", dp_aware=True,
                               kv_speculative_ttl_secs=0) as r, aiohttp.ClientSession() as s:
        pol = r.router.policy
        for _ in range(100):  # its dp_size from /get_server_info: both ranks are targets (no KV events here)
            if tuple(pol.ranks(wurl)) == (0, 1):
                break
            await asyncio.sleep(0.05)
        assert tuple(pol.ranks(wurl)) == (0, 1)
        for _ in range(3):  # unpinned, the router would spread these over both ranks
            async with s.post(r.url + "/generate", json=body, headers=headers) as resp:
                assert resp.status == 200
                assert f"; dp_rank={want};" in resp.headers["x-fleetserve-route"]
        assert pol.decisions and sum(pol.chosen_at.get((wurl, rk), 0) > 0 for rk in (0, 1)) == 1
        assert pol.chosen_at.get((wurl, want), 0) == 3


def test_decorate_adds_the_routers_rank_header_only_when_the_client_sent_none():
    pol = KvAwarePolicy(dp_aware=True)
    key = RouteKey("", [1, 2, 3])
    key.target, key.rank = ("http://w", 1), 1
    body, headers, _ = pol.decorate(key, b'{"input_ids":[1,2,3]}', b"authorization: Bearer k\r\n")
    assert body == b'{"routed_dp_rank":1,"input_ids":[1,2,3]}'
    assert headers == b"authorization: Bearer k\r\nX-data-parallel-rank: 1\r\n"
    for client in (b"x-data-parallel-rank: 0\r\n", b"authorization: Bearer k\r\nx-data-parallel-rank: 0\r\n"):
        body, headers, _ = pol.decorate(key, b'{"input_ids":[1,2,3]}', client)
        assert body == b'{"routed_dp_rank":1,"input_ids":[1,2,3]}' and headers == client
    assert not names_client_rank(b"authorization: Bearer x-data-parallel-rank: 3\r\n")
    # a rank named in the body wins too: the engine reads a header first, so the router sends none
    for field in (b"routed_dp_rank", b"data_parallel_rank"):
        mine = b'{"input_ids":[1,2,3],"' + field + b'":0}'
        body, headers, _ = pol.decorate(key, mine, b"authorization: Bearer k\r\n")
        assert body == b'{"routed_dp_rank":1,' + mine[1:] and headers == b"authorization: Bearer k\r\n"


@pytest.mark.timeout(30)
async def test_dp_aware_without_kv_events_spreads_over_the_ranks_of_dp_size(dp_worker, InProcessRouter):
    """A worker that publishes no KV events has the ranks of its /get_server_info dp_size (it used to
    count as rank 0 alone, so --dp-aware sent every request to rank 0)."""
    wurl, seen = dp_worker
    async with InProcessRouter(worker_urls=[wurl], policy="kv_aware", dp_aware=True,
                               kv_speculative_ttl_secs=0) as r, aiohttp.ClientSession() as s:
        pol = r.router.policy
        for _ in range(100):
            if tuple(pol.ranks(wurl)) == (0, 1):
                break
            await asyncio.sleep(0.05)
        ranks = []
        for i in range(4):
            async with s.post(r.url + "/generate", json={"input_ids": [10 + i, 2, 3]}) as resp:
                assert resp.status == 200
                ranks.append(resp.headers["x-fleetserve-route"].split("dp_rank=")[1].split(";")[0])
        assert sorted(ranks) == ["0", "0", "1", "1"]  # idle ranks, equal loads: taken in turn
        assert [b for _, b in seen] == [int(x) for x in ranks]
