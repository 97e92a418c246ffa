"""What ``--policy kv_aware`` buys over ``cache_aware``: the ``kv`` part of routing_experiment.py.

Simulated workers (``fleetserve sim-worker``) that publish KV-cache events as
the engine does (``--kv-events-config``, ``--page-size 16``) and tokenize with
SmolLM2's real tokenizer (``--tokenizer smollm2``); the router's kv_aware gets
the same tokenizer (``--tokenizer-path``, the folder ``fleetserve.models``
extracts from the bundled GGUF), so its token ids are the workers' ones.

Scenarios (one table each; the same seeded requests for every router of a table):

``pressure``  shared_prefix and multi_turn with a small KV pool per worker, so that
              the radix caches evict and a router's picture of them goes stale;
``replicas``  two router processes of the same policy in front of the same
              workers, each request sent to one of them at random (seeded);
``foreign``   a share of the requests (``--foreign-share``, 0.3) sent straight to
              a random worker, bypassing the router;
``dp``        workers with 2 DP-attention ranks each (``sim-worker --dp-size 2``,
              separate caches per rank); kv_aware with and without ``--dp-aware``.

Every run: flush the workers, start fresh router process(es), wait until each
kv_aware stream is ``exact`` (a second flush publishes ``AllBlocksCleared`` in
order), send the requests, read the routers' ``/metrics`` (prediction error,
stream states), stop the routers.

The bound column: the hit rate one infinite radix cache (page size 16) would
have had on the same request stream, in the order the requests were sent:
request ``i`` hits the longest run of whole pages of ``prompt_i[:-1]`` that some
earlier prompt starts with. No routing can beat it; concurrency can keep a real
fleet below it (a prompt that arrives while the first of its group is still in
prefill finds nothing). With direct traffic a second, tighter bound
(:func:`split_cache_bound`): a direct request hits only prompts that were routed
or went straight to its own worker.  Neither knows the KV pools are finite; the
third, the pool bound (:func:`finite_pool_bound`), does: one cache of all the
workers' pools together that evicts offline-optimally (Belady), also a bound on
every router.

Each run writes ``watch-<router>.log`` to ``--log-dir`` (workers' running /
waiting requests, free KV, the routers' in-flight gauge every 10 s, ``STALLED``
once nothing was admitted for a minute), and every request has a time limit
(``--request-timeout``), so a run that stops making progress ends with failed
requests and a log that says whether they sat in the workers or in the router.
Each row also reports how far the simulated steps ran late on this CPU
(``sim late``) and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import random
import re
import shlex
import time
import urllib.request
from pathlib import Path

import numpy as np

from doc_section import write_section
from fleetserve.bench import cli as bench_cli
from fleetserve.bench import report
from fleetserve.bench.client import run_requests
from fleetserve.models.tokenizer import tokenizer_dir

PAGE = 16
HTTP0, EV0 = 21000, 22000  # below the ephemeral range (32768..): no clash with client sockets
_next_router_port = [23000]  # every run its own ports: a killed router's port may sit in TIME_WAIT
SAME = ["--cache-threshold", "0.3", "--balance-abs-threshold", "64", "--balance-rel-threshold", "1.5"]


# ------------------------------------------------------------------ the bound
def page_keys(ids: list[int]) -> list[int]:
    """Chained hashes of the whole pages of ``ids``: key i names pages 0..i."""
    out, h = [], 0
    for i in range(len(ids) // PAGE):
        h = hash((h, tuple(ids[i * PAGE:(i + 1) * PAGE])))
        out.append(h)
    return out


def infinite_cache_bound(prompts: list[list[int]]) -> tuple[int, int]:
    """``(cached, prompt tokens)`` one infinite page-``PAGE`` radix cache gets on ``prompts`` in order."""
    seen: set[int] = set()
    cached = total = 0
    for ids in prompts:
        total += len(ids)
        keys = page_keys(ids[:-1])
        n = 0
        for k in keys:
            if k not in seen:
                break
            n += 1
        cached += n * PAGE
        seen.update(page_keys(ids))
    return cached, total


def finite_pool_bound(prompts: list[list[int]], pool_tokens: int) -> tuple[int, int]:
    """``(cached, prompt tokens)``: the most any router could have got with the workers' KV pools as
    they were, not infinite: one page-``PAGE`` radix cache of ``pool_tokens`` (every worker's pool
    together) that sees the requests in order and evicts offline-optimally.

    Why it bounds every router: at any moment the pages the separate workers hold fit, de-duplicated,
    in one pool of their summed size, and a request that hits on its worker would hit there too; so
    the hits of any routing and any eviction are the page hits of *some* schedule of one such pool.
    Among those, Belady's rule (evict the page whose next use lies farthest ahead; a new prompt's pages
    may be evicted at once) gets the most page hits (Belady 1966, for pages of one size).  A page's
    prefix pages are used by every request that uses it, so none is used later than it; with ties
    broken towards the deeper page the pool stays a tree, and its page hits are prefix hits, as an
    engine counts them.  What it leaves out (so real fleets stay further below it): the pages running
    requests pin, their decode tokens, and requests that arrive while an earlier one with the same
    prefix is still in prefill.  O(pages x log pages)."""
    cap = max(0, pool_tokens // PAGE)
    lookups = [page_keys(ids[:-1]) for ids in prompts]
    inserts = [page_keys(ids) for ids in prompts]
    never = len(prompts)  # "no later use"
    later: list[list[int]] = [[]] * len(prompts)  # later[i][d]: next request after i that looks up inserts[i][d]
    upcoming: dict[int, int] = {}
    for i in range(len(prompts) - 1, -1, -1):
        later[i] = [upcoming.get(k, never) for k in inserts[i]]
        for k in lookups[i]:
            upcoming[k] = i
    held: dict[int, int] = {}  # page key -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key); stale entries skipped
    cached = total = 0
    for i, ids in enumerate(prompts):
        total += len(ids)
        n = 0
        for k in lookups[i]:
            if k not in held:
                break
            n += 1
        cached += n * PAGE
        for depth, (k, nxt) in enumerate(zip(inserts[i], later[i])):
            held[k] = nxt
            heapq.heappush(heap, (-nxt, -depth, k))
        while len(held) > cap:
            nxt, _, k = heapq.heappop(heap)
            if held.get(k) == -nxt:
                del held[k]
    return cached, total


def split_cache_hits(prompts: list[list[int]], direct_to: list[int | None]) -> list[int]:
    """Per request, the most prompt tokens it can hit when some requests go straight to a fixed worker.

    ``direct_to[i]``: the worker request ``i`` was sent to without the router, or None (routed).
    Every worker has an infinite page-``PAGE`` radix cache. Whatever a router does, worker ``w``
    only ever holds prompts that were sent to ``w``: the direct ones to ``w`` and some of the routed
    ones. So a routed request hits at most the longest page run any earlier prompt starts with (the
    router could have sent it where that prompt went), and a direct request to ``w`` at most the
    longest run of an earlier routed prompt or an earlier direct prompt *to w*. Each request takes
    its own best case (the cases need not be compatible, and a router would have to know where the
    next direct request goes), so the sum bounds every router, even one that knows the future.
    """
    anywhere: set[int] = set()  # pages of every earlier prompt
    routed: set[int] = set()  # pages of earlier routed prompts
    direct: dict[int, set[int]] = {}  # worker -> pages of earlier direct prompts to it
    out = []
    for ids, w in zip(prompts, direct_to):
        n = 0
        mine = direct.get(w, set()) if w is not None else set()
        for k in page_keys(ids[:-1]):
            if (k in anywhere) if w is None else (k in routed or k in mine):
                n += 1
            else:
                break
        out.append(n * PAGE)
        keys = page_keys(ids)
        anywhere.update(keys)
        (routed if w is None else direct.setdefault(w, set())).update(keys)
    return out


def follow_cache_hits(prompts: list[list[int]], direct_to: list[int | None], groups: list,
                      n_workers: int) -> list[float]:
    """Per request, the prompt tokens a router that cannot see the future can expect to hit when every
    direct request of a conversation goes to one worker drawn for it (``--foreign-by conversation``).

    ``groups[i]``: request ``i``'s conversation; ``n_workers``: how many workers the draw is over. It is
    :func:`split_cache_hits` with one change: the first direct request of a conversation that already had
    routed requests finds their pages on its worker only with probability ``1 / n_workers`` (the worker is
    drawn uniformly and independently of everything before, so no placement of those routed requests on
    one worker matches it more often); otherwise it hits only other conversations' routed pages and the
    direct pages of its own worker.  After that request the router can see where the conversation lives,
    and the optimistic rule of :func:`split_cache_hits` applies again.  An expectation for a router that
    follows the cache, not a bound: it does not model a router that copies one conversation onto several
    workers on purpose."""
    routed_by: dict[int, object] = {}  # page -> the one conversation whose routed prompts held it, or _MANY
    direct: dict[int, set[int]] = {}
    seen_routed: set = set()  # conversations with a routed request so far
    seen_direct: set = set()  # conversations with a direct request so far
    own = split_cache_hits(prompts, direct_to)
    out: list[float] = []
    for i, (ids, w, g) in enumerate(zip(prompts, direct_to, groups)):
        keys = page_keys(ids)
        hit = float(own[i])
        if w is not None and g not in seen_direct and g in seen_routed:
            mine = direct.get(w, set())
            n = 0
            for k in page_keys(ids[:-1]):
                o = routed_by.get(k)
                if (o is not None and o != g) or k in mine:
                    n += 1
                else:
                    break
            hit = hit / n_workers + (n_workers - 1) / n_workers * min(hit, n * PAGE)
        out.append(hit)
        if w is None:
            seen_routed.add(g)
            for k in keys:
                o = routed_by.get(k)
                routed_by[k] = g if o is None or o == g else _MANY
        else:
            seen_direct.add(g)
            direct.setdefault(w, set()).update(keys)
    return out


_MANY = object()  # a page routed by more than one conversation


def greedy_follow_hits(prompts: list[list[int]], direct_to: list[int | None], n_workers: int,
                       seeds: int = 8) -> float:
    """Prompt tokens per run (mean over ``seeds`` tie draws) that a load-blind router following the cache
    hits on this very stream: every worker an infinite page-``PAGE`` radix cache, each routed request sent
    to the worker holding its longest page run (ties drawn at random), each direct request to the worker
    it went to.  Not a bound (a router that copies a prefix onto several workers on purpose, or that knows
    where the next direct request goes, can do better); it shows what following the cache can reach when
    direct traffic lands where it does.  With direct traffic pinned per conversation its mean is close to
    :func:`follow_cache_hits` summed."""
    keys = [page_keys(ids) for ids in prompts]
    usable = [page_keys(ids[:-1]) for ids in prompts]  # the last prompt token is always computed
    total = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        held: list[set[int]] = [set() for _ in range(n_workers)]
        for ks, us, w in zip(keys, usable, direct_to):
            runs = []
            for h in held:
                n = 0
                for k in us:
                    if k not in h:
                        break
                    n += 1
                runs.append(n)
            if w is None:
                best = max(runs)
                w = rng.choice([i for i, n in enumerate(runs) if n == best])
            total += runs[w] * PAGE
            held[w].update(ks)
    return total / seeds


def split_cache_bound(prompts: list[list[int]], direct_to: list[int | None]) -> tuple[int, int]:
    """``(cached, prompt tokens)``: :func:`split_cache_hits` summed. It is :func:`infinite_cache_bound`
    when nothing goes direct, and never above it."""
    return sum(split_cache_hits(prompts, direct_to)), sum(len(p) for p in prompts)


# ------------------------------------------------------------------ metrics
def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            return r.read().decode()
    except OSError:
        return ""


def prediction_figures(texts: list[str]) -> dict:
    """Summed over routers and workers: answers judged, mean |predicted - reported|, predicted, reported."""
    from prometheus_client.parser import text_string_to_metric_families

    acc = {"count": 0.0, "abs_sum": 0.0, "exact": 0.0, "predicted": 0.0, "reported": 0.0}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "fleetserve_router_cache_prediction_abs_error_tokens_count":
                    acc["count"] += s.value
                elif s.name == "fleetserve_router_cache_prediction_abs_error_tokens_sum":
                    acc["abs_sum"] += s.value
                elif (s.name == "fleetserve_router_cache_prediction_abs_error_tokens_bucket"
                      and float(s.labels.get("le", "nan")) == 0.0):
                    acc["exact"] += s.value
                elif s.name == "fleetserve_router_cache_predicted_tokens_total":
                    acc["predicted"] += s.value
                elif s.name == "fleetserve_router_cache_reported_tokens_total":
                    acc["reported"] += s.value
    return acc


def stream_states(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in re.finditer(r'fleetserve_router_kv_stream_state\{[^}]*state="(\w+)"[^}]*\} 1\.0', text):
        out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out


# ------------------------------------------------------------------ scenarios
def routers(dp: bool, tok: str, have_peer: bool, baseline: bool,
            variants: tuple[str, ...] = ()) -> list[tuple[str, str, list[str]]]:
    """(label, kind, flags); kind ``base``: our router from ``--baseline-src`` (the code before a change)."""
    kv = ["--policy", "kv_aware", "--tokenizer-path", tok]
    out = [("round_robin", "ours", ["--policy", "round_robin"]),
           ("cache_aware (ours)", "ours", ["--policy", "cache_aware", *SAME])]
    if have_peer:
        out.append(("cache_aware (sglang-router)", "sglang", ["--policy", "cache_aware", *SAME]))
    if baseline:
        out.append(("kv_aware (before)", "base", kv))
    out.append(("kv_aware", "ours", kv))
    for v in variants:  # e.g. "--kv-load-weight 0.1"
        out.append((f"kv_aware {v}", "ours", [*kv, *shlex.split(v)]))
    if dp:
        if baseline:
            out.append(("kv_aware --dp-aware (before)", "base", [*kv, "--dp-aware"]))
        out.append(("kv_aware --dp-aware", "ours", [*kv, "--dp-aware"]))
    return out


def workload_argv(name: str, a: argparse.Namespace) -> list[str]:
    if name == "shared_prefix":
        return ["--workload", "shared_prefix", "--num-groups", str(a.groups), "--prompts-per-group",
                str(a.prompts_per_group), "--system-prompt-len", str(a.system_len), "--question-len",
                str(a.question_len), "--output-len", str(a.output_len)]
    return ["--workload", "multi_turn", "--num-conversations", str(a.conversations), "--num-turns", str(a.turns),
            "--question-len", str(a.question_len), "--output-len", str(a.output_len),
            "--multi-turn-replies", "synthetic", "--system-prompt-len", str(getattr(a, "mt_system_len", 0))]


SCENARIOS = {  # name: (workload, replicas, foreign share?, dp size)
    "pressure-shared_prefix": ("shared_prefix", 1, False, 1),
    "pressure-multi_turn": ("multi_turn", 1, False, 1),
    "replicas": ("multi_turn", 2, False, 1),
    "foreign": ("multi_turn", 1, True, 1),
    "dp": ("shared_prefix", 1, False, 2),
    "replicas-shared_prefix": ("shared_prefix", 2, False, 1),
    "foreign-shared_prefix": ("shared_prefix", 1, True, 1),
}


def worker_loads(url: str) -> dict:
    """A sim-worker's ``/get_server_info`` load and request count, or ``{}`` when it does not answer."""
    try:
        with urllib.request.urlopen(url + "/get_server_info", timeout=5) as r:
            d = json.loads(r.read())
    except (OSError, ValueError):
        return {}
    ld = d.get("load", {})
    return {"run": ld.get("num_running_reqs"), "wait": ld.get("num_waiting_reqs"),
            "free_kv": ld.get("free_kv_tokens"), "done": d.get("stats", {}).get("num_requests")}


