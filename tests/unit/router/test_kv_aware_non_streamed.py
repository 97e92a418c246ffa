"""kv_aware and non-streamed requests: an engine snapshot's ``num_waiting_reqs`` ends their queued
prefill (``KvAwarePolicy.engine_snapshot``), since no first answer byte ever tells the router."""

import time
from types import SimpleNamespace

from fleetserve.router.kv_events.decode import BlockStored
from fleetserve.router.kv_events.loads import EngineLoads, ranks_waiting_reqs
from fleetserve.router.kv_events.policy import KNOWN_AFTER_S, KvAwarePolicy, RouteKey
from fleetserve.router.workers import Worker

A, B = "http://a:1", "http://b:1"
P = list(range(1000, 1032))  # 8 blocks of 4


def key(first: int, n: int, decode: int = 16, streamed: bool = False) -> RouteKey:
    k = RouteKey("", list(range(first, first + n)), decode)
    k.streamed = streamed
    return k


def policy(**kw) -> tuple[KvAwarePolicy, EngineLoads]:
    pol = KvAwarePolicy(speculative_ttl_s=0, **kw)
    pol.engine_loads = el = EngineLoads(1.0)
    return pol, el


def later(s: float) -> float:
    """A monotonic time ``s`` seconds from now (a snapshot taken then counts what was sent before)."""
    return time.monotonic() + s


def test_ranks_waiting_reqs_reads_num_waiting_reqs_per_rank():
    doc = {"loads": [{"dp_rank": 0, "num_waiting_reqs": 3, "num_total_tokens": 9},
                     {"dp_rank": 1, "num_waiting_reqs": 0}, {"dp_rank": 2, "num_waiting_reqs": "x"}]}
    assert ranks_waiting_reqs(doc) == {0: 3, 1: 0}
    assert ranks_waiting_reqs({"loads": [{"num_waiting_reqs": -1}]}) is None
    assert ranks_waiting_reqs({"detail": "Not Found"}) is None and ranks_waiting_reqs([]) is None


def test_all_but_the_last_w_known_non_streamed_requests_leave_the_queue():
    pol, el = policy()
    wa = Worker(A)
    keys = [key(100 * i, 50 + i) for i in range(1, 4)]  # 51, 52, 53 uncached tokens, sent in that order
    for k in keys:
        pol.select([wa], k)
    assert pol.queued_tokens[(A, None)] == 51 + 52 + 53
    el.put(A, {0: 500}, later(KNOWN_AFTER_S + 1), waiting={0: 53}, waiting_reqs={0: 1})
    # one request waits at the engine: at most the last one sent is it; the two before are admitted
    assert pol.queued_tokens[(A, None)] == 53
    assert [k.queued for k in keys] == [0, 0, 53] and pol.inferred_prefills == 2
    # the engine's own waiting figure did not count the admitted ones: nothing is taken off it
    assert el.figures(A, None, later(KNOWN_AFTER_S + 1))[1] == 53
    el.put(A, {0: 500}, later(KNOWN_AFTER_S + 2), waiting={0: 0}, waiting_reqs={0: 0})
    assert (A, None) not in pol.queued_tokens and pol.inferred_prefills == 3
    for k in keys:
        pol.release(k)
    assert pol.load_tokens == {} and pol.inflight == {} and pol.held == {}


def test_streamed_recent_and_unreported_requests_stay_queued():
    pol, el = policy()
    wa = Worker(A)
    streamed, plain = key(100, 40, streamed=True), key(200, 30)
    pol.select([wa], streamed)
    pol.select([wa], plain)
    # figures taken just now: the requests may not have reached the engine's queue yet
    el.put(A, {0: 0}, waiting={0: 0}, waiting_reqs={0: 0})
    assert pol.queued_tokens[(A, None)] == 70 and pol.inferred_prefills == 0
    # an engine without num_waiting_reqs (e.g. vLLM has no /v1/loads at all): nothing to infer from
    el.put(A, {0: 0}, later(KNOWN_AFTER_S + 1), waiting={0: 0})
    assert pol.queued_tokens[(A, None)] == 70
    # known to the engine and none waiting: the non-streamed one is admitted; the streamed one ends at
    # its first answer bytes (prefilled), which the router sees itself
    el.put(A, {0: 0}, later(KNOWN_AFTER_S + 1), waiting={0: 0}, waiting_reqs={0: 0})
    assert pol.queued_tokens[(A, None)] == 40 and streamed.queued == 40 and plain.queued == 0


def test_prepare_marks_a_request_streamed_from_its_body():
    import asyncio

    pol = KvAwarePolicy()
    for body, streamed in (({"prompt": [1, 2, 3], "stream": True}, True), ({"prompt": [1, 2, 3]}, False),
                           ({"prompt": [1, 2, 3], "stream": "yes"}, False)):
        k = asyncio.run(pol.prepare("/v1/completions", body, "x"))
        assert k.tokens == [1, 2, 3] and k.streamed is streamed


def test_dp_aware_ranks_count_their_own_waiting_requests():
    pol, el = policy(dp_aware=True)
    pol.subs[A] = {r: SimpleNamespace(state="exact") for r in (0, 1)}
    wa = Worker(A)
    keys = [key(100 * i, 20) for i in range(1, 5)]
    for k in keys:
        pol.select([wa], k)
    ranks = [k.rank for k in keys]
    assert sorted(ranks) == [0, 0, 1, 1]  # ties spread over the ranks
    el.put(A, {0: 0, 1: 0}, later(KNOWN_AFTER_S + 1), waiting_reqs={0: 1, 1: 0})
    # rank 0 keeps its later request queued, rank 1 none
    assert pol.queued_tokens == {(A, 0): 20}
    last0 = [k for k in keys if k.rank == 0][-1]
    assert last0.queued == 20 and pol.inferred_prefills == 3


def test_an_admitted_non_streamed_request_no_longer_pushes_a_hit_away():
    """A holds 32 of the next prompt's 33 tokens; a non-streamed request of 200 uncached tokens is on A,
    in its decode steps.  Counted as queued prefill (0.5 x 200) it sends the hit to the idle B (cost 33
    against 1 + 100 + 0.1 x 216); once a snapshot shows A's queue empty, the hit stays on A (22.6)."""
    def setup():
        pol, el = policy()
        pol.subs[A] = {0: SimpleNamespace(state="exact")}
        pol.subs[B] = {0: SimpleNamespace(state="exact")}
        pol.index.apply((A, 0), BlockStored(list(range(8)), None, P, 4))
        busy = key(5000, 200)
        pol.select([Worker(A)], busy)
        return pol, el

    pol, el = setup()
    assert pol.select([Worker(A), Worker(B)], RouteKey("", P + [1], 0)).url == B
    pol, el = setup()
    for url in (A, B):
        el.put(url, {0: 0}, later(KNOWN_AFTER_S + 1), waiting={0: 0}, waiting_reqs={0: 0})
    nxt = RouteKey("", P + [1], 0)
    assert pol.select([Worker(A), Worker(B)], nxt).url == A and nxt.cached == 32
