"""CPU µs per request of the router's policy work alone (no HTTP): cache_aware vs kv_aware.

    PYTHONPATH=src python benchmarks/kv_policy_cost.py BODIES.jsonl [--inflight 16] [--workers 4]
        [--passes 5] [--profile] [--engine-tokens N --prefill-after K] [--balance-band B]
        [--loads-interval S] [--callgrind]

BODIES.jsonl: one JSON request body per line (the router-overhead stick writes ~200 bodies of
1-2 KB in 10 prefix groups to ``<out>/bodies.jsonl``; ``make_bodies`` in its ``bench.py``).
Each request goes through what ``router/proxy.py`` does around the upstream exchange: the
routing text, kv_aware's ``prepare`` (tokenization with the built-in SmolLM2 tokenizer),
``select``, ``decorate`` (kv_aware: route header), and for kv_aware ``prefilled`` and ``release``
once ``--inflight`` newer requests have been routed (a closed loop of that many requests in
flight).  The workers publish no KV events (as the stick's fake workers), so kv_aware runs its
``fallback`` branch on the approximate tree; each reports its load (``/v1/loads``, refreshed
every 100 requests; 0 tokens, or ``--engine-tokens``) unless ``--loads-interval 0``.  With
``--engine-tokens`` above the router's own count and ``--prefill-after`` K < ``--inflight``, all
but the K newest requests in flight run, and every decision takes the union of their cached
prefixes off the engine's figure (:mod:`fleetserve.router.kv_events.held`): that path's cost.  Best of ``--passes`` passes over the bodies (the
first pass warms the tokenizer's caches), per policy, policies interleaved.  ``--profile``: a
cProfile of one more kv_aware pass, top 25 by own time.  The printed ``decisions`` digest
(every chosen worker and predicted cached-token count) tells whether two source trees decide alike.

``--callgrind``: instead, one warm pass and then ``--passes`` kv_aware passes inside one
``functools.reduce`` call, so that ``valgrind --tool=callgrind --toggle-collect=functools_reduce``
counts the instructions of those passes alone (deterministic where timings on a shared machine are
not; ``benchmarks/kv_policy_instructions.sh`` runs it and divides by the requests).  The engine
loads then never go stale (a valgrind run is ~50x slower than the loads' interval assumes).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import collections
import functools
import hashlib
import json
import os
import pstats
import time

import orjson

import fleetserve
from fleetserve.models.tokenizer import tokenizer_dir
from fleetserve.router import compiled
from fleetserve.router.kv_events.loads import EngineLoads
from fleetserve.router.kv_events.policy import KvAwarePolicy
from fleetserve.router.kv_events.tokenize import INLINE_MAX_CHARS, RouterTokenizer
from fleetserve.router.policies import make_policy
from fleetserve.router.routing_text import routing_text
from fleetserve.router.workers import Worker

PATH = "/v1/completions"
FLEETSERVE = os.path.dirname(os.path.dirname(fleetserve.__file__))  # the src folder measured (PYTHONPATH, else the install)


async def one_pass(policy, bodies: list[bytes], workers: list, inflight: int, trace: list | None = None,
                   engine_tokens: int = 0, prefill_after: int | None = None) -> float:
    prepare = getattr(policy, "prepare", None)
    decorate = getattr(policy, "decorate", None)
    release = getattr(policy, "release", None)
    prefilled = getattr(policy, "prefilled", None)
    window: collections.deque = collections.deque()
    loads = getattr(policy, "engine_loads", None)
    prefill_after = inflight if prefill_after is None else min(prefill_after, inflight)
    t0 = time.process_time()
    for n, raw in enumerate(bodies):
        if loads is not None and n % 100 == 0:  # a fresh /v1/loads answer from each worker (as the stick's)
            for w in workers:
                loads.put(w.url, {0: engine_tokens}, waiting={0: 0})
        body = orjson.loads(raw)
        key = routing_text(PATH, body)
        if prepare is not None:
            key = await prepare(PATH, body, key)
        w = policy.select(workers, key)
        w.load += 1
        if trace is not None:
            trace.append((w.url, getattr(key, "cached", None)))
        if decorate is not None:
            decorate(key, raw, b"")
        window.append((key, w))
        if prefilled is not None and prefill_after < inflight and len(window) > prefill_after:
            prefilled(window[-1 - prefill_after][0])  # its first answer bytes
        if len(window) > inflight:
            k, ow = window.popleft()
            ow.load -= 1
            if prefilled is not None:
                prefilled(k)
            if release is not None:
                release(k)
    while window:
        k, ow = window.popleft()
        ow.load -= 1
        if release is not None:
            release(k)
    return (time.process_time() - t0) / len(bodies) * 1e6


def _drive(coro):
    """Run a pass to its end without an event loop (prepare only awaits a thread for long prompts)."""
    try:
        coro.send(None)
    except StopIteration as e:
        return e.value
    raise RuntimeError("the pass waited on something: use bodies short enough to tokenize inline")


def callgrind_passes(kv, bodies: list[bytes], workers: list, args) -> None:
    """One warm pass, then ``args.passes`` inside ``functools.reduce`` (the callgrind toggle).

    Every body must be tokenized inline (the fast encoder, at most ``INLINE_MAX_CHARS`` characters):
    without an event loop a longer one would fail over to routing on its text, and the count would
    be of that path; such bodies are refused up front (SystemExit)."""
    long = [i for i, raw in enumerate(bodies) if not kv.tokenizer.inline(PATH, orjson.loads(raw))]
    if long:
        raise SystemExit(f"--callgrind: {len(long)} of {len(bodies)} bodies are not tokenized inline (the first: "
                         f"line {long[0] + 1}); use prompts of at most {INLINE_MAX_CHARS} characters")

    def one(_acc, _i):
        return _drive(one_pass(kv, bodies, workers, args.inflight, None, args.engine_tokens, args.prefill_after))

    one(0, 0)
    functools.reduce(one, range(args.passes), 0)


def read_bodies(path: str) -> list[bytes]:
    """The non-blank lines of ``path``, each a JSON object; SystemExit with one line on anything else."""
    try:
        with open(path, "rb") as f:
            bodies = [line.strip() for line in f if line.strip()]
    except OSError as e:
        raise SystemExit(f"cannot read the bodies file: {e}") from None
    if not bodies:
        raise SystemExit(f"{path}: no request bodies (one JSON object per line)")
    for n, raw in enumerate(bodies, 1):
        try:
            ok = isinstance(orjson.loads(raw), dict)
        except orjson.JSONDecodeError:
            ok = False
        if not ok:
            raise SystemExit(f"{path}: body {n} is not a JSON object")
    return bodies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bodies")
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--engine-tokens", type=int, default=0,
                    help="num_total_tokens each worker's /v1/loads reports (above the router's count, e.g. 100000: "
                         "the cost then takes the running requests' union of cached prefixes off it, held.py)")
    ap.add_argument("--prefill-after", type=int, default=None,
                    help="a request's prefill ends this many decisions after its own (default: --inflight, "
                         "with its answer); fewer: the others in flight run, as in a decode batch")
    ap.add_argument("--balance-band", type=float, default=None,
                    help="kv_aware's --kv-balance-band (default: the tree's own default; give it to compare trees "
                         "whose defaults differ)")
    ap.add_argument("--loads-interval", type=float, default=1.0,
                    help="kv_aware reads engine loads as with --kv-loads-interval-secs (0: none)")
    ap.add_argument("--callgrind", action="store_true",
                    help="one warm pass, then --passes kv_aware passes inside functools.reduce (see the docstring)")
    args = ap.parse_args()
    if args.passes < 1 or args.inflight < 1 or args.workers < 1:
        ap.error("--passes, --inflight and --workers must be at least 1")
    bodies = read_bodies(args.bodies)
    workers = [Worker(f"http://127.0.0.1:{30000 + i}") for i in range(args.workers)]
    tok = RouterTokenizer(tokenizer_dir())
    kv = KvAwarePolicy(tokenizer=tok, **({} if args.balance_band is None else {"balance_band": args.balance_band}))
    if args.loads_interval > 0:  # as `fleetserve router` does by default (--kv-loads-interval-secs 1)
        kv.engine_loads = EngineLoads(1e9 if args.callgrind else args.loads_interval)
    if args.callgrind:
        callgrind_passes(kv, bodies, workers, args)
        print(json.dumps({"fleetserve": FLEETSERVE, "hot_path": compiled.summary(), "bodies": len(bodies),
                          "passes": args.passes}))
        return
    policies = {"cache_aware": make_policy("cache_aware"), "kv_aware": kv}
    best = {name: float("inf") for name in policies}
    traces: dict = {name: [] for name in policies}

    async def run() -> None:
        for _ in range(args.passes):
            for name, p in policies.items():
                best[name] = min(best[name], await one_pass(p, bodies, workers, args.inflight, traces[name],
                                                            args.engine_tokens, args.prefill_after))
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            await one_pass(policies["kv_aware"], bodies * 5, workers, args.inflight, None, args.engine_tokens,
                           args.prefill_after)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)

    asyncio.run(run())
    print(json.dumps({"fleetserve": FLEETSERVE, "hot_path": compiled.summary(), "bodies": len(bodies), "inflight": args.inflight, "workers": args.workers,
                      "us_per_request": {k: round(v, 1) for k, v in best.items()},
                      # a digest of every decision (worker, predicted cached tokens): equal digests, equal choices
                      "decisions": {k: hashlib.sha1(repr(v).encode()).hexdigest()[:12] for k, v in traces.items()}}))


if __name__ == "__main__":
    main()