def sim_clock(urls: list[str]) -> tuple[float, float]:
    """``(busy, late)`` seconds summed over the sim-workers' engines (``stats.busy_time_s``, ``stats.late_s``)."""
    busy = late = 0.0
    for u in urls:
        try:
            with urllib.request.urlopen(u + "/get_server_info", timeout=10) as r:
                st = json.loads(r.read()).get("stats", {})
        except (OSError, ValueError):
            continue
        busy += st.get("busy_time_s", 0.0)
        late += st.get("late_s", 0.0)
    return busy, late


def router_inflight(url: str) -> float | None:
    """Sum of the router's ``fleetserve_router_inflight_requests`` gauge, or None (no answer, sglang-router)."""
    total, seen = 0.0, False
    for line in scrape(url).splitlines():
        if line.startswith("fleetserve_router_inflight_requests"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def router_held(url: str) -> float | None:
    """kv_aware's ``fleetserve_router_kv_router_queue_pending_requests`` (requests waiting in the router,
    ``--router-queue-threshold``), or None without that gauge."""
    for line in scrape(url).splitlines():
        if line.startswith("fleetserve_router_kv_router_queue_pending_requests"):
            return float(line.rsplit(" ", 1)[1])
    return None


class Watch:
    """A thread writing the workers' and routers' state to ``log`` every ``every`` seconds during a run.

    When a run stops making progress (no worker admits a request for ``stall_s``) it says so in the log:
    the line shows whether the requests sit in the workers (running / waiting) or in the router
    (in flight at the router, nothing at the workers).
    """

    def __init__(self, log: Path, urls: list[str], rurls: list[str], every: float = 10.0, stall_s: float = 60.0):
        import threading

        self.log, self.urls, self.rurls, self.every, self.stall_s = log, urls, rurls, every, stall_s
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self.stalls = 0
        self.waiting_max = 0  # the largest summed num_waiting_reqs seen in a poll

    def __enter__(self) -> "Watch":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(timeout=30)

    def _run(self) -> None:
        t0, last_done, last_change = time.monotonic(), None, time.monotonic()
        with open(self.log, "a") as f:
            while not self._stop.wait(self.every):
                loads = [worker_loads(u) for u in self.urls]
                inflight = [router_inflight(u) for u in self.rurls]
                held = [router_held(u) for u in self.rurls]
                done = sum(x.get("done") or 0 for x in loads)
                self.waiting_max = max(self.waiting_max, sum(x.get("wait") or 0 for x in loads))
                now = time.monotonic()
                if done != last_done:
                    last_done, last_change = done, now
                stalled = now - last_change > self.stall_s
                self.stalls += stalled
                f.write(f"{now - t0:7.1f}s admitted {done} workers {loads} router in flight {inflight}"
                        + (f" held in the router {held}" if any(h is not None for h in held) else "")
                        + ("  STALLED" if stalled else "") + "\n")
                f.flush()


def direct_destinations(reqs, urls: list[str], rurls: list[str], share: float, seed: int,
                        by: str = "request") -> list[str]:
    """Where each request is sent: a router replica (at random) or, for a ``share`` of them, straight to a
    worker.  ``by="request"``: each direct request to a worker drawn at random; ``by="conversation"``: every
    direct request of one conversation (``r.group``) to the same worker, drawn once per conversation, as a
    client that bypasses the router holds one engine's address.  Which requests go direct and which replica a
    routed one reaches are the same draws for both (seeded), so the two modes differ only in the worker."""
    pick = random.Random(seed + 7)
    home_pick = random.Random(seed + 11)
    home: dict = {}
    dest = []
    for r in reqs:
        if pick.random() < share:
            w = pick.randrange(len(urls))  # drawn in both modes: the later draws stay the same
            if by == "conversation":
                g = r.group
                if g not in home:
                    home[g] = home_pick.randrange(len(urls))
                w = home[g]
            dest.append(urls[w])
        else:
            dest.append(rurls[pick.randrange(len(rurls))])
    return dest


def run_router(label: str, kind: str, flags: list[str], urls: list[str], nreplicas: int, foreign: float,
               reqs, bargs, a, rx, logdir: Path, tok, watch_every: float = 10.0) -> dict:
    from routing_experiment import flush, port_free, router_cmd, start, stop, wait_healthy

    flush(urls)
    base = _next_router_port[0]
    _next_router_port[0] = base + 8
    ports = [base + j for j in range(nreplicas)]
    for _ in range(60):
        if all(port_free(p) for p in ports):
            break
        time.sleep(1)
    else:
        raise RuntimeError(f"router ports {ports} are taken")
    env = None
    if kind == "base":
        env = dict(os.environ, PYTHONPATH=str(Path(a.baseline_src).resolve()))
    def own(p: int) -> list[str]:  # sglang-router replicas: each its own Prometheus port (default 29000)
        return [*flags, "--prometheus-port", str(p + 2000)] if kind == "sglang" else flags

    procs = [start(router_cmd("sglang" if kind == "sglang" else "ours", p, urls, own(p), a.peer_python),
                   logdir / f"router-{label}-{j}.log", env) for j, p in enumerate(ports)]
    rurls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        wait_healthy(rurls, procs, 120)
        states = {}
        if "kv_aware" in flags:
            time.sleep(2.0)  # sources subscribe within a second of start
            flush(urls)  # AllBlocksCleared in order: every stream goes exact
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                states = [stream_states(scrape(u)) for u in rurls]
                if all(s.get("exact", 0) == rx["streams"] for s in states):
                    break
                time.sleep(0.5)
            print(f"    streams before the run: {states}", flush=True)
        dest = direct_destinations(reqs, urls, rurls, foreign, a.seed, getattr(a, "foreign_by", "request"))
        clock0 = sim_clock(urls)
        t0 = time.monotonic()
        with Watch(logdir / f"watch-{label}.log", urls, rurls, every=watch_every) as watch:
            results, duration = asyncio.run(run_requests(
                rurls[0], reqs, api="chat", model=None, request_rate=bargs.request_rate, seed=bargs.seed,
                time_scale=bargs.time_scale, progress=False, url_for=lambda i, _r: dest[i],
                timeout_s=a.request_timeout * bargs.time_scale))
        wall = time.monotonic() - t0
        clock1 = sim_clock(urls)
        texts = [scrape(u) for u in rurls]
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"router {label} died during the run")
    finally:
        for p in procs:
            stop(p)
    s = report.summarize(results, duration, None, {"label": label})
    ok = [r for r in results if r.success]
    s["ttft_p90_s"] = float(np.percentile([r.ttft for r in ok], 90)) if ok else None
    s["label"], s["router"], s["router_flags"], s["wall_s"] = label, kind, flags, wall
    s["prediction"] = prediction_figures(texts) if kind != "sglang" else None
    s["streams_after"] = [stream_states(t) for t in texts]
    branches: dict[str, int] = {}
    for r in results:
        if r.route:
            b = dict(p.split("=", 1) for p in r.route.split("; ")).get("branch", "?")
            branches[b] = branches.get(b, 0) + 1
    s["branches"] = branches
    s["stalled_polls"] = watch.stalls
    s["worker_waiting_max"] = watch.waiting_max
    s["utilisation"] = (clock1[0] - clock0[0]) / (len(urls) * wall) if wall > 0 else 0.0
    s["loadavg_end"] = list(os.getloadavg())
    busy = clock1[0] - clock0[0]
    s["sim_late_share"] = (clock1[1] - clock0[1]) / busy if busy > 0 else 0.0
    s["errors"] = sorted({(r.error or "")[:120] for r in results if not r.success})
    s["direct_requests"] = sum(1 for d in dest if d in urls)
    # the p90 of the requests the router placed, and of those sent past it: with direct traffic the
    # overall p90 mixes in the direct share's misses, which no router can help
    routed = [r.ttft for i, r in enumerate(results) if r.success and dest[i] not in urls]
    direct = [r.ttft for i, r in enumerate(results) if r.success and dest[i] in urls]
    s["ttft_p90_routed_s"] = float(np.percentile(routed, 90)) if routed and direct else None
    s["ttft_p90_direct_s"] = float(np.percentile(direct, 90)) if direct else None
    s["requests"] = [{"rid": r.rid, "start": round(r.start, 4), "worker": r.worker, "ttft": round(r.ttft, 4),
                      "prompt": r.prompt_tokens, "cached": r.cached_tokens, "route": r.route,
                      "direct": dest[i] in urls} for i, r in enumerate(results)]
    # the bound, on the stream as it was sent
    by_rid = {q.rid: q for q in reqs}
    order = sorted(ok, key=lambda r: r.start)
    prompts = [tok.request_ids("/v1/chat/completions", {"messages": by_rid[r.rid].messages}) for r in order]
    c, t = infinite_cache_bound(prompts)
    s["bound_hit_rate"] = c / t if t else 0.0
    idx = {q.rid: i for i, q in enumerate(reqs)}
    direct_to = [urls.index(dest[idx[r.rid]]) if dest[idx[r.rid]] in urls else None for r in order]
    c2, t2 = split_cache_bound(prompts, direct_to)
    s["split_bound_hit_rate"] = c2 / t2 if t2 else 0.0
    s["bound_token_mismatch"] = sum(1 for r, p in zip(order, prompts) if len(p) != r.prompt_tokens)
    if any(d is not None for d in direct_to) and t2:
        s["greedy_hit_rate"] = greedy_follow_hits(prompts, direct_to, len(urls)) / t2
        if getattr(a, "foreign_by", "request") == "conversation":
            groups = [by_rid[r.rid].group for r in order]
            s["follow_hit_rate"] = sum(follow_cache_hits(prompts, direct_to, groups, len(urls))) / t2
    c3, t3 = finite_pool_bound(prompts, rx["streams"] * a.max_total_tokens)  # every worker's (rank's) pool
    s["pool_bound_hit_rate"] = c3 / t3 if t3 else 0.0
    pred = s["prediction"]
    mae = f"{pred['abs_sum'] / pred['count']:.0f}" if pred and pred["count"] else "-"
    print(f"  {label:<30} hit {s['cache_hit_rate']:6.1%} (bound {s['bound_hit_rate']:.1%}, "
          f"own-worker bound {s['split_bound_hit_rate']:.1%}, "
          + (f"follow-the-cache {s['greedy_hit_rate']:.1%}, " if "greedy_hit_rate" in s else "")
          + (f"expected {s['follow_hit_rate']:.1%}, " if "follow_hit_rate" in s else "")
          + f"pool bound {s['pool_bound_hit_rate']:.1%})  "
          f"{s['request_throughput']:7.2f} req/s  TTFT p50 {s['ttft_s']['p50'] * 1e3:7.1f} p90 "
          f"{s['ttft_p90_s'] * 1e3:7.1f} p99 {s['ttft_s']['p99'] * 1e3:7.1f} ms{_split_p90(s)}  MAE {mae}  "
          f"failed {s['failed']}  branches {branches}  sim late {s['sim_late_share']:.1%}  (wall {wall:.0f} s)",
          flush=True)
    if s["errors"] or watch.stalls:
        print(f"    errors {s['errors'][:3]}  stalled polls {watch.stalls} (see {logdir}/watch-{label}.log)",
              flush=True)
    return s


