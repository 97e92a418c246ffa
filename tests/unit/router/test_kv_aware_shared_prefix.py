"""kv_aware on the states its debug log showed for shared_prefix on 2 engines with a 2048-token pool.

The workload of docs/benchmarks.md ``routing-kv-engine``: 8 groups x 4 prompts, each prompt the
group's 520-token system prompt (after the chat template) + a 38-token question (558 tokens),
16 decode tokens, 4 in flight.  Page size 1 (our engine's default) unless a test says otherwise.
"""

import time
from types import SimpleNamespace

from fleetserve.router.kv_events.decode import BlockStored
from fleetserve.router.kv_events.policy import KvAwarePolicy, RouteKey, _pending_prefix
from fleetserve.router.workers import Worker

A, B = "http://a:1", "http://b:1"
TEMPLATE = [1, 2, 3]  # the chat template's first tokens, the same in every prompt


def system(g: int) -> list[int]:
    return TEMPLATE + [100_000 + 1000 * g + j for j in range(517)]  # 520 tokens


def prompt(g: int, p: int) -> list[int]:
    return system(g) + [900_000 + 100 * p + j for j in range(38)]  # 558 tokens


def policy(block_size: int = 1, **kw) -> KvAwarePolicy:
    pol = KvAwarePolicy(**kw)
    for url in (A, B):
        pol.subs[url] = {0: SimpleNamespace(state="exact")}
        toks = [7] * block_size  # a first event tells the index the engine's page size
        pol.index.apply((url, 0), BlockStored([1], None, toks, block_size))
    return pol


_hashes = iter(range(10, 1 << 30))  # the engine's block hashes: never the same twice


def store(pol, url, tokens, block_size=1):
    n = len(tokens) // block_size
    hashes = [next(_hashes) for _ in range(n)]
    pol.index.apply((url, 0), BlockStored(hashes, None, tokens[:n * block_size], block_size))


def queued(pol, workers, tokens) -> int:
    key = RouteKey("", tokens, 16)
    pol.select(workers, key)
    return key.queued


def test_a_groups_second_prompt_follows_the_first_while_its_prefill_is_pending_past_the_ttl():
    # On the CPU engines a 558-token prefill took seconds, longer than the 2 s speculative TTL, and the
    # BlockStored event comes only when it ends: in between nothing said where the system prompt would be.
    # TTL 0 stands for that window.
    pol = policy(speculative_ttl_s=0)
    wa, wb = Worker(A), Worker(B)
    first = RouteKey("", prompt(0, 0), 16)
    assert pol.select([wa, wb], first).url == A and first.queued == 558
    second = RouteKey("", prompt(0, 1), 16)
    assert pol.select([wa, wb], second).url == A
    assert second.cached == 520  # the first one's prefix, pending on A
    assert second.queued == 38  # its own question
    assert pol.queued_tokens == {(A, None): 558 + 38}
    # the rule before counted nothing cached on A and the whole 558 as queued there: it went to B
    # (and B then computed and cached the same system prompt a second time)
    other = RouteKey("", prompt(1, 0), 16)  # another group: it shares only the template
    assert pol.select([wa, wb], other).url == B and other.cached == 0
    pol.prefilled(first)
    pol.prefilled(second)  # prefills ended: no longer pending, and no event or speculative entry yet
    third = RouteKey("", prompt(0, 2), 16)
    assert pol.select([wa, wb], third).url == A  # by the load: 558 + 0.1 x 628 against B's queue
    assert third.cached == 0  # nothing holds the system prompt any more in the router's view


def test_the_pending_prefix_is_cut_to_whole_pages():
    pol = policy(block_size=16, speculative_ttl_s=0)
    wa, wb = Worker(A), Worker(B)
    pol.select([wa, wb], RouteKey("", prompt(0, 0), 16))
    second = RouteKey("", prompt(0, 1), 16)
    assert pol.select([wa, wb], second).url == A
    assert second.cached == 512  # 520 shared tokens, 32 whole pages of 16


def test_pending_prefix_is_the_longest_prefix_a_queued_request_starts_with():
    def k(toks):
        key = RouteKey("", toks, 0)
        return key

    P = list(range(100))
    assert _pending_prefix(P, 99, [k(P[:50] + [-1] * 10), k(P[:70] + [-2])]) == 70
    assert _pending_prefix(P, 60, [k(P[:70] + [-2])]) == 60  # at most the limit (prompt[:-1])
    assert _pending_prefix(P, 99, [k([-1] + P[1:])]) == 0
    assert _pending_prefix(P, 99, [k(P[:30])]) == 30  # a shorter prompt, all of it shared
    assert _pending_prefix(P, 99, [RouteKey("text only")]) == 0  # no token ids: nothing to compare


