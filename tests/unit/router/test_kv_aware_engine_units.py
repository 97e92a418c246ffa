"""kv_aware's engine load figure in the router's units: the engine counts the cached prefixes of this
router's in-flight requests (it holds them), the router's load does not (policy._held_cached, held.py).
Running requests that share a cached prefix hold it once on the engine: their part is the union."""

import time
from types import SimpleNamespace

from fleetserve.router.kv_events.decode import BlockStored
from fleetserve.router.kv_events.loads import EngineLoads
from fleetserve.router.kv_events.policy import KvAwarePolicy, RouteKey
from fleetserve.router.workers import Worker

A, B = "http://a:1", "http://b:1"
P = list(range(1000, 1400))  # 100 blocks of 4: a conversation's history, held by A


def kv(**kw):
    pol = KvAwarePolicy(speculative_ttl_s=0, **kw)
    for url in (A, B):
        pol.subs[url] = {0: SimpleNamespace(state="exact")}
    pol.index.apply((A, 0), BlockStored(list(range(100)), None, P, 4))
    return pol


def hits_on_a(pol, n):
    """``n`` requests of this router that hit the 400 cached tokens on A (1 uncached token, 8 decode)."""
    keys = [RouteKey("", P + [i], 8) for i in range(n)]
    for k in keys:
        assert pol.select([Worker(A), Worker(B)], k).url == A and k.cached == 400
    return keys


def test_the_cached_prefixes_of_this_routers_hits_do_not_push_the_next_turn_off_its_cache():
    """Direct traffic keeps both engines' snapshots fresh; A's counts the whole prompts of the 12 hits
    this router sent there (12 x 401), which the router's load counts as 12 x (1 + 8).  Raw, A costs
    1 + 0.1 x 4812 = 482 against B's 401 + 0.1 x 600 = 461 and the conversation's next turn left its
    400 cached tokens; in the router's units A's figure is 4812 - 12 x 400 = 12, under its own 108."""
    pol = kv()
    el = pol.engine_loads = EngineLoads(1.0)
    keys = hits_on_a(pol, 12)
    now = time.monotonic() + 0.001  # the snapshot was taken after the 12 were sent
    el.put(A, {0: 12 * 401}, now)
    el.put(B, {0: 600}, now)  # a direct (foreign) request on B
    nxt = RouteKey("", P + [99], 8)
    assert pol.select([Worker(A), Worker(B)], nxt).url == A and nxt.cached == 400
    for k in keys:  # every answer ended: nothing of them is held or taken off any more
        pol.release(k)
    held = pol.held[(A, None)]
    assert list(held.waiting) == [nxt] and not held.running and held.waiting_tokens == 400


def test_traffic_the_router_did_not_send_still_counts_in_full():
    """Over the 12 hits, A's engine also holds 6000 tokens of direct requests: 1 + 0.1 x 6012 = 602
    against B's 461, so the request goes to B as it did before."""
    pol = kv()
    el = pol.engine_loads = EngineLoads(1.0)
    hits_on_a(pol, 12)
    now = time.monotonic() + 0.001
    el.put(A, {0: 12 * 401 + 6000}, now)
    el.put(B, {0: 600}, now)
    assert pol.select([Worker(A), Worker(B)], RouteKey("", P + [99], 8)).url == B


def test_requests_sent_after_the_snapshot_was_taken_are_not_taken_off():
    """The snapshot cannot count a request sent after its figures were taken: its cached prefix is not
    taken off (the router's own count holds it)."""
    from fleetserve.router.kv_events.policy import _held_cached

    pol = kv()
    el = pol.engine_loads = EngineLoads(1.0)
    asked = time.monotonic()
    keys = hits_on_a(pol, 3)  # sent while the poll was out
    el.put(A, {0: 5000}, time.monotonic(), asked=asked - 0.001)  # no timestamp: counts from when it was asked
    held = pol.held[(A, None)]
    assert _held_cached(held, el.counts_from(A)) == 0
    assert _held_cached(held, time.monotonic() + 1) == 3 * 400
    assert _held_cached(held, None) == 0
    assert _held_cached(held, keys[1].charged[2]) == 400  # only the first was sent before
    el.put(B, {0: 0})
    # A: 1 + 0.1 x 5000 = 501 against B's 401: the foreign load moves it, nothing was taken off
    assert pol.select([Worker(A), Worker(B)], RouteKey("", P + [99], 8)).url == B
    for k in keys:
        pol.release(k)
    assert (A, None) not in pol.held


