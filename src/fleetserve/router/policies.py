"""Routing policies: pick one worker for a request.

Every policy has ``select(workers, text) -> Worker | None`` (``workers``: the
available ones, non-empty or None is returned) and ``on_worker_removed(url)``.

* ``round_robin``: the next worker in turn.
* ``random``: uniform.
* ``power_of_two``: two distinct random workers, the less loaded one.
* ``cache_aware`` (default): see :class:`CacheAwarePolicy`.

Ties between equally loaded workers go to the one holding the fewest tree
characters, then to registration order, so new prompts spread out.
"""

from __future__ import annotations

import math
import random as _random

from .radix_tree import RadixTree
from .workers import Worker


def least_loaded(workers: list[Worker], tree: RadixTree | None = None) -> Worker:
    """The worker with the fewest in-flight requests (ties: smaller tree, then first)."""
    best = workers[0]
    best_load = best.load
    for w in workers[1:]:
        if w.load < best_load:
            best, best_load = w, w.load
    if tree is not None:
        ties = [w for w in workers if w.load == best_load]
        if len(ties) > 1:
            size = tree.tenant_size
            best = min(ties, key=lambda w: size(w.url))
    return best


def over_balance(load: int, min_load: int, abs_threshold: float, rel_threshold: float) -> bool:
    """True if a worker at ``load`` in-flight requests is too busy to keep a request it would get.

    Both margins must hold against ``min_load``, the least loaded available worker:
    ``load - min_load > abs_threshold`` and ``load > min_load * rel_threshold`` (the
    thresholds of sglang-router's ``--balance-abs-threshold`` / ``--balance-rel-threshold``).
    The test is per worker, for the worker the request would go to, as smg's cache-aware
    policy judges each affinity candidate (its ``candidate_requires_spill``; smg compares
    against the fleet's mean load, we keep sglang-router's minimum).  A busy worker elsewhere
    in the fleet therefore never moves a request off a lightly loaded one.
    """
    return load - min_load > abs_threshold and load > min_load * rel_threshold


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, workers: list[Worker], text: str, retry: bool = False) -> Worker | None:
        """The next worker in turn.  A ``retry`` (``workers`` then holds only those not tried yet)
        does not advance the turn, so a failing worker does not shift the rotation onto itself."""
        if not workers:
            return None
        i = self._next % len(workers)
        if not retry:
            self._next = i + 1
        return workers[i]

    def on_worker_removed(self, url: str) -> None:
        pass


class RandomPolicy:
    name = "random"

    def __init__(self, rng: _random.Random | None = None) -> None:
        self._rng = rng or _random.Random()

    def select(self, workers: list[Worker], text: str, retry: bool = False) -> Worker | None:
        return self._rng.choice(workers) if workers else None

    def on_worker_removed(self, url: str) -> None:
        pass


class PowerOfTwoPolicy:
    name = "power_of_two"

    def __init__(self, rng: _random.Random | None = None) -> None:
        self._rng = rng or _random.Random()

    def select(self, workers: list[Worker], text: str, retry: bool = False) -> Worker | None:
        if not workers:
            return None
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(workers, 2)
        return b if b.load < a.load else a

    def on_worker_removed(self, url: str) -> None:
        pass


