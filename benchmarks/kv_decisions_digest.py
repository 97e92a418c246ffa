"""A digest of kv_aware's decisions over seeded random states: do two source trees decide alike?

    PYTHONPATH=<tree>/src python benchmarks/kv_decisions_digest.py [--scenarios 3000] [--stats]

Each scenario draws a policy configuration (1-4 workers, ``--dp-aware`` with 1-2 ranks, the queue,
balance-band, backlog, overflow and idle-rule settings, speculative entries on or off), KV-event
streams of random trust, and then 10 or 40 random steps: requests over a few shared prefixes (some
with a text prompt, some naming a DP rank), their prefill ends and answers, engine ``/v1/loads``
snapshots (with and without waiting figures and pool sizes), ``BlockStored`` events, and tokenizer
disagreements.  Every decision (worker, rank, branch, predicted cached tokens, reason, tokens charged)
with its debug log line of every target's cost terms (unless ``--decisions-only``),
and each scenario's final bookkeeping (queued prefill, load, idle moves, the backlog unit's counters,
each target's held cached prefixes with their union and what a snapshot counts of them, and the load
term the cost would use) go into one SHA-1.  A refactor meant to change no decision must print the
same digest before and after (it also prints which ``fleetserve`` it imported: a mistyped
PYTHONPATH falls back to the installed tree); a run takes a few seconds.  The states are built step
by step, not raced: the only clock readings are the order of the steps (a request sent before or
after a snapshot), and snapshots never go stale.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import logging
import os
import random
from types import SimpleNamespace

import fleetserve
from fleetserve.router.kv_events.decode import BlockStored
from fleetserve.router.kv_events.loads import EngineLoads
from fleetserve.router.kv_events.policy import KvAwarePolicy, RouteKey
from fleetserve.router.workers import Worker


def scenario(seed: int, out: list) -> None:
    rng = random.Random(seed)
    urls = [f"http://w{i}:8000" for i in range(rng.choice([1, 2, 3, 4]))]
    dp = rng.random() < 0.3
    pol = KvAwarePolicy(speculative_ttl_s=rng.choice([0, 2.0]), dp_aware=dp,
                        queue_weight=rng.choice([0.0, 0.5, 1.0]), balance_band=rng.choice([0.0, 0.5]),
                        backlog_discount=rng.choice([0.0, 1.0]), overflow_weight=rng.choice([0.0, 1.0]),
                        balance_rel_threshold=rng.choice([0.0, 1.2]))
    ranks = {u: tuple(range(rng.choice([1, 2]))) for u in urls}
    for u in urls:
        pol.dp_ranks[u] = ranks[u]
        if rng.random() < 0.6:  # a KV-event stream per rank, of some trust
            pol.subs[u] = {r: SimpleNamespace(state=rng.choice(["exact", "degraded", "fallback"])) for r in ranks[u]}
    if rng.random() < 0.5:
        pol.engine_loads = EngineLoads(1e9)  # snapshots never go stale within a scenario
    workers = [Worker(u) for u in urls]
    prefixes = [[rng.randrange(50_000) for _ in range(rng.choice([16, 64, 200]))] for _ in range(4)]
    page = rng.choice([1, 4, 16])
    inflight: list[RouteKey] = []
    for step in range(rng.choice([10, 40])):
        r = rng.random()
        if r < 0.1 and pol.engine_loads is not None:
            u = rng.choice(urls)
            most = rng.choice([20_000, 100_000])  # at 100k the engine's figure is mostly over the router's own
            pol.engine_loads.put(
                u, {k: rng.randrange(most) for k in ranks[u]},
                waiting={k: rng.randrange(5_000) for k in ranks[u]} if rng.random() < 0.5 else None,
                waiting_reqs={k: rng.randrange(5) for k in ranks[u]} if rng.random() < 0.5 else None)
            if rng.random() < 0.3:
                pol.engine_loads.pools[u] = {k: 30_000 for k in ranks[u]}
        elif r < 0.2:
            u, p = rng.choice(urls), rng.choice(prefixes)
            n = len(p) // page * page
            if n:
                event = BlockStored([rng.randrange(1 << 60) for _ in range(n // page)], None, p[:n], page)
                pol.index.apply((u, rng.choice(ranks[u])), event)
        elif r < 0.25:  # a worker reports another prompt count than the router's
            pol.tokenizer_check.observe(rng.choice(urls), 10, b'{"usage": {"prompt_tokens": 11}}')
        elif r < 0.45 and inflight:
            k = inflight.pop(rng.randrange(len(inflight)))
            (pol.prefilled if rng.random() < 0.5 else pol.release)(k)
            if k.charged is not None:
                inflight.append(k)
        else:
            if rng.random() < 0.1:
                key = RouteKey("some text " * rng.randrange(1, 50))
            else:
                tail = [rng.randrange(50_000) for _ in range(rng.choice([0, 1, 8, 100]))]
                key = RouteKey("", rng.choice(prefixes) + tail, rng.choice([16, 128]))
            key.streamed = rng.random() < 0.5
            if dp and rng.random() < 0.2:
                key.client_rank = rng.choice([0, 1, 5])
            some = rng.sample(workers, rng.randrange(1, len(workers) + 1))
            for w in some:
                w.load = rng.randrange(5)
            w = pol.select(some, key)
            out.append(("decision", seed, step, w.url, key.rank, key.branch, key.cached, key.reason,
                        key.charged[1] if key.charged else None))
            inflight.append(key)
    loads = pol.engine_loads
    held = [(lk, h.waiting_tokens, h.running_union(), h.counted(loads.counts_from(lk[0]) if loads else None))
            for lk, h in sorted(pol.held.items(), key=lambda item: repr(item[0]))]
    terms = [(u, r, pol.load_term(u, r)) for u in urls for r in (None,) + ranks[u]]
    out.append(("state", seed, sorted(pol.queued_tokens.items()), sorted(pol.load_tokens.items()), pol.idle_moves,
                pol.queued_requests, pol.queued_sum, held, terms))


class CostLines(logging.Handler):
    """Adds the policy's debug line of each decision (every target's cached, queued and load terms and
    cost: ``kv_aware cost: ...``) to the digest, so that a change in a term shows even where it changes
    no decision; other log records are dropped."""

    def __init__(self, out: list) -> None:
        super().__init__(logging.DEBUG)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("kv_aware cost"):
            self.out.append(("cost", record.getMessage()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", type=int, default=3000)
    ap.add_argument("--stats", action="store_true", help="also print how the decisions spread over branches etc.")
    ap.add_argument("--decisions-only", action="store_true",
                    help="leave the debug log's per-target cost lines out of the digest (for a change that rewords them)")
    args = ap.parse_args()
    if args.scenarios < 1:
        ap.error("--scenarios must be at least 1")
    print(f"fleetserve from {os.path.dirname(os.path.dirname(fleetserve.__file__))}")  # (compiled or not: same digest)
    out: list = []
    costs = CostLines(out)
    router_log = logging.getLogger("fleetserve.router")
    router_log.propagate = False  # the tokenizer check's warnings are not printed
    router_log.handlers[:] = [costs]
    router_log.setLevel(logging.WARNING if args.decisions_only else logging.DEBUG)
    for seed in range(args.scenarios):
        scenario(seed, out)
    decisions = [o for o in out if o[0] == "decision"]
    print(f"{len(decisions)} decisions, digest {hashlib.sha1(repr(out).encode()).hexdigest()[:16]}")
    if args.stats:
        print("branches", dict(collections.Counter(o[5] for o in decisions)))
        print("reasons", dict(collections.Counter(o[7] for o in decisions)))
        print("ranks", dict(collections.Counter(o[4] for o in decisions)))
        print("with cached tokens", sum(o[6] > 0 for o in decisions))


if __name__ == "__main__":
    main()