def _split_p90(s: dict) -> str:
    """`` (routed p90 X, direct p90 Y ms)`` for the console line when the run had direct traffic, else ""."""
    if s.get("ttft_p90_routed_s") is None:
        return ""
    return f" (routed p90 {s['ttft_p90_routed_s'] * 1e3:.1f}, direct p90 {s['ttft_p90_direct_s'] * 1e3:.1f})"


def table(rows: list[dict], direct: bool = False) -> str:
    """The markdown table of one scenario; ``direct``: add the own-worker bound column (direct traffic)."""
    ref = next((r for r in rows if r["label"] == "cache_aware (ours)"), rows[0])
    own_h, own_s = (" own-worker bound |", "---|") if direct else ("", "")
    split_h, split_s = (" routed p90 (ms) | routed p90 vs cache_aware |", "---|---|") if direct else ("", "")
    out = ["| router | hit rate | bound |" + own_h + " TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | "
           "p90 vs cache_aware (ours) |" + split_h + " out tok/s | req/s | pred. MAE (tokens) | exact guesses | pred. bias | failed "
           "| sim late | load avg |",
           "|---|---|---|" + own_s + "---|---|---|---|" + split_s + "---|---|---|---|---|---|---|---|"]
    from routing_kv_rate import routed_p90_cells

    for r in rows:
        p = r.get("prediction")
        if p and p["count"]:
            mae, ex = f"{p['abs_sum'] / p['count']:.0f}", f"{p['exact'] / p['count']:.0%}"
            bias = f"{(p['predicted'] - p['reported']) / p['reported']:+.0%}" if p["reported"] else "-"
        else:
            mae = ex = bias = "-"
        ratio = r["ttft_p90_s"] / ref["ttft_p90_s"] if ref["ttft_p90_s"] else float("nan")
        own = f"{r['split_bound_hit_rate']:.1%} | " if direct else ""
        late = f"{r['sim_late_share']:.0%}" if "sim_late_share" in r else "-"
        load = f"{r['loadavg_end'][0]:.0f}" if "loadavg_end" in r else "-"
        out.append(f"| {r['label']} | {r['cache_hit_rate']:.1%} | {r['bound_hit_rate']:.1%} | {own}"
                   f"{r['ttft_s']['p50'] * 1e3:.0f} | {r['ttft_p90_s'] * 1e3:.0f} | {r['ttft_s']['p99'] * 1e3:.0f} | "
                   f"{ratio:.2f}x | {routed_p90_cells(r, ref) + ' ' if direct else ''}{r['output_throughput']:.0f} | {r['request_throughput']:.2f} | {mae} | {ex} | "
                   f"{bias} | {r['failed']} | {late} | {load} |")
    return "\n".join(out)


