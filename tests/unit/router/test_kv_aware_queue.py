"""kv_aware's queued-prefill term: requests whose prefill has not ended cost their target like uncached tokens.

The states are those the router's debug log showed on 2 real CPU engines (docs/benchmarks.md
``routing-kv-engine``): multi_turn's first turns, 4 at once, 62 prompt tokens of which the chat
template's first 24 are the same for every conversation, 16 decode tokens.
"""

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from fleetserve.router.kv_events.loads import EngineLoads, ranks_waiting
from fleetserve.router.kv_events.policy import KvAwarePolicy, RouteKey, _shared_queued
from fleetserve.router.workers import Worker

A, B = "http://a:1", "http://b:1"
TEMPLATE = list(range(500, 524))  # 24 tokens every chat prompt starts with


def turn0(c: int) -> list[int]:
    return TEMPLATE + [10_000 + 100 * c + j for j in range(38)]  # 62 tokens


def kv(**kw) -> KvAwarePolicy:
    return KvAwarePolicy(speculative_ttl_s=0, **kw)  # no KV-event streams yet: the tree decides (fallback)


def route_burst(pol, n=4):
    wa, wb = Worker(A), Worker(B)
    keys = [RouteKey("", turn0(c), 16) for c in range(n)]
    return [pol.select([wa, wb], k).url for k in keys], keys


def test_the_old_rule_piled_the_first_turns_on_one_worker_and_the_queue_term_spreads_them():
    old = kv(queue_weight=0.0)  # the rule before: 24 template tokens outweighed 0.1 x 186 in-flight tokens
    urls, _ = route_burst(old)
    assert urls == [A, A, A, A]
    assert old.load_tokens == {(A, None): 62 + 16 + 3 * (38 + 16)}
    new = kv()  # --kv-queue-weight 0.5 (default): A holds 62 tokens still to prefill
    urls, keys = route_burst(new)
    # 2nd: A costs 38 + 0.5 x (62 - 24 shared) + 0.1 x 78 = 64.8, B 62; 3rd: a tie (fewer requests, then
    # order); 4th: A 38 + 0.5 x 76 + 0.1 x 132 = 89.2 against B's 64.8
    assert urls == [A, B, A, B]
    dynamo = kv(queue_weight=1.0)  # Dynamo's weight spreads them the same way (2nd: A 83.8 against 62)
    assert route_burst(dynamo)[0] == [A, B, A, B]
    assert new.queued_tokens == {(A, None): 62 + 38, (B, None): 62 + 38}
    assert [k.queued for k in keys] == [62, 62, 38, 38]


def test_a_prefill_that_ended_no_longer_pushes_the_next_request_away():
    pol = kv()
    wa, wb = Worker(A), Worker(B)
    first = RouteKey("", turn0(0), 16)
    assert pol.select([wa, wb], first).url == A
    pol.prefilled(first)  # its stream's first bytes arrived: the prefill is over, it only decodes now
    assert pol.queued_tokens == {} and pol.queued_keys == {}
    assert pol.load_tokens == {(A, None): 78}  # still in flight
    pol.prefilled(first)  # a second call (the answer's end) takes nothing off again
    second = RouteKey("", turn0(1), 16)
    assert pol.select([wa, wb], second).url == A  # 38 + 0.1 x 78 = 45.8 < 62: the template's cache wins
    pol.release(second)  # a non-streamed answer ends: its prefill counts as ended too
    pol.release(first)
    assert pol.queued_tokens == {} and pol.queued_keys == {} and pol.load_tokens == {}


def test_a_conversation_stays_on_its_history_unless_the_queue_there_is_twice_as_long():
    def state():
        pol = kv()
        pol.tree.insert(RouteKey("", turn0(0)).tree_text(), A)  # conversation 0's first turn ran on A
        pol.tree.insert(RouteKey("", turn0(5)).tree_text(), A)  # and conversation 5's
        pol.tree.insert(RouteKey("", TEMPLATE).tree_text(), B)
        return pol

    wa, wb = Worker(A), Worker(B)
    history = turn0(0) + list(range(20_000, 20_061))  # turn 1: 123 tokens, its first 62 cached on A
    pol = state()
    key = RouteKey("", history, 16)
    assert pol.select([wa, wb], key).url == A and key.cached == 62  # 61 against B's 123 - 24 = 99
    pol = state()
    other = RouteKey("", turn0(5) + list(range(30_000, 30_061)), 16)
    assert pol.select([wa, wb], other).url == A and other.queued == 61  # conversation 5's turn 1, queued
    key = RouteKey("", history, 16)
    # A: 61 + 0.5 x 61 queued (it shares only the template, which both had cached) + 0.1 x 77 = 99.2; B: 99
    assert pol.select([wa, wb], key).url == B
    pol = state()
    pol.select([wa, wb], RouteKey("", turn0(5) + list(range(30_000, 30_040)), 16))  # a 40-token question queued
    key = RouteKey("", history, 16)
    assert pol.select([wa, wb], key).url == A  # A: 61 + 0.5 x 40 + 0.1 x 56 = 86.6 against B's 99


