"""kv_aware's engine load figure in the router's units: the engine counts the cached prefixes of this
router's in-flight requests (it holds them), the router's load does not (policy._held_cached)."""

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
    assert pol.inflight_keys == {(A, None): {nxt: None}} and pol.held_tokens == {(A, None): 400}


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
    held = pol.inflight_keys[(A, None)]
    assert _held_cached(held, el.counts_from(A)) == 0
    assert _held_cached(held, time.monotonic() + 1) == 3 * 400
    assert _held_cached(held, None) == 0
    assert _held_cached(held, time.monotonic() + 1, pol.held_tokens[(A, None)]) == 3 * 400
    assert _held_cached(held, keys[1].charged[2], 3 * 400) == 400  # only the first was sent before
    assert _held_cached(held, keys[1].charged[2]) == 400
    el.put(B, {0: 0})
    # A: 1 + 0.1 x 5000 = 501 against B's 401: the foreign load moves it, nothing was taken off
    assert pol.select([Worker(A), Worker(B)], RouteKey("", P + [99], 8)).url == B
    for k in keys:
        pol.release(k)
    assert (A, None) not in pol.inflight_keys and (A, None) not in pol.held_tokens