def kv_part(a: argparse.Namespace) -> None:
    from routing_experiment import RESULTS, sim_loads_args, start, stop, wait_healthy

    if a.rates:
        import routing_kv_rate

        return routing_kv_rate.rate_part(a)

    from fleetserve.router.kv_events.tokenize import RouterTokenizer

    global HTTP0, EV0
    HTTP0, EV0 = HTTP0 + a.port_offset, EV0 + a.port_offset
    _next_router_port[0] += a.port_offset
    logdir = Path(a.log_dir)
    logdir.mkdir(parents=True, exist_ok=True)
    tdir = tokenizer_dir()
    tok = RouterTokenizer(tdir)
    have_peer = Path(a.peer_python).exists() and not a.no_peer
    out_file = RESULTS / f"{a.section}.json"
    all_rows = json.loads(out_file.read_text()) if out_file.exists() and a.keep else {}
    for name in a.scenarios:
        wname, nrep, foreign, dp = SCENARIOS[name]
        n = a.workers
        urls = [f"http://127.0.0.1:{HTTP0 + i}" for i in range(n)]
        cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{EV0}", "replay_endpoint": f"tcp://*:{EV0 + 200}",
               "topic": "kv"}
        scale = a.time_scale
        sim = ["--port", str(HTTP0), "--num-workers", str(n), "--time-scale", str(scale), "--stream-interval",
               str(a.stream_interval), "--max-total-tokens", str(a.max_total_tokens), "--page-size", str(PAGE),
               "--tokenizer", "smollm2", "--kv-events-config", json.dumps(cfg), *sim_loads_args(a)]
        if dp > 1:
            sim += ["--dp-size", str(dp)]
        wp = start([bench_cli.sys.executable, "-m", "fleetserve.cli", "sim-worker", *sim], logdir / f"sim-{name}.log")
        try:
            wait_healthy(urls, [wp], 180)
            rate = a.rate_per_worker * n if wname == "shared_prefix" else a.rate_per_worker_multi_turn * n
            bargs = bench_cli.build_parser().parse_args(
                [*workload_argv(wname, a), "--seed", str(a.seed), "--time-scale", str(scale),
                 "--request-rate", str(rate)])
            reqs = bench_cli.workload_from_args(bargs)
            share = a.foreign_share if foreign else 0.0
            print(f"== {name}: {n} workers x {dp} rank(s), {wname}, {len(reqs)} requests, {rate:g} req/s, "
                  f"{nrep} router(s), direct share {share:g}, KV {a.max_total_tokens} tokens per rank, "
                  f"k = {scale:g}", flush=True)
            rows = []
            all_rows[name] = {"workload": wname, "workers": n, "dp": dp, "replicas": nrep, "direct_share": share,
                              "rate": rate, "requests": len(reqs), "loads_api": a.sim_loads_api, "rows": rows}
            for label, kind, flags in routers(dp > 1, tdir, have_peer, bool(a.baseline_src), tuple(a.kv_variant)):
                if label in a.skip or (label == "round_robin" and not name.startswith("pressure")
                                       and not a.with_round_robin):
                    continue  # round robin: the pressure tables only (the reference; saves time)
                if kind == "base" and name == "dp":
                    continue  # the DP table compares --dp-aware on and off, both on this code
                rx = {"streams": n * dp}
                rows.append(run_router(label, kind, flags, urls, nrep, share, reqs, bargs, a, rx, logdir, tok))
                RESULTS.mkdir(exist_ok=True)
                out_file.write_text(json.dumps(all_rows, indent=1))
        finally:
            stop(wp)
        write_doc(a, all_rows, have_peer)


