"""kv_aware's load correction from the engines' ``/v1/loads``: used while fresh, ignored when stale."""

import contextlib
import logging
import time
from types import SimpleNamespace

from aiohttp import web

from fleetserve.router.kv_events.decode import BlockStored
from fleetserve.router.kv_events.loads import STALE_INTERVALS, EngineLoads, ranks_capacity, ranks_tokens
from fleetserve.router.kv_events.policy import KvAwarePolicy, RouteKey
from fleetserve.router.workers import Worker

A, B = "http://a:1", "http://b:1"
P = list(range(1000, 1032))  # 8 blocks of 4


def kv(states, **kw):
    pol = KvAwarePolicy(speculative_ttl_s=0, **kw)
    for url, st in states.items():
        pol.subs[url] = {r: SimpleNamespace(state=s) for r, s in enumerate(st)}
    return pol


@contextlib.asynccontextmanager
async def one_loads_worker(start_app, handler):
    """A worker answering ``GET /v1/loads`` with ``handler`` and a router stub that knows only it:
    yields ``(url, router)``."""
    import aiohttp

    app = web.Application()
    app.router.add_get("/v1/loads", handler)
    runner, url = await start_app(app)
    try:
        async with aiohttp.ClientSession() as session:
            yield url, SimpleNamespace(session=session, own_headers=lambda url: {}, registry=SimpleNamespace(urls=lambda: [url]))
    finally:
        await runner.cleanup()


def test_ranks_tokens_reads_num_total_tokens_per_rank():
    doc = {"timestamp": "x", "dp_rank_count": 2, "loads": [
        {"dp_rank": 0, "num_running_reqs": 1, "num_total_tokens": 700},
        {"dp_rank": 1, "num_running_reqs": 0, "num_total_tokens": 0}], "aggregate": {"total_tokens": 700}}
    assert ranks_tokens(doc) == {0: 700, 1: 0}
    assert ranks_tokens({"loads": [{"dp_rank": 0, "num_total_tokens": "many"}]}) is None
    assert ranks_tokens({"detail": "Not Found"}) is None and ranks_tokens([1, 2]) is None


def test_fresh_engine_load_moves_a_request_off_a_busy_worker_and_stale_does_not():
    pol = kv({A: ["exact"], B: ["exact"]})
    pol.index.apply((A, 0), BlockStored(list(range(8)), None, P, 4))
    el = pol.engine_loads = EngineLoads(1.0)
    now = time.monotonic()
    # A holds 28 of the prompt's tokens (cost 33 - 28 = 5), B none (33); A's engine is busy with 1000
    # foreign tokens: 5 + 0.1 x 1000 = 105 at the default load weight
    el.put(A, {0: 1000}, now)
    el.put(B, {0: 0}, now)
    key = RouteKey("", P + [1], 0)
    assert pol.select([Worker(A), Worker(B)], key).url == B
    pol.release(key)
    # the same snapshot, stale: the router-side count (0) decides, and the cache wins
    el.put(A, {0: 1000}, now - STALE_INTERVALS * 1.0 - 0.1)
    key = RouteKey("", P + [1], 0)
    assert pol.select([Worker(A), Worker(B)], key).url == A
    assert el.tokens(A, None) is None and el.tokens(B, None) == 0


def test_router_side_count_wins_when_larger_and_ranks_are_summed_or_apart():
    el = EngineLoads(1.0)
    el.put(A, {0: 10, 1: 30})
    assert el.tokens(A, None) == 40 and el.tokens(A, 1) == 30 and el.tokens(A, 2) is None
    pol = kv({A: ["exact", "exact"]}, dp_aware=True)
    pol.engine_loads = el
    key = RouteKey("", [7] * 9, 0)
    assert pol.select([Worker(A)], key).url == A and key.rank == 0  # rank 0: 10 < 30
    pol.load_tokens[(A, 0)] = 50  # this router has more in flight on rank 0 than the engine reported
    key2 = RouteKey("", [8] * 9, 0)
    pol.select([Worker(A)], key2)
    assert key2.rank == 1  # max(50, 10) on rank 0 > max(0, 30) on rank 1


async def test_poll_asks_v1_loads_and_retries_a_worker_without_it_later(start_app):
    async def loads(_req):
        return web.json_response({"loads": [{"dp_rank": 0, "num_total_tokens": 123}]})

    app = web.Application()
    app.router.add_get("/v1/loads", loads)
    runner, good = await start_app(app)
    runner2, bad = await start_app(web.Application())  # 404 on /v1/loads
    import aiohttp
    try:
        async with aiohttp.ClientSession() as session:
            router = SimpleNamespace(session=session, own_headers=lambda url: {}, registry=SimpleNamespace(urls=lambda: [good, bad]))
            el = EngineLoads(0.5)
            await el.poll(router)
            assert el.tokens(good, None) == 123 and el.tokens(bad, None) is None
            assert (el.polls, el.failures) == (2, 1)
            await el.poll(router)  # the worker without /v1/loads is not asked again so soon
            assert (el.polls, el.failures) == (3, 1)
            router.registry = SimpleNamespace(urls=lambda: [bad])
            await el.poll(router)
            assert good not in el.snapshots  # removed workers are forgotten
    finally:
        await runner.cleanup()
        await runner2.cleanup()