def test_one_sorted_scan_gives_every_targets_pending_prefix_and_shared_queued():
    """SortedPrompts (pending.py) holds every target's queued prompts in one sorted list and answers,
    for all targets at once, what the plain per-target scans over token lists answer (_pending_prefix,
    _shared_queued): random prompts in a few prefix groups on 3 targets, keys coming and going (ids
    past 0x10FFFF and text-only keys included: they stay out of the sorted list); its adjacent
    shared-prefix figures stay what the sorted texts really share."""
    import os
    import random

    from fleetserve.router.kv_events.pending import QueuedKeys, SortedPrompts, one_char_per_id
    from fleetserve.router.kv_events.policy import _shared_queued

    rng = random.Random(7)
    targets = ["a", "b", "c"]
    for _ in range(1500):
        groups = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(3)]

        def toks():
            g = rng.choice(groups)
            return g[:rng.randrange(len(g) + 1)] + [rng.choice([0, 1, 70_000, 0x110000 if rng.random() < 0.05 else 2])
                                                    for _ in range(rng.randrange(20))]
        sp = SortedPrompts()
        queues = {t: QueuedKeys() for t in targets}
        plain = {t: [] for t in targets}
        for _ in range(rng.randrange(14)):
            t = rng.choice(targets)
            if plain[t] and rng.random() < 0.3:  # one leaves again
                gone = rng.choice(plain[t])
                plain[t].remove(gone)
                assert queues[t].remove(gone) and not queues[t].remove(gone)
                assert sp.remove(gone) == (one_char_per_id(gone) is not None) and not sp.remove(gone)
                continue
            key = RouteKey("t", toks() if rng.random() > 0.1 else None, 0)
            key.cached = rng.randrange(30)
            queues[t].append(key)
            plain[t].append(key)
            if one_char_per_id(key) is not None and rng.random() < 0.5:
                sp.scan(one_char_per_id(key))  # as the policy does: scanned, then recorded (its comparisons reused)
            assert sp.add(key, t) == (one_char_per_id(key) is not None)
        texts = [t for t, _ in sp.texts]
        assert texts == sorted(texts) and len(sp.keys) == len(sp.targets) == len(texts)
        assert sp.lcps == [len(os.path.commonprefix([a, b])) for a, b in zip(texts, texts[1:])]
        me = RouteKey("t", toks() or [3], 0)
        text = one_char_per_id(me)
        if text is None:
            continue
        scanned = sp.scan(text)
        for t in targets:
            assert queues[t].odd == sum(1 for k in plain[t] if k.tokens and one_char_per_id(k) is None)
            if queues[t].odd:
                continue  # the policy scans such a target's own list
            longest, pairs = scanned.get(t, (0, ()))
            for limit in range(len(me.tokens) + 2):
                assert min(limit, len(me.tokens), longest) == _pending_prefix(me.tokens, limit, plain[t])
            for cached in range(len(me.tokens) + 2):
                shared = sum(min(a, cached) - lo for a, lo in pairs if lo < cached)
                assert shared == _shared_queued(me.tokens, cached, plain[t])
                assert shared == _shared_queued(me.tokens, cached, queues[t], text)  # the text scan agrees


def test_a_scan_that_stops_early_leaves_out_only_what_cannot_matter():
    """SortedPrompts.scan(text, stop) walks only the prompts that share more than ``stop`` ids: at
    ``stop`` <= the least queued ``cached`` (``sp.cached[0]``, kept sorted as keys come and go) every
    target it reports has the full scan's answer, and one it leaves out shares at most ``stop`` ids
    and has no pairs."""
    import random

    from fleetserve.router.kv_events.pending import SortedPrompts, one_char_per_id

    rng = random.Random(11)
    for _ in range(1500):
        groups = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(3)]

        def toks():
            g = rng.choice(groups)
            return g[:rng.randrange(len(g) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(15))]
        sp = SortedPrompts()
        keys = []
        for _ in range(rng.randrange(1, 16)):
            if keys and rng.random() < 0.3:
                assert sp.remove(keys.pop(rng.randrange(len(keys))))
                continue
            key = RouteKey("t", toks() or [1], 0)
            key.cached = rng.randrange(25)
            assert sp.add(key, rng.choice("abc"))
            keys.append(key)
        assert sp.cached == sorted(k.cached for k in keys) and len(sp.lows) == len(sp.keys)
        if not keys:
            continue
        text = one_char_per_id(RouteKey("t", toks() or [2], 0))
        full = sp.scan(text)
        for stop in range(sp.cached[0] + 1):
            part = sp.scan(text, stop)
            for t in "abc":
                if t in part:
                    assert part[t] == full[t]
                else:
                    longest, pairs = full.get(t, (0, []))
                    assert longest <= stop and not pairs