def cpu_model() -> str:
    """``lscpu``'s model name, or ``"unknown CPU"``."""
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def load_range(all_rows: dict) -> str:
    """The 1-minute load averages at the end of the rows, ``"lo-hi"`` (``"not recorded"`` for older rows)."""
    v = [r["loadavg_end"][0] for t in all_rows.values() for r in t["rows"] if "loadavg_end" in r]
    return f"{min(v):.0f}-{max(v):.0f}" if v else "not recorded"


def write_doc(a: argparse.Namespace, all_rows: dict, have_peer: bool) -> None:
    if a.no_doc:
        return
    from routing_experiment import sim_loads_note

    body = [
        "Simulated workers (`fleetserve sim-worker`, timing profile `h100-llama8b`, "
        f"`--page-size {PAGE}`, `--tokenizer smollm2`, `--stream-interval {a.stream_interval}`) publishing "
        "KV-cache events over ZMQ; kv_aware reads them with `--tokenizer-path` set to the same SmolLM2 "
        "tokenizer. The KV pool is small on purpose "
        f"(`--max-total-tokens {a.max_total_tokens}` per worker or DP rank), so caches evict. The simulation "
        f"runs k = {a.time_scale:g} times slower than the model and the client divides its clock by k: times "
        "and rates are model time. Workloads: shared_prefix "
        f"{a.groups} groups x {a.prompts_per_group} prompts (system {a.system_len} + question {a.question_len} "
        f"tokens); multi_turn {a.conversations} conversations x {a.turns} turns ({a.question_len}-token "
        f"questions, synthetic {a.output_len}-token answers in the history); {a.output_len} output tokens; "
        "Poisson arrivals, seed 0, the same requests for every row of a table. cache_aware rows (ours and "
        "sglang-router's) use sgl-router's default thresholds (cache 0.3, balance abs 64 / rel 1.5); kv_aware "
        "its defaults (`--kv-prefill-weight 1`, `--kv-load-weight 0.1`, speculative TTL 2 s, `/v1/loads` every 1 s). "
        "**hit rate**: cached / prompt tokens as the workers report them, over all requests (direct ones too). "
        "**bound**: the hit rate one infinite radix cache (page 16) would have had on the same requests in "
        "the order they were sent (each prompt hits the longest run of whole pages of `prompt[:-1]` that an "
        "earlier prompt starts with); no router can beat it. **own-worker bound** (tables with direct "
        "traffic): the same, except that a direct request hits only prompts that were routed (a router could "
        "have put them on its worker) or sent straight to *its own* worker earlier; a tighter bound that "
        "still holds for every router (`split_cache_bound`). Neither bound knows the KV pool is finite; the "
        "**pool bound** (the rate tables, and each run's log line) does: one cache of every worker's pool "
        "together that evicts offline-optimally (Belady's rule, `finite_pool_bound`), also a bound on every "
        "router. "
        "**sim late**: wall time the workers' steps ran past their modelled end, as a share of their modelled "
        "busy time (the 2 CPU cores could not keep up; a few % is harmless, tens of % inflate TTFT for every "
        "row alike). **load avg**: the machine's 1-minute load average when the row ended. "
        "multi_turn rates are those of the Poisson clock; a turn is sent no earlier than the previous answer "
        "of its conversation, so the rate reached (req/s column) is lower under load. **pred. MAE**: the router's "
        "`fleetserve_router_cache_prediction_abs_error_tokens` mean (predicted vs. the worker's reported "
        "cached tokens per answer; both replicas summed), **exact guesses** its `le=\"0\"` share, **bias** "
        "(predicted - reported) / reported; sglang-router has no such metric. "
        + ("" if have_peer else "sglang-router was not installed: its column is missing. ")
        + f"The machine ({cpu_model()}, 2 cores) was shared with other jobs while this ran (load average "
          f"{load_range(all_rows)}), so absolute figures are noisy; compare rows within a table. "
        + ("Rows `(before)` run the router from `--baseline-src`, the code before a change. " if a.baseline_src
           else "") + ("" if a.with_round_robin else "Round robin runs in the KV-pressure tables only. ")
        + sim_loads_note(a) + a.note, ""]
    titles = {"pressure-shared_prefix": "KV pressure, shared_prefix",
              "pressure-multi_turn": "KV pressure, multi_turn",
              "replicas": "two router replicas, traffic split at random",
              "foreign": f"{a.foreign_share:.0%} of the traffic straight to the workers"
                         + (" (each conversation's to one worker)" if a.foreign_by == "conversation" else ""),
              "dp": "DP attention, 2 ranks per worker (separate caches)"}
    for name, t in all_rows.items():
        body += [f"### {titles.get(name, name)} ({t['workers']} workers x {t['dp']} rank(s), {t['workload']}, "
                 f"{t['requests']} requests at {t['rate']:g} req/s)", "",
                 table(t["rows"], direct=bool(t.get("direct_share"))), ""]
    cmd = "python benchmarks/routing_experiment.py kv " + " ".join(shlex.quote(x) for x in a.argv)
    write_section(a.section, a.title, cmd.strip(), "\n".join(body))