def test_the_worker_holding_the_prefix_wins_with_an_idle_fresh_snapshot():
    pol = kv({A: ["exact"], B: ["exact"]})
    pol.index.apply((A, 0), BlockStored(list(range(8)), None, P, 4))
    el = pol.engine_loads = EngineLoads(1.0)
    el.put(A, {0: 0})
    el.put(B, {0: 0})
    key = RouteKey("", P + [1], 0)
    assert pol.select([Worker(B), Worker(A)], key).url == A and key.cached == 32  # cost 1 against 33


def test_a_snapshot_counting_this_routers_ended_request_does_not_push_the_next_one_away():
    """The bug seen with a real engine: a snapshot taken while a request ran stayed in use after it ended."""
    pol = kv({A: ["exact"], B: ["exact"]}, load_weight=1.0)  # one in-flight token costs one uncached token
    pol.index.apply((A, 0), BlockStored(list(range(8)), None, P, 4))
    el = pol.engine_loads = EngineLoads(1.0)
    first = RouteKey("", P + [1], 8)
    assert pol.select([Worker(A), Worker(B)], first).url == A
    # polled while it ran: A's engine holds its 33 prompt tokens and 7 generated ones
    el.put(A, {0: 40})
    el.put(B, {0: 0})
    assert el.tokens(A, None) == 40
    pol.release(first)  # its answer ended: the snapshot still counts it, the router knows better
    assert el.tokens(A, None) == 40 - 33
    second = RouteKey("", P + [2], 8)
    assert pol.select([Worker(A), Worker(B)], second).url == A  # 1 + 7 < 33
    # sent after the poll was asked, it may not be in the snapshot: nothing is taken off for it
    pol.release(second)
    assert el.tokens(A, None) == 7
    # foreign load (no request of this router ended) still steers away, as before
    el.put(A, {0: 40})
    assert pol.select([Worker(A), Worker(B)], RouteKey("", P + [3], 8)).url == B


def test_ended_requests_are_taken_off_their_own_rank_with_dp_aware():
    el = EngineLoads(1.0)
    el.put(A, {0: 50, 1: 50})
    el.ended(A, 1, time.monotonic() - 5, 30)
    assert (el.tokens(A, 0), el.tokens(A, 1), el.tokens(A, None)) == (50, 20, 70)
    el.ended(A, 1, time.monotonic() - 5, 500)
    assert el.tokens(A, 1) == 0  # never below 0
    el.put(A, {0: 50, 1: 50})
    assert el.tokens(A, 1) == 50  # a new snapshot starts afresh


async def test_a_failed_poll_drops_the_snapshot_and_a_slow_worker_is_asked_again_next_time(start_app):
    import asyncio

    answers = [(0, 500), (1.5, 900), (0, 0)]  # (delay in s, num_total_tokens) per call

    async def loads(_req):
        delay, n = answers.pop(0)
        await asyncio.sleep(delay)
        return web.json_response({"loads": [{"dp_rank": 0, "num_total_tokens": n}]})

    async with one_loads_worker(start_app, loads) as (url, router):
        el = EngineLoads(0.2)  # each ask times out after 0.5 s
        await el.poll(router)
        assert el.tokens(url, None) == 500
        await el.poll(router)  # too slow: the 500 of before is not kept as if it were still true
        assert el.tokens(url, None) is None and url not in el.snapshots
        assert (el.polls, el.failures) == (2, 1)
        await el.poll(router)  # a slow worker has the endpoint: asked again at the next interval
        assert el.tokens(url, None) == 0 and (el.polls, el.failures) == (3, 1)


def test_taken_at_is_the_oldest_entry_timestamp():
    from fleetserve.router.kv_events.loads import taken_at

    # SGLang's entries: "timestamp": time.time() of the scheduler (a float, seconds since the epoch)
    doc = {"timestamp": "2026-12-01T19:00:00+00:00", "loads": [
        {"dp_rank": 0, "timestamp": 1710000002.5, "num_total_tokens": 1},
        {"dp_rank": 1, "timestamp": 1710000001.0, "num_total_tokens": 2}]}
    assert taken_at(doc) == 1710000001.0
    assert taken_at({"loads": [{"dp_rank": 0, "num_total_tokens": 1}]}) is None  # an older engine: none
    assert taken_at({"loads": [{"timestamp": "now"}, {"timestamp": float("nan")}, {"timestamp": True}]}) is None