class CacheAwarePolicy:
    """Cache-aware routing over one shared :class:`RadixTree`.

    For each request, with ``min`` the least in-flight count among the available workers:

    1. match ``text`` in the tree; if ``matched / len(text) > cache_threshold`` and an
       available worker owns the matched node, the candidate is the least loaded of
       those owners: it gets the request (a *hit*) unless :func:`over_balance` says
       it is too busy against ``min``; then the least-loaded worker does (*balanced*);
    2. else (a *miss*): the least-loaded worker, or with
       ``cache_miss_fallback="smallest_tree"`` the worker holding the fewest characters
       (unless that one is over the balance, as in step 1).

    The load test is per candidate, not fleet-wide: a swamped worker elsewhere never
    moves a request off a lightly loaded owner of its prefix.
    The text is inserted under the chosen worker in every branch.  Empty text is
    no key: the fallback decides and nothing is inserted.  Parameters and
    defaults follow sglang-router (cache 0.3, abs 64, rel 1.5).
    ``hits`` / ``misses`` / ``balanced`` count decisions for metrics.

    ``bounded_load_factor = c > 0`` (ours; off by default) replaces the load test with
    the bound of consistent hashing with bounded loads (Mirrokni, Thorup and
    Zadimoghaddam, SODA 2018): only workers whose load would stay within
    ``ceil(c * (total_load + 1) / n) + bounded_load_slack`` are candidates (the
    slack, ours, keeps the usual jitter of a lightly loaded fleet from moving
    requests off their cache); steps 1 and 2 pick among them, and step 1 takes
    the candidate with the longest match (ties: least loaded, then first).  A hot
    prefix then spills to a second worker as soon as its owner is ``c`` times busier
    than the average, instead of waiting for the absolute gap; ``balanced`` counts
    requests whose best-matching worker was over the bound.
    """

    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, cache_miss_fallback: str = "least_loaded",
                 tree: RadixTree | None = None, bounded_load_factor: float = 0.0,
                 bounded_load_slack: int = 4) -> None:
        if bounded_load_factor and bounded_load_factor < 1.0:
            raise ValueError("bounded_load_factor must be 0 (off) or >= 1")
        if bounded_load_slack < 0:
            raise ValueError("bounded_load_slack must be >= 0")
        self.bounded_load_factor = bounded_load_factor
        self.bounded_load_slack = bounded_load_slack
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.smallest_tree = cache_miss_fallback == "smallest_tree"
        self.tree = tree or RadixTree()
        self.hits = 0
        self.misses = 0
        self.balanced = 0
        # the last decision, for the route header and the prediction metric (route_header.py):
        # (branch, characters of the text the chosen worker held before the insert)
        self.last = ("miss", 0)
        # the tree entry of the last decision, ``(text, worker url, claim)`` (RadixTree.insert's), or None:
        # the proxy resets it before each decision and takes the entry back when the worker refuses the
        # request (4xx or busy), so the tree does not claim a prompt the worker never cached
        self.last_claim = None

    def select(self, workers: list[Worker], text: str, retry: bool = False) -> Worker | None:
        if not workers:
            return None
        tree = self.tree
        if self.bounded_load_factor and len(workers) > 1:
            return self._select_bounded(workers, text)
        lo = workers[0].load
        for w in workers:
            if w.load < lo:
                lo = w.load
        chosen = None
        if text:
            matched, owners = tree.match(text)
            if owners and matched / len(text) > self.cache_threshold:
                cands = [w for w in workers if w.url in owners]
                if cands:
                    best = cands[0] if len(cands) == 1 else least_loaded(cands)
                    if over_balance(best.load, lo, self.abs_threshold, self.rel_threshold):
                        self.balanced += 1  # the owner itself is too busy: leave it for the least loaded
                        chosen = least_loaded(workers, tree)
                        self.last = ("balanced", tree.prefix_match_tenant(text, chosen.url))
                    else:
                        self.hits += 1
                        chosen = best
                        self.last = ("hit", matched)
                    self.last_claim = (text, chosen.url, tree.insert(text, chosen.url))
                    return chosen
        self.misses += 1
        chosen = self._miss_target(workers)
        if over_balance(chosen.load, lo, self.abs_threshold, self.rel_threshold):
            chosen = least_loaded(workers, tree)  # only with smallest_tree: that worker is too busy
        if text:
            self.last = ("miss", tree.prefix_match_tenant(text, chosen.url))
            self.last_claim = (text, chosen.url, tree.insert(text, chosen.url))
        else:
            self.last = ("miss", 0)
        return chosen

    def _miss_target(self, workers: list[Worker]) -> Worker:
        """Step 3: where a cache miss goes (``--cache-miss-fallback``)."""
        if self.smallest_tree:
            size = self.tree.tenant_size
            return min(workers, key=lambda w: size(w.url))
        return least_loaded(workers, self.tree)

    def _select_bounded(self, workers: list[Worker], text: str) -> Worker:
        """Steps 2-3 among the workers under the bounded-load capacity (see the class doc)."""
        tree = self.tree
        loads = [w.load for w in workers]
        cap = math.ceil(self.bounded_load_factor * (sum(loads) + 1) / len(workers)) + self.bounded_load_slack
        cands = [w for w, load in zip(workers, loads) if load + 1 <= cap]
        chosen = None
        per = {}
        if text:
            per = tree.match_per_tenant(text)
            if per:
                best = max(cands, key=lambda w: (per.get(w.url, 0), -w.load))
                matched = per.get(best.url, 0)
                if matched < max(per.values()) and max(per.values()) / len(text) > self.cache_threshold:
                    self.balanced += 1  # the best-matching worker is over the bound
                if matched / len(text) > self.cache_threshold:
                    self.hits += 1
                    chosen = best
        if chosen is None:
            self.misses += 1
            chosen = self._miss_target(cands)
            self.last = ("miss", per.get(chosen.url, 0))
        else:
            self.last = ("hit", per.get(chosen.url, 0))
        if text:
            self.last_claim = (text, chosen.url, tree.insert(text, chosen.url))
        return chosen

    def on_worker_removed(self, url: str) -> None:
        self.tree.remove_tenant(url)

    def on_cache_flushed(self, url: str) -> None:
        """``url`` answered ``POST /flush_cache``: its cache is empty, and so is its part of the tree."""
        self.tree.remove_tenant(url)


def make_policy(name: str, cfg=None):
    """Build the policy ``name``; ``cfg`` is a RouterConfig for cache_aware's parameters."""
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "random":
        return RandomPolicy()
    if name == "power_of_two":
        return PowerOfTwoPolicy()
    if name == "cache_aware":
        if cfg is None:
            return CacheAwarePolicy()
        return CacheAwarePolicy(cfg.cache_threshold, cfg.balance_abs_threshold, cfg.balance_rel_threshold,
                                cfg.cache_miss_fallback, bounded_load_factor=cfg.bounded_load_factor,
                                bounded_load_slack=cfg.bounded_load_slack)
    if name == "kv_aware":
        from .kv_events.flags import make_kv_aware
        return make_kv_aware(cfg)
    raise ValueError(f"unknown policy {name!r}")
