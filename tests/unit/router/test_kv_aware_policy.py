"""The kv_aware cost on hand-built states: cost = wp x uncached + wl x load tokens; trust; speculation."""

from types import SimpleNamespace

from fleetserve.router.kv_events.decode import BlockStored
from fleetserve.router.kv_events.policy import DEFAULT_DECODE_TOKENS, KvAwarePolicy, RouteKey, decode_budget
from fleetserve.router.workers import Worker

A, B = "http://a:1", "http://b:1"
P = list(range(1000, 1032))  # 32 tokens = 8 blocks of 4


def policy(states=None, **kw):
    pol = KvAwarePolicy(**kw)
    for url, st in (states or {}).items():
        pol.subs[url] = {r: SimpleNamespace(state=s) for r, s in enumerate(st)}
    return pol


def store(pol, url, tokens, rank=0):
    pol.index.apply((url, rank), BlockStored(list(range(len(tokens) // 4)), None, tokens[:len(tokens) // 4 * 4], 4))


def test_cached_prefix_wins_and_the_decision_is_recorded():
    pol = policy({A: ["exact"], B: ["exact"]}, speculative_ttl_s=0)
    store(pol, B, P)
    wa, wb = Worker(A), Worker(B)
    key = RouteKey("", P + [1, 2], decode_tokens=10)
    assert pol.select([wa, wb], key) is wb
    assert (key.target, key.branch, key.cached) == ((B, None), "exact", 32)
    assert pol.load_tokens == {(B, None): 34 - 32 + 10}  # the KV it adds on B: uncached prompt + decode
    pol.release(key)
    assert pol.load_tokens == {} and pol.inflight == {}


def test_load_in_tokens_outweighs_a_short_match():
    pol = policy({A: ["exact"], B: ["exact"]}, speculative_ttl_s=0, load_weight=1.0)
    store(pol, B, P[:8])  # 8 cached tokens on B
    pol.load_tokens[(B, None)] = 20  # but 20 tokens in flight there: B costs 34 - 8 + 20 = 46 > A's 34
    assert pol.select([Worker(A), Worker(B)], RouteKey("", P + [1, 2], 0)).url == A
    pol2 = policy({A: ["exact"], B: ["exact"]}, speculative_ttl_s=0, load_weight=0.1)
    store(pol2, B, P[:8])
    pol2.load_tokens[(B, None)] = 20  # with --kv-load-weight 0.1: 26 + 2 = 28 < 34
    assert pol2.select([Worker(A), Worker(B)], RouteKey("", P + [1, 2], 0)).url == B


def test_ties_go_to_fewer_requests_in_flight_then_the_least_recently_chosen():
    pol = policy({A: ["exact"], B: ["exact"]}, speculative_ttl_s=0)
    wa, wb = Worker(A), Worker(B)
    first = RouteKey("", [1, 2, 3], 0)
    assert pol.select([wa, wb], first).url == A  # neither chosen yet: registration order
    pol.release(first)  # its prefill and decode are over: no load tokens, no queued prefill left
    wa.load = 0
    wb.load = 1  # fewer requests in flight beats "least recently chosen" (B was never chosen)
    second = RouteKey("", [7, 8, 9], 0)
    assert pol.select([wa, wb], second).url == A
    pol.release(second)
    wb.load = 0
    assert pol.select([wa, wb], RouteKey("", [4, 5, 6], 0)).url == B  # an exact tie: B waited longer


def test_sequential_new_prompts_with_nothing_in_flight_spread_over_every_worker():
    """Nothing cached anywhere, each answer over before the next request: every cost ties."""
    C = "http://c:1"
    for states in ({A: ["exact"], B: ["exact"], C: ["exact"]}, {}):  # with KV-event streams, and without
        pol = policy(states, speculative_ttl_s=0)
        workers = [Worker(A), Worker(B), Worker(C)]
        got = []
        for i in range(6):
            key = RouteKey("", [100 * i + t for t in range(8)], 16)
            got.append(pol.select(workers, key).url)
            pol.release(key)
        assert got == [A, B, C, A, B, C]
    pol.on_worker_removed(A)
    assert set(pol.chosen_at) == {(B, None), (C, None)}


def test_fallback_uses_the_tree_and_exact_ignores_it():
    pol = policy({A: ["fallback"], B: ["exact"]}, speculative_ttl_s=0)
    pol.tree.insert(RouteKey("", P).tree_text(), A)
    pol.tree.insert(RouteKey("", P).tree_text(), B)  # the router sent it to B too, but B's engine says no
    key = RouteKey("", P, 0)
    assert pol.select([Worker(A), Worker(B)], key).url == A
    assert (key.branch, key.cached) == ("fallback", 31)  # at most prompt[:-1]: the engine computes the last token


def test_degraded_takes_the_larger_of_index_and_tree():
    pol = policy({A: ["degraded"], B: ["exact"]}, speculative_ttl_s=0)
    store(pol, A, P[:8])
    store(pol, B, P[:16])
    pol.tree.insert(RouteKey("", P[:24]).tree_text(), A)
    key = RouteKey("", P, 0)
    assert pol.select([Worker(A), Worker(B)], key).url == A
    assert (key.branch, key.cached) == ("degraded", 24)


def test_a_burst_of_one_new_prefix_follows_the_first_request():
    pol = policy({A: ["exact"], B: ["exact"]}, speculative_ttl_s=5.0, load_weight=0.01)
    store(pol, A, [0, 0, 0, 0])  # block sizes are known from the first events
    store(pol, B, [0, 0, 0, 0])
    wa, wb = Worker(A), Worker(B)
    first = pol.select([wa, wb], RouteKey("", P, 0))
    for _ in range(5):
        assert pol.select([wa, wb], RouteKey("", P + [9], 0)) is first
    off = policy({A: ["exact"], B: ["exact"]}, speculative_ttl_s=0.0)
    store(off, A, [0, 0, 0, 0])
    store(off, B, [0, 0, 0, 0])
    keys = [RouteKey("", P, 0) for _ in range(4)]
    # without speculation the burst still follows the first while its prefill is pending there
    assert {off.select([wa, wb], k).url for k in keys} == {first.url}
    for k in keys:
        off.release(k)
    got = set()
    for _ in range(4):
        k = RouteKey("", P, 0)
        got.add(off.select([wa, wb], k).url)
        off.prefilled(k)  # prefilled, no event yet and no speculative entries: nothing says where P is
    assert got == {A, B}  # so the load spreads them


def test_dp_aware_picks_a_rank_and_without_it_a_worker_takes_its_best_rank():
    pol = policy({A: ["exact", "exact"]}, speculative_ttl_s=0, dp_aware=True)
    store(pol, A, P, rank=1)
    key = RouteKey("", P, 0)
    assert pol.select([Worker(A)], key).url == A and key.rank == 1 and key.cached == 28  # 7 blocks: prompt[:-1]
    pol2 = policy({A: ["exact", "exact"], B: ["exact"]}, speculative_ttl_s=0)
    store(pol2, A, P, rank=1)
    key = RouteKey("", P, 0)
    assert pol2.select([Worker(B), Worker(A)], key).url == A and key.rank is None and key.cached == 28


def test_a_client_named_rank_is_charged_where_the_engine_runs_it_before_the_ranks_are_known():
    """Helper trial: right after start (no KV-event stream, no ``/get_server_info`` dp_size yet) a
    client's ``routed_dp_rank`` 1 ran on rank 1 while the route header and the load said rank 0."""
    pol = policy(speculative_ttl_s=0, dp_aware=True)
    assert not pol.ranks_known(A) and tuple(pol.ranks(A)) == (0,)
    key = RouteKey("", P, 16)
    key.client_rank = 1
    assert pol.select([Worker(A)], key).url == A and key.rank == 1
    assert pol.load_tokens == {(A, 1): len(P) + 16} and pol.inflight == {(A, 1): 1}
    assert "; dp_rank=1;" in key.route_header()
    pol.release(key)
    assert pol.load_tokens == {} and pol.inflight == {}
    # ranks known and without it: the engine refuses the rank (400), so it is routed as if none was named
    pol.dp_ranks[A] = (0,)
    key = RouteKey("", P, 16)
    key.client_rank = 1
    assert pol.select([Worker(A)], key).url == A and key.rank == 0
    pol.release(key)
    # known and with it: that rank, whichever rank the cost would prefer
    pol.dp_ranks[A] = (0, 1)
    pol.load_tokens[(A, 1)] = 10_000
    key = RouteKey("", P, 16)
    key.client_rank = 1
    assert pol.select([Worker(A)], key).url == A and key.rank == 1
    # two workers, one known without rank 1, one not known yet: only the second can run it
    pol.dp_ranks[A] = (0,)
    key = RouteKey("", P, 16)
    key.client_rank = 1
    assert pol.select([Worker(A), Worker(B)], key).url == B and key.rank == 1


def test_text_without_tokens_is_routed_on_the_tree_in_token_units():
    pol = policy({}, speculative_ttl_s=0)
    text = "x" * 400
    k1 = RouteKey(text)
    assert k1.prompt_tokens == 100
    w = pol.select([Worker(A), Worker(B)], k1)
    pol.release(k1)
    k2 = RouteKey(text + "y")
    assert pol.select([Worker(A), Worker(B)], k2).url == w.url and k2.cached == 100


def test_decode_budget():
    assert decode_budget({"max_tokens": 7}) == 7
    assert decode_budget({"max_completion_tokens": 9, "max_tokens": 7}) == 9
    assert decode_budget({"sampling_params": {"max_new_tokens": 5}}) == 5
    assert decode_budget({}) == DEFAULT_DECODE_TOKENS
    assert decode_budget({"max_tokens": 10**9}) == 1024


def _reference_choice(pol, workers, key):
    """The cost rule of the module docstring, written out plainly: (url, rank, branch, cached) of the lowest cost."""
    ids = key.tokens
    per_tenant = pol.tree.match_per_tenant(key.tree_text())
    ranks = {w.url: sorted(pol.subs[w.url]) if pol.subs.get(w.url) else [0] for w in workers}
    matched = pol.index.match(ids[:-1], [(w.url, r) for w in workers for r in ranks[w.url]])
    best = None
    for order, w in enumerate(workers):
        for rank, looked in (((r, [r]) for r in ranks[w.url]) if pol.dp_aware else [(None, ranks[w.url])]):
            tenant = w.url if rank is None else f"{w.url}#{rank}"
            tree = max(0, per_tenant.get(tenant, 0) - 1)
            cached, branch = -1, "fallback"
            for r in looked:
                sub = pol.subs.get(w.url, {}).get(r)
                state = sub.state if sub is not None else "fallback"
                ev = matched.get((w.url, r), 0)
                c = {"exact": ev, "degraded": max(ev, tree), "fallback": tree}[state]
                if c > cached:
                    cached, branch = c, state
            cached = min(cached, key.prompt_tokens - 1)
            load = pol.load_tokens.get((w.url, rank), 0)
            cost = pol.prefill_weight * (key.prompt_tokens - cached) + pol.load_weight * load
            reqs = pol.inflight.get((w.url, rank), 0) if rank is not None else w.load
            score = (cost, reqs, pol.chosen_at.get((w.url, rank), -1), order)
            if best is None or score < best[0]:
                best = (score, w.url, rank, branch, cached)
    return best[1:]


def test_decisions_match_the_written_out_rule_on_random_states():
    """Workers with and without streams (an empty stream map too), every trust, DP ranks or not."""
    import random

    rng = random.Random(5)
    urls = [f"http://w{i}:1" for i in range(4)]
    for case in range(300):
        dp = rng.random() < 0.5
        pol = KvAwarePolicy(speculative_ttl_s=0, dp_aware=dp, load_weight=rng.choice([0.1, 1.0]))
        for u in urls:
            kind = rng.choice(["none", "empty", "streams"])
            if kind == "empty":
                pol.subs[u] = {}
            elif kind == "streams":
                pol.subs[u] = {r: SimpleNamespace(state=rng.choice(["exact", "degraded", "fallback"]))
                               for r in range(rng.randint(1, 2))}
            for r in range(2):
                if rng.random() < 0.5:
                    store(pol, u, P[:4 * rng.randint(1, 8)], rank=r)
                if rng.random() < 0.3:
                    pol.load_tokens[(u, r if dp else None)] = rng.randint(0, 40)
                if rng.random() < 0.4:  # chosen before, at decision 1..6 (ties go to the least recent)
                    pol.chosen_at[(u, r if dp else None)] = rng.randint(1, 6)
            if rng.random() < 0.5:
                tenant = f"{u}#{rng.randint(0, 1)}" if dp else u
                pol.tree.insert(RouteKey("", P[:rng.randint(1, 32)]).tree_text(), tenant)
        workers = [Worker(u) for u in urls]
        for w in workers:
            w.load = rng.randint(0, 2)
        key = RouteKey("", P[:rng.randint(2, 32)] + [7], 0)
        want = _reference_choice(pol, workers, key)
        got = pol.select(workers, key)
        assert (got.url, key.rank, key.branch, key.cached) == want, case