def test_a_snapshot_taken_long_ago_is_stale_on_arrival():
    el = EngineLoads(1.0)
    now = time.monotonic()
    el.put(A, {0: 500}, now, asked=now - 0.01, taken=now - STALE_INTERVALS * 1.0 - 0.5)
    assert el.tokens(A, None, now) is None  # it just arrived, but its figures are 3.5 s old
    el.put(A, {0: 500}, now, asked=now - 0.01, taken=now - 0.5)
    assert el.tokens(A, None, now) == 500
    # a request sent after the poll went out but before the engine took the figures is in them:
    # its end takes its prompt off (without a timestamp, only requests sent before the poll are)
    el.put(A, {0: 500}, now, asked=now - 2.0, taken=now - 1.0)
    el.ended(A, None, sent=now - 1.5, tokens=100, now=now + 0.1)
    assert el.tokens(A, None, now + 0.1) == 400
    el.put(A, {0: 500}, now, asked=now - 2.0)
    el.ended(A, None, sent=now - 1.5, tokens=100, now=now + 0.1)
    assert el.tokens(A, None, now + 0.1) == 500


def test_figures_kept_between_changes_equal_the_figures_computed_afresh():
    """figures() keeps each target's answer until the url's snapshot changes or a request ends or
    finishes its prefill there; random puts, ends, prefills, forgets and clock steps on 2 workers of
    2 ranks: at every step it answers what tokens() and queued() compute from scratch."""
    import random

    rng = random.Random(2)
    for _ in range(200):
        el = EngineLoads(1.0)
        now = 1000.0
        for _ in range(60):
            url = rng.choice((A, B))
            rank = rng.choice((None, 0, 1))
            op = rng.random()
            if op < 0.2:
                waiting = {r: rng.randrange(300) for r in (0, 1)} if rng.random() < 0.7 else None
                el.put(url, {r: rng.randrange(2000) for r in (0, 1)}, now, asked=now - rng.choice((0.0, 0.5)),
                       taken=now - 0.3 if rng.random() < 0.5 else None, waiting=waiting)
            elif op < 0.45:
                el.ended(url, rank, sent=now - rng.choice((0.1, 1.0, 2.0)), tokens=rng.randrange(200), now=now)
            elif op < 0.7:
                el.prefilled(url, rank, sent=now - rng.choice((0.1, 1.0, 2.0)), tokens=rng.randrange(200), now=now)
            elif op < 0.75:
                el.forget(url)
            else:
                now += rng.choice((0.05, 0.5, 1.5))
            for u in (A, B):
                for r in (None, 0, 1):
                    assert el.figures(u, r, now) == (el.tokens(u, r, now), el.queued(u, r, now))


async def test_poll_reads_the_engines_timestamp_for_freshness(start_app):
    stamp = [time.time()]

    async def loads(_req):
        return web.json_response({"loads": [{"dp_rank": 0, "timestamp": stamp[0], "num_total_tokens": 77}]})

    async with one_loads_worker(start_app, loads) as (url, router):
        el = EngineLoads(0.5)
        await el.poll(router)
        assert el.tokens(url, None) == 77  # taken just now
        stamp[0] = time.time() - 10.0  # the engine serves a figure 10 s old (e.g. a cached one)
        await el.poll(router)
        assert el.tokens(url, None) is None and url in el.snapshots  # answered, but stale
        stamp[0] = time.time() + 30.0  # a clock ahead of ours: taken on arrival, not in the future
        await el.poll(router)
        assert el.tokens(url, None) == 77
        assert el.snapshots[url][3] == el.snapshots[url][0]


def test_ranks_capacity_reads_max_total_num_tokens_per_rank():
    doc = {"loads": [{"dp_rank": 0, "max_total_num_tokens": 4096}, {"dp_rank": 1, "max_total_num_tokens": 2048},
                     {"dp_rank": 2, "max_total_num_tokens": "big"}, "junk"]}
    assert ranks_capacity(doc) == {0: 4096, 1: 2048}
    assert ranks_capacity({"loads": [{"dp_rank": 0, "max_total_num_tokens": 0}]}) == {}
    el = EngineLoads(1.0)
    el.pools[A] = {0: 4096, 1: 2048}
    assert el.capacity(A, None) == 6144 and el.capacity(A, 1) == 2048 and el.capacity(B, 0) is None
    el.forget(A)
    assert el.capacity(A, 0) is None