def add_parser(sub) -> None:
    k = sub.add_parser("kv", help="kv_aware vs cache_aware on sim-workers with KV events")
    k.add_argument("--scenarios", nargs="+", default=list(SCENARIOS)[:5], choices=list(SCENARIOS),
                   help="tables to run (default: the first five; the *-shared_prefix ones are for --rates)")
    k.add_argument("--workers", type=int, default=4)
    k.add_argument("--time-scale", type=float, default=4.0)
    k.add_argument("--stream-interval", type=int, default=16)
    k.add_argument("--max-total-tokens", type=int, default=16_000)
    k.add_argument("--rate-per-worker", type=float, default=8.0)
    k.add_argument("--rate-per-worker-multi-turn", type=float, default=4.0)
    k.add_argument("--groups", type=int, default=24)
    k.add_argument("--prompts-per-group", type=int, default=8)
    k.add_argument("--system-len", type=int, default=2048)
    k.add_argument("--conversations", type=int, default=32)
    k.add_argument("--turns", type=int, default=6)
    k.add_argument("--question-len", type=int, default=128)
    k.add_argument("--output-len", type=int, default=128)
    k.add_argument("--mt-system-len", type=int, default=0,
                   help="multi_turn: tokens of a system prompt of each conversation's own (default none)")
    k.add_argument("--foreign-share", type=float, default=0.3)
    k.add_argument("--foreign-by", choices=("request", "conversation"), default="request",
                   help="direct traffic: each direct request to a random worker ('request'), or every direct "
                        "request of a conversation to one worker drawn for it ('conversation': a client that "
                        "bypasses the router keeps one engine's address)")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--request-timeout", type=float, default=120.0,
                   help="model seconds a request may take end to end before the client gives up (it counts "
                        "as failed): a stalled run ends instead of hanging; the watch-<router>.log files in "
                        "--log-dir show where requests sat")
    k.add_argument("--skip", nargs="*", default=[], help="router labels to leave out")
    k.add_argument("--no-peer", action="store_true", help="leave sglang-router out")
    k.add_argument("--with-round-robin", action="store_true",
                   help="round robin in every table (default: the KV-pressure tables only)")
    k.add_argument("--kv-variant", action="append", default=[],
                   help="extra kv_aware row with these router flags (repeatable), e.g. '--kv-load-weight 0.1'")
    k.add_argument("--baseline-src", default="",
                   help="a src/ folder of an earlier fleetserve: adds kv_aware rows of its router, '(before)'")
    k.add_argument("--keep", action="store_true", help="keep other scenarios' rows from the results file")
    k.add_argument("--port-offset", type=int, default=0,
                   help="added to every port (workers 21000.., events 22000.., routers 23000..): two runs at once")
    k.add_argument("--section", default="routing-kv")
    k.add_argument("--title", default="Routing: kv_aware vs cache_aware on simulated workers with KV events")
    k.add_argument("--note", default="")
    import routing_kv_rate

    routing_kv_rate.add_arguments(k)