def test_running_requests_that_share_a_prefix_are_taken_off_once():
    """12 streamed hits on A, all past their prefill (running): A's engine holds the 400 shared tokens
    once, their 12 own tokens and 5000 tokens of direct requests (5412).  Taken off once each (the sum,
    4800) the direct load would vanish (612: A costs 1 + 61) and the next turn would stay on A; taken
    off once (the union, 400) A's figure is 5012, 1 + 501 against B's 401 + 60: it goes to B."""
    from fleetserve.router.kv_events.policy import _held_cached

    pol = kv()
    el = pol.engine_loads = EngineLoads(1.0)
    keys = hits_on_a(pol, 12)
    for k in keys:
        pol.prefilled(k)
    held = pol.held[(A, None)]
    assert not held.waiting and len(held.running) == 12
    now = time.monotonic() + 0.001
    assert _held_cached(held, now) == 400
    el.put(A, {0: 400 + 12 + 5000}, now)
    el.put(B, {0: 600}, now)
    assert pol.select([Worker(A), Worker(B)], RouteKey("", P + [99], 8)).url == B


def test_an_ended_request_that_shared_its_prefix_frees_only_its_own_tokens():
    """One of 3 running hits on A ends after the snapshot: the engine frees its 1 own prompt token (the
    400 shared stay held by the other two), so 1 is taken off the engine's figure, not 401; the last
    one to end frees the 400 too."""
    pol = kv()
    el = pol.engine_loads = EngineLoads(1.0)
    keys = hits_on_a(pol, 3)
    for k in keys:
        pol.prefilled(k)
    el.put(A, {0: 403})  # taken after the 3 were sent
    pol.release(keys[0])
    assert el.tokens(A, None, time.monotonic() + 0.002) == 402
    pol.release(keys[1])
    assert el.tokens(A, None, time.monotonic() + 0.002) == 401
    pol.release(keys[2])
    assert el.tokens(A, None, time.monotonic() + 0.002) == 0
    assert (A, None) not in pol.held


def test_a_waiting_request_counts_whole_next_to_the_running_union():
    """Two running hits share the 400 (held once) and a third still waits (its whole prompt is in
    the engine's pending tokens): 400 + 400 are taken off."""
    pol = kv()
    keys = hits_on_a(pol, 3)
    pol.prefilled(keys[0])
    pol.prefilled(keys[1])
    held = pol.held[(A, None)]
    assert held.counted(time.monotonic() + 1) == 800
    pol.prefilled(keys[2])
    assert held.counted(time.monotonic() + 1) == 400


def test_the_cost_load_gauge_shows_the_figure_in_the_routers_units():
    """``fleetserve_router_kv_cost_load_tokens``: 12 running hits share 400 cached tokens on A; the
    engine reports 5412 (400 + 12 + 5000 direct), the router counts 12 x 9 = 108.  The gauge shows
    5012 (the engine's figure less the shared 400, once) where ``engine_load_tokens`` shows 5412; B,
    with no engine figure, shows the router's own count; both fall back to 0 once all have ended
    and the snapshots went stale."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_kv_aware_queue_metric import scrape as scrape_family

    def scrape(name):
        return scrape_family(pol, name)

    pol = kv()
    for url in (A, B):  # streams with the counters the families read
        pol.subs[url] = {0: SimpleNamespace(state="exact", events=0, batches=0, malformed=0, gaps=0, replays=0,
                                            replay_failures=0)}
    el = pol.engine_loads = EngineLoads(0.05)
    keys = hits_on_a(pol, 12)
    for k in keys:
        pol.prefilled(k)
    el.put(A, {0: 5412})
    other = RouteKey("", list(range(7000, 7050)), 10)
    assert pol.select([Worker(B)], other).url == B
    assert scrape("fleetserve_router_kv_cost_load_tokens") == {(A, "-"): 5012.0, (B, "-"): 60.0}
    assert scrape("fleetserve_router_kv_engine_load_tokens") == {(A, "0"): 5412.0}
    for k in keys + [other]:
        pol.release(k)
    time.sleep(0.2)  # the snapshot is stale after STALE_INTERVALS x 0.05 s
    assert scrape("fleetserve_router_kv_cost_load_tokens") == {(A, "-"): 0.0, (B, "-"): 0.0}