def test_a_full_kv_pool_sends_the_prefix_holders_next_request_elsewhere():
    # A holds 32 of the 33 prompt tokens (all it can: prompt[:-1]); B none (cost 33).
    pol = kv({A: ["exact"], B: ["exact"]}, overflow_weight=1.0)  # --kv-overflow-weight 1 (default 0)
    pol.index.apply((A, 0), BlockStored(list(range(8)), None, P, 4))
    el = pol.engine_loads = EngineLoads(1.0)
    now = time.monotonic()
    el.pools[A] = el.pools[B] = {0: 2048}
    el.put(A, {0: 200}, now)  # 1 + 0.1 x 200 = 21 < 33: the cache wins, and 200 + 1 + 128 fits in 2048
    el.put(B, {0: 0}, now)
    key = RouteKey("", P + [1], 128)
    assert pol.select([Worker(A), Worker(B)], key).url == A and key.cached == 32
    pol.release(key)
    # the same 200 tokens, but a pool of 300: 200 + 1 + 128 = 329 is 29 over -> 21 + 29 = 50 > 33: B
    el.pools[A] = {0: 300}
    key = RouteKey("", P + [1], 128)
    assert pol.select([Worker(A), Worker(B)], key).url == B
    pol.release(key)
    # without the engine's pool size (a worker whose /v1/loads lacks it) the cache wins again
    del el.pools[A]
    key = RouteKey("", P + [1], 128)
    assert pol.select([Worker(A), Worker(B)], key).url == A


def test_overflow_weight_zero_turns_the_pool_term_off():
    pol = kv({A: ["exact"], B: ["exact"]}, overflow_weight=0.0)
    pol.index.apply((A, 0), BlockStored(list(range(8)), None, P, 4))
    el = pol.engine_loads = EngineLoads(1.0)
    now = time.monotonic()
    el.pools[A] = el.pools[B] = {0: 300}
    el.put(A, {0: 200}, now)
    el.put(B, {0: 0}, now)
    key = RouteKey("", P + [1], 128)
    assert pol.select([Worker(A), Worker(B)], key).url == A  # 21 < 33: the 29 tokens over A's pool are not counted


def test_the_pool_term_counts_the_cached_prefixes_in_flight_requests_need(caplog):
    """A's pool (1600 tokens) must keep the 1596-token prefix a waiting request of this router was
    routed on: a second request whose 496 cached tokens are on A no longer fits there beside it (its
    whole prompt and budget, 516, on top of 20 + 1596), so it goes to B, which has room, although A
    holds its prefix.  Counting only what the requests add (their uncached tokens and budgets, 40 of
    1600) kept it on A, where one of the two prefixes would be evicted before its prefill."""
    big, small = list(range(2000, 3600)), list(range(5000, 5500))
    pol = kv({A: ["exact"], B: ["exact"]}, overflow_weight=1.0)
    pol.index.apply((A, 0), BlockStored(list(range(400)), None, big, 4))
    pol.index.apply((A, 0), BlockStored(list(range(1000, 1125)), None, small, 4))
    el = pol.engine_loads = EngineLoads(1.0)
    el.pools[A] = el.pools[B] = {0: 1600}
    first = RouteKey("", big, 16)
    assert pol.select([Worker(A), Worker(B)], first).url == A and first.cached >= 1596  # waiting: in flight
    second = RouteKey("", small, 16)
    with caplog.at_level(logging.DEBUG, logger="fleetserve.router"):
        assert pol.select([Worker(A), Worker(B)], second).url == B and second.cached == 0
    # the debug log names the term: A is over its pool by (load + pinned + 516) - 1600 tokens, B not at all
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_aware cost:"))
    a_part, b_part = (p for p in line.split(" | ") if p.startswith(("http://a", "http://b")))
    over = float(a_part.split(" overflow=")[1].split()[0])
    assert over >= 1596 + 516 - 1600 and "overflow=" not in b_part
    pol.release(second)
    pol.release(first)  # nothing in flight on A now: its pool has room for the second prompt again
    third = RouteKey("", small, 16)
    assert pol.select([Worker(A), Worker(B)], third).url == A and third.cached >= 496


def test_a_pool_term_without_loads_polling_is_one_start_up_warning(caplog):
    """The pool sizes come from /v1/loads: with polling off the term could never count, so the router
    says so once at start (and not when either setting leaves the term meaningful)."""
    from fleetserve.router.config import parse_args
    from fleetserve.router.kv_events.flags import make_kv_aware

    argv = ["--policy", "kv_aware", "--worker-urls", "http://127.0.0.1:9"]
    with caplog.at_level(logging.WARNING, logger="fleetserve.router"):
        make_kv_aware(parse_args(argv + ["--kv-overflow-weight", "1", "--kv-loads-interval-secs", "0"]))
        said = [r.getMessage() for r in caplog.records]
        make_kv_aware(parse_args(argv + ["--kv-overflow-weight", "1"]))
        make_kv_aware(parse_args(argv + ["--kv-loads-interval-secs", "0"]))
    assert len(said) == 1 and "--kv-overflow-weight 1 has no effect with --kv-loads-interval-secs 0" in said[0]
    assert len(caplog.records) == 1