def test_the_shortened_scan_decides_as_the_full_one(monkeypatch):
    """The policy stops its sorted scan at the least cached_tokens of the targets it covers (and the least
    queued ``cached``): random prompts in a few groups, queued and prefilled at random on 3 workers with
    and without KV events, decide and charge as with the scan over every queued prompt."""
    import random

    from fleetserve.router.kv_events.pending import SortedPrompts

    def run(full: bool) -> list:
        rng = random.Random(3)
        out = []
        for case in range(60):
            pol = KvAwarePolicy(speculative_ttl_s=0, dp_aware=case % 3 == 0)
            urls = ["http://a:1", "http://b:1", "http://c:1"]
            for u in urls[:case % 3]:
                pol.subs[u] = {0: SimpleNamespace(state=rng.choice(["exact", "degraded"]))}
            workers = [Worker(u) for u in urls]
            groups = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
            live = []
            for _ in range(40):
                if live and rng.random() < 0.3:
                    k = live.pop(rng.randrange(len(live)))
                    pol.release(k) if rng.random() < 0.5 else pol.prefilled(k)
                    continue
                if rng.random() < 0.2:
                    store(pol, rng.choice(urls), rng.choice(groups))
                g = rng.choice(groups)
                key = RouteKey("", g[:rng.randrange(len(g) + 1)] + [rng.randrange(50) for _ in range(8)], 4)
                w = pol.select(workers, key)
                out.append((w.url, key.rank, key.branch, key.cached, key.queued))
                live.append(key)
        return out

    shortened = run(False)
    scan = SortedPrompts.scan
    monkeypatch.setattr(SortedPrompts, "scan", lambda self, text, stop=0: scan(self, text))
    assert run(True) == shortened


def test_a_prompt_stays_with_its_cached_system_prompt_behind_a_queue_of_about_as_many_tokens():
    # The split in the logs: A holds group 0's system prompt (its events) and has two prefills queued,
    # another group's whole prompt (555 uncached) and a group-0 question (38); B is idle.
    def state(**kw):
        pol = policy(speculative_ttl_s=0, **kw)
        store(pol, A, system(0))
        wa = Worker(A)
        assert queued(pol, [wa], prompt(1, 0)) == 555  # only the template cached
        assert queued(pol, [wa], prompt(0, 1)) == 38
        return pol

    wa, wb = Worker(A), Worker(B)
    pol = state()  # --kv-queue-weight 0.5: A 38 + 0.5 x 593 + 0.1 x 625 = 397 against B's 555
    key = RouteKey("", prompt(0, 2), 16)
    assert pol.select([wa, wb], key).url == A and key.cached == 520
    dynamo = state(queue_weight=1.0)  # the weight before (Dynamo's): A 693.5, so it left for B and
    key = RouteKey("", prompt(0, 2), 16)  # B computed and cached the system prompt a second time
    assert dynamo.select([wa, wb], key).url == B and key.cached == 0


def test_a_conversation_stays_on_its_history_behind_a_queue_as_long_as_the_history():
    # The move in the second multi_turn run's log: turn 1 (122 tokens) of a conversation whose 62-token
    # history B holds, while B has another conversation's 60 new tokens queued; A holds only the
    # chat template's 24 tokens.  The log's costs: A 98 + 0.1 x 51 = 103.1; B 60 + 60 + 0.1 x 120 = 132.
    tmpl = list(range(500, 524))

    def hist(c):
        return tmpl + [10_000 + 100 * c + j for j in range(38)]

    def turn1(c):
        return hist(c) + [20_000 + 100 * c + j for j in range(60)]

    def state(**kw):
        pol = policy(speculative_ttl_s=0, **kw)
        store(pol, A, tmpl)
        store(pol, B, hist(0))
        store(pol, B, hist(1))
        assert queued(pol, [Worker(B)], turn1(1)) == 60
        pol.load_tokens[(B, None)] += 44  # 120 in flight on B, 51 on A (the log's figures)
        pol.load_tokens[(A, None)] = 51
        return pol

    wa, wb = Worker(A), Worker(B)
    key = RouteKey("", turn1(0), 16)
    assert state().select([wa, wb], key).url == B and key.cached == 62  # B: 60 + 0.5 x 60 + 12 = 102
    key = RouteKey("", turn1(0), 16)
    assert state(queue_weight=1.0).select([wa, wb], key).url == A and key.cached == 24  # the rule before


def test_speculative_entries_last_the_ttl_again_from_the_end_of_the_prefill():
    pol = policy(speculative_ttl_s=5.0)
    wa, wb = Worker(A), Worker(B)
    targets = [(A, 0), (B, 0)]
    key = RouteKey("", prompt(0, 0), 16)
    assert pol.select([wa, wb], key).url == A
    assert pol.index.match(prompt(0, 0)[:-1], targets) == {(A, 0): 557, (B, 0): 0}
    pol.index._expire(time.monotonic() + 6.0)  # a prefill longer than the TTL: the entries ran out
    assert pol.index.match(prompt(0, 0)[:-1], targets)[(A, 0)] == 0
    pol.prefilled(key)  # its first chunk: its prompt is in A's tree now, its events on the way
    assert pol.index.match(prompt(0, 0)[:-1], targets) == {(A, 0): 557, (B, 0): 0}
    failed = RouteKey("", prompt(1, 0), 16)
    assert pol.select([wb], failed).url == B
    pol.index._expire(time.monotonic() + 6.0)
    pol.release(failed)  # an attempt that failed (or a non-streamed answer): no new entries
    assert pol.index.match(prompt(1, 0)[:-1], targets)[(B, 0)] == 0