def test_the_shared_part_of_queued_prefill_is_counted_once():
    P = list(range(64))
    k = RouteKey("", P, 0)
    k.cached = 8  # its uncached part: tokens 8..63
    assert _shared_queued(P + [1], 64, [k]) == 56  # all of it is in the new request's cached prefix
    assert _shared_queued(P[:40] + [-1] * 30, 40, [k]) == 32  # up to where the prompts part
    assert _shared_queued(P[:20] + [-1] * 50, 64, [k]) == 12  # they part inside the queued range
    assert _shared_queued([-1] + P[1:], 64, [k]) == 0  # they part before it starts
    assert _shared_queued(P, 8, [k]) == 0  # the new request's cached prefix ends where k's work begins


def test_the_engines_waiting_uncached_tokens_count_while_fresh_less_what_this_router_saw_prefilled():
    doc = {"loads": [{"dp_rank": 0, "num_total_tokens": 90, "num_waiting_uncached_tokens": 70},
                     {"dp_rank": 1, "num_total_tokens": 0, "num_waiting_uncached_tokens": 0}]}
    assert ranks_waiting(doc) == {0: 70, 1: 0}
    assert ranks_waiting({"loads": [{"dp_rank": 0, "num_total_tokens": 5}]}) is None  # an engine without it
    pol = kv()
    el = pol.engine_loads = EngineLoads(1.0)
    wa, wb = Worker(A), Worker(B)
    pol.tree.insert(RouteKey("", TEMPLATE).tree_text(), A)
    now = time.monotonic()
    el.put(A, {0: 100}, now, waiting={0: 100})  # 100 foreign prompt tokens wait on A
    el.put(B, {0: 0}, now, waiting={0: 0})
    assert el.queued(A, None, now) == 100 and el.queued(A, 0, now) == 100 and el.queued(B, None, now) == 0
    key = RouteKey("", turn0(0), 16)
    assert pol.select([wa, wb], key).url == B  # A: 38 + 100 + 10 = 148 against 62
    pol.release(key)
    el.put(A, {0: 100}, now - 10.0, waiting={0: 100})  # stale: not used
    assert el.queued(A, None) is None
    assert pol.select([wa, wb], RouteKey("", turn0(1), 16)).url == A
    # this router's own request, sent before the figures were taken, finished its prefill after:
    el.put(A, {0: 100}, time.monotonic(), waiting={0: 100})
    el.prefilled(A, None, time.monotonic() - 5.0, 60)
    assert el.queued(A, None) == 40
    el.put(A, {0: 100}, time.monotonic())  # an answer without the field drops the waiting figure
    assert el.queued(A, None) is None


@pytest.mark.timeout(60)
async def test_the_router_ends_a_streams_queued_prefill_at_its_first_chunk(start_app, InProcessRouter):
    first_sent, go_on = asyncio.Event(), asyncio.Event()
    release_first = asyncio.Event()

    async def generate(request):
        await request.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await release_first.wait()  # the engine is still prefilling
        await resp.write(b'data: {"text": "a"}\n\n')
        first_sent.set()
        await go_on.wait()  # decoding
        await resp.write(b'data: {"text": "ab"}\n\ndata: [DONE]\n\n')
        await resp.write_eof()
        return resp

    async def health(_request):
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    runner, url = await start_app(app)
    try:
        async with InProcessRouter(worker_urls=[url], policy="kv_aware") as r, aiohttp.ClientSession() as s:
            pol = r.router.policy
            body = {"input_ids": list(range(10)), "stream": True, "sampling_params": {"max_new_tokens": 4}}
            # the router holds the answer's head back until its first body bytes: post in a task
            posted = asyncio.ensure_future(s.post(r.url + "/generate", json=body))
            for _ in range(500):
                if pol.queued_tokens:
                    break
                await asyncio.sleep(0.01)
            assert pol.queued_tokens == {(url, None): 10}  # routed, no byte of the answer yet
            release_first.set()
            async with await asyncio.wait_for(posted, 10) as resp:
                line = await asyncio.wait_for(resp.content.readline(), 10)
                assert line.startswith(b"data:") and first_sent.is_set()
                assert pol.queued_tokens == {} and pol.load_tokens == {(url, None): 14}  # decoding: load only
                go_on.set()
                await asyncio.wait_for(resp.read(), 10)
            for _ in range(200):
                if not pol.load_tokens:
                    break
                await asyncio.sleep(0.01)
            assert pol.load_tokens == {} and pol.queued_tokens == {}
    finally:
        go_on.set()
        release_first.set()
        await runner.cleanup()
