"""kv_aware vs cache_aware at open-loop arrival rates around their capacities (``kv --rates ...``).

The question (issue 12): the peers' large TTFT gains for precise KV routing come from
queueing. A router that wastes prefill work on misses saturates the workers at a lower
arrival rate; between the two routers' sustainable rates the worse router's queues grow
without bound while the better one's stay short. This part measures that directly:

1. **Capacity search.** For each router, open-loop Poisson probes (the same seeded
   requests, the arrival clock scaled to the rate) in a geometric bisection between
   ``--rate-lo`` and ``--rate-hi`` (requests/s, model time, whole fleet). A probe is
   *sustained* when few requests (3%) are still waiting for their first token at the last
   arrival (:func:`queue_growth`, :func:`sustained`). The routers are probed in lockstep (step i of both, then step
   i + 1), so the machine's load drifts over both alike.
2. **Rates.** :func:`choose_rates`: one below both capacities, points between them, one
   above both.
3. **Table.** Every router at every rate, interleaved (the order alternates per rate):
   hit rate, TTFT p50 / p90 / p99, req/s, the client-side backlog (requests waiting for a
   first token) at the end of the arrival window and its peak, the workers' waiting
   queue (polled), the workers' busy share (modelled step time / wall time), sim lateness,
   load average, and kv_aware's p90 over cache_aware's.

Open loop: arrivals never wait for an answer. shared_prefix is open loop as it is;
multi_turn with synthetic replies is made open loop by dropping the ``after`` link
(:func:`open_loop`): the history is fixed in advance, so turn t + 1 may arrive before
turn t has finished (it then misses the cache the earlier turn would have left).
``--mt-wait-reply`` keeps the link instead: a turn is sent at its arrival time or when the
previous turn's answer has ended, whichever is later, as a chat user would; over capacity
the arrivals then slow down with the answers, so the table's req/s and window say what
was offered.

Turn-major multi_turn (every first turn, then every second turn, ...) is not a steady
stream: the first quarter is all misses. ``--mt-stagger G`` (:func:`stagger`) interleaves
the conversations instead (conversation c's turn t in arrival slot c + t x G), so every
stretch of the window holds the same mix of turns and a rate over capacity stays over it.
``--repeats N`` runs every (rate, router) cell of the table N times, interleaved.
``--window-marks 0.33 0.67 1`` also cuts every run at those shares of its arrival window
(:func:`window_figures`): backlog and TTFT p90 against the window length from one long run.

A backlog over capacity grows linearly with the arrival window, so its p90 depends on
the run length: the table states the window (model seconds) of every rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
from pathlib import Path
from typing import Callable, Sequence


# ------------------------------------------------------------------ pure helpers (tested)
def open_loop(reqs: Sequence) -> list:
    """The requests with their ``after`` link removed (each one is sent at its own arrival time).

    Raises:
        ValueError: a request names ``history_from`` (real replies: it needs the earlier answer).
    """
    out = []
    for r in reqs:
        if getattr(r, "history_from", None) is not None:
            raise ValueError(f"request {r.rid} needs the answer of {r.history_from}: cannot be open loop "
                             "(use --multi-turn-replies synthetic)")
        out.append(dataclasses.replace(r, after=None))
    return out


def stagger(reqs: Sequence, gap: int) -> list:
    """multi_turn requests reordered so that conversations overlap in a steady stream.

    Conversation ``c``'s turn ``t`` goes to slot ``c + t * gap`` (slots in order; within a slot,
    later turns first). ``gap`` slots pass between two turns of a conversation, so about
    ``turns * gap`` requests arrive between them and about ``turns * gap`` conversations are
    live at once. After a ramp of ``(turns - 1) * gap`` slots every slot holds one request of
    each turn, so the mix (first turns, which miss for every router, and later turns) stays the
    same over the arrival window: a rate over capacity then stays over it, which the turn-major
    order (every first turn, then every second turn, ...) does not give. ``gap`` 0: unchanged.

    Needs ``meta["turn"]`` and ``group`` ``"c<i>"`` (:func:`fleetserve.bench.workloads.multi_turn`).

    Raises:
        ValueError: ``gap`` < 0, or a request without a turn.
    """
    if gap < 0:
        raise ValueError(f"--mt-stagger must be >= 0, got {gap}")
    if gap == 0:
        return list(reqs)
    def key(r) -> tuple[int, int]:
        t = r.meta.get("turn") if getattr(r, "meta", None) else None
        if t is None or not str(r.group).startswith("c"):
            raise ValueError(f"request {r.rid} is not a multi_turn turn: cannot stagger")
        return int(str(r.group)[1:]) + t * gap, -t

    return sorted(reqs, key=key)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """The arrival times (s) ``fleetserve.bench.client.run_requests`` uses for ``n`` requests at ``rate``/s.

    Same generator, same draws: ``random.Random(seed).expovariate(rate)`` gaps, first at 0.
    The shape is the same at every rate (times scale as 1 / rate).
    """
    import random

    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def backlog(starts: Sequence[float], ttfts: Sequence[float], t: float) -> int:
    """Requests that arrived at or before ``t`` and had no first token by ``t``.

    ``starts``: send times (s); ``ttfts``: time to first token (s), ``math.inf`` for a
    request that never got one (failed). Little's law below capacity; grows as
    (arrival rate - service rate) x t above it.
    """
    return sum(1 for s, f in zip(starts, ttfts) if s <= t < s + f)


def queue_growth(starts: Sequence[float], ttfts: Sequence[float]) -> dict:
    """Backlog at the middle and at the end of the arrival window, and its peak over 20 points.

    Returns ``{"window_s", "mid", "end", "peak", "growth"}`` (``growth = end - mid``).
    The middle, not the start: the first requests run on cold caches.
    """
    if not starts:
        return {"window_s": 0.0, "mid": 0, "end": 0, "peak": 0, "growth": 0}
    t_end = max(starts)
    mid, end = backlog(starts, ttfts, t_end / 2), backlog(starts, ttfts, t_end)
    peak = max(backlog(starts, ttfts, t_end * i / 20) for i in range(1, 21))
    return {"window_s": t_end, "mid": mid, "end": end, "peak": peak, "growth": end - mid}


def window_figures(starts: Sequence[float], ttfts: Sequence[float], prompts: Sequence[int],
                   cached: Sequence[int], marks: Sequence[float], groups: Sequence[str] | None = None,
                   workers: Sequence[str | None] | None = None) -> list[dict]:
    """Figures of the run cut at shares ``marks`` of its arrival window (what a shorter run would show).

    For each mark ``m`` (0 < m <= 1, ascending), ``t = m x`` the last arrival: ``backlog`` at ``t``
    (:func:`backlog`), and over the requests that arrived by ``t`` (cumulative: the run as if its window
    ended at ``t``) their count ``arrived``, TTFT p90 ``p90_s`` (linear-interpolated, successes only,
    None when none) and ``failed`` (no first token, ``ttft`` inf); over the requests that arrived in
    ``(t_prev, t]`` only (the segment) ``seg_p90_s`` and ``seg_hit`` (cached / prompt tokens of its
    successes). ``starts``, ``ttfts``: s; ``prompts``, ``cached``: tokens per request. With ``groups``
    (a conversation per request) and ``workers`` (the worker that served it, None if unknown) also
    ``seg_moved``: of the segment's requests whose conversation had an earlier request (by arrival),
    the share served by another worker than that earlier one (a later turn leaving its history's
    cache; None when the segment has no such request).

    The cut is causal: what happens to a request depends on the arrivals before it, and the sim-workers
    schedule FIFO, so the figures up to ``t`` are close to those of a run whose window ends at ``t`` (it
    differs only in the ramp-down of a staggered stream's last slots and in what the later arrivals take
    from the backlog's prefill).

    Raises:
        ValueError: a mark outside (0, 1], or marks not ascending.
    """
    import numpy as np

    if any(not 0 < m <= 1 for m in marks) or list(marks) != sorted(marks):
        raise ValueError(f"window marks must be ascending shares in (0, 1], got {list(marks)}")
    if not starts:
        return []
    t_end, out, prev = max(starts), [], -math.inf
    before: list[str | None] = [None] * len(starts)  # the worker of the conversation's previous request
    if groups is not None and workers is not None:
        last: dict[str, str | None] = {}
        for i in sorted(range(len(starts)), key=lambda i: starts[i]):
            before[i] = last.get(groups[i])
            last[groups[i]] = workers[i]
    for m in marks:
        t = m * t_end

        def sel(lo: float) -> list[int]:
            return [i for i, s in enumerate(starts) if lo < s <= t]

        cum, seg = sel(-math.inf), sel(prev)

        def p90(ix: list[int]) -> float | None:
            ok = [ttfts[i] for i in ix if math.isfinite(ttfts[i])]
            return float(np.percentile(ok, 90)) if ok else None

        okseg = [i for i in seg if math.isfinite(ttfts[i])]
        follow = [i for i in seg if before[i] is not None and workers is not None and workers[i] is not None]
        ptok = sum(prompts[i] for i in okseg)
        out.append({"share": m, "t": t, "arrived": len(cum), "backlog": backlog(starts, ttfts, t),
                    "p90_s": p90(cum), "failed": sum(1 for i in cum if not math.isfinite(ttfts[i])),
                    "seg_p90_s": p90(seg), "seg_hit": sum(cached[i] for i in okseg) / ptok if ptok else 0.0,
                    "seg_moved": (sum(1 for i in follow if workers[i] != before[i]) / len(follow)
                                  if follow else None)})
        prev = t
    return out


def sustained(q: dict, n_requests: int, tol: float = 0.03, floor: int = 4) -> bool:
    """A probe kept up when, at the last arrival, at most ``max(floor, tol * n_requests)`` requests
    were still waiting for their first token (``q["end"]`` of :func:`queue_growth`).

    Over capacity by a share ``e`` a stationary stream leaves about ``e / (1 + e) * n`` requests
    behind at the last arrival, so the default (3%) calls a rate unsustainable from about 3-4%
    over capacity; below capacity the backlog is Little's law's rate x TTFT, a few requests.
    The end, not the growth from the middle: a multi_turn stream sent turn by turn is not
    stationary (all first turns, which miss, come first), so a queue built in the first half
    can shrink in the second even over capacity; what is left at the end is what was not served.
    """
    return q["end"] <= max(floor, tol * n_requests)


def bisect_rates(probes: dict[str, Callable[[float], bool]], lo: float, hi: float, steps: int,
                 widen: int = 2) -> dict[str, tuple[float | None, float | None]]:
    """Per name, ``(highest rate sustained, lowest rate not sustained)`` by geometric bisection.

    ``probes``: name -> ``probe(rate) -> bool``. All names are probed in lockstep: first ``lo``
    (halved up to ``widen`` times while it fails), then, if ``lo`` held at once, ``hi`` (doubled up
    to ``widen`` times while it holds), then ``steps`` midpoints ``sqrt(a * b)`` of each bracket. A side that
    never flipped stays None.
    """
    br: dict[str, list[float | None]] = {k: [None, None] for k in probes}
    for k, probe in probes.items():  # the low end
        r = lo
        for i in range(widen + 1):
            if probe(r):
                br[k][0] = r
                break
            br[k][1] = r
            r /= 2
    for k, probe in probes.items():  # the high end, unless lo already failed (then it is known)
        if br[k][0] is None or br[k][1] is not None:
            continue
        r = hi
        for i in range(widen + 1):
            if not probe(r):
                br[k][1] = r
                break
            br[k][0] = r
            r *= 2
    for _ in range(steps):
        for k, probe in probes.items():
            a, b = br[k]
            if a is None or b is None:
                continue
            m = math.sqrt(a * b)
            br[k][0 if probe(m) else 1] = m
    return {k: (v[0], v[1]) for k, v in br.items()}


def choose_rates(caps: Sequence[float], between: int = 2, below: float = 0.7, above: float = 1.3) -> list[float]:
    """Rates for the table: ``below x`` the lowest capacity, ``between`` points spaced
    geometrically strictly inside (lowest, highest), ``above x`` the highest (none when
    ``above`` is 0). Sorted.

    Raises:
        ValueError: no capacity, or one <= 0.
    """
    if not caps or min(caps) <= 0:
        raise ValueError(f"capacities must be > 0, got {list(caps)}")
    lo, hi = min(caps), max(caps)
    out = [lo * below]
    out += [lo * (hi / lo) ** ((i + 1) / (between + 1)) for i in range(between)] if hi > lo else []
    if above > 0:
        out.append(hi * above)
    return sorted(out)


def capacity_point(bracket: tuple[float | None, float | None]) -> float | None:
    """One figure for a bracket: the geometric middle, or the known side."""
    a, b = bracket
    if a is not None and b is not None:
        return math.sqrt(a * b)
    return a if a is not None else b


# ------------------------------------------------------------------ the run
def _row_figures(s: dict) -> dict:
    """Queue figures of one run summary (``s["requests"]`` from routing_kv.run_router)."""
    rq = s["requests"]
    starts = [r["start"] for r in rq]
    ttfts = [r["ttft"] if r["ttft"] and r["ttft"] > 0 else math.inf for r in rq]
    return queue_growth(starts, ttfts)


def _window_rows(s: dict, marks: Sequence[float]) -> list[dict]:
    """:func:`window_figures` of one run summary (``s["requests"]``), ``[]`` without marks."""
    if not marks:
        return []
    rq = s["requests"]
    return window_figures([r["start"] for r in rq],
                          [r["ttft"] if r["ttft"] and r["ttft"] > 0 else math.inf for r in rq],
                          [r["prompt"] or 0 for r in rq], [r["cached"] or 0 for r in rq], marks,
                          [str(r["rid"]).split("-t")[0] for r in rq], [r.get("worker") for r in rq])


# the flags write_rate_doc describes a run by: kept in the results file so that a render describes the
# run that measured, whatever the render's own command line says
RUN_SETTINGS = ("conversations", "turns", "mt_system_len", "question_len", "output_len", "groups",
                "prompts_per_group", "system_len", "stream_interval", "max_total_tokens", "time_scale",
                "watch_every", "note", "window_marks", "foreign_by", "title", "sim_loads_api")


def as_run(a: argparse.Namespace, res: dict) -> argparse.Namespace:
    """``a`` with the settings the results file recorded (:data:`RUN_SETTINGS`) in place of the render's own
    flags, so that a re-rendered section describes the run that measured; a file without them: ``a``."""
    return argparse.Namespace(**{**vars(a), **res.get("settings", {})})


def rate_part(a: argparse.Namespace) -> None:
    import routing_kv as rk
    from routing_experiment import RESULTS, sim_loads_args, start, stop, wait_healthy
    from doc_section import now_stamp

    from fleetserve.bench import cli as bench_cli
    from fleetserve.router.kv_events.tokenize import RouterTokenizer

    rk.HTTP0, rk.EV0 = rk.HTTP0 + a.port_offset, rk.EV0 + a.port_offset
    rk._next_router_port[0] += a.port_offset
    logdir = Path(a.log_dir)
    logdir.mkdir(parents=True, exist_ok=True)
    tdir = rk.tokenizer_dir()
    tok = RouterTokenizer(tdir)
    have_peer = Path(a.peer_python).exists() and not a.no_peer
    if len(a.scenarios) != 1:
        raise SystemExit("kv --rates: give exactly one --scenarios")
    if a.repeats < 1:
        raise SystemExit(f"kv --rates: --repeats must be >= 1, got {a.repeats}")
    if a.mt_stagger < 0:
        raise SystemExit(f"kv --rates: --mt-stagger must be >= 0, got {a.mt_stagger}")
    if any(not 0 < m <= 1 for m in a.window_marks) or a.window_marks != sorted(a.window_marks):
        raise SystemExit(f"kv --rates: --window-marks must be ascending shares in (0, 1], got {a.window_marks}")
    name = a.scenarios[0]
    if a.rates == ["render"]:  # rewrite the doc section from the results file of an earlier run
        path = RESULTS / f"{a.section}.json"
        if not path.exists():
            raise SystemExit(f"kv --rates render: no results file {path} for --section {a.section}")
        res = json.loads(path.read_text())
        write_rate_doc(as_run(a, res), res)
        return
    wname, nrep, foreign, dp = rk.SCENARIOS[name]
    n = a.workers
    urls = [f"http://127.0.0.1:{rk.HTTP0 + i}" for i in range(n)]
    cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{rk.EV0}", "replay_endpoint": f"tcp://*:{rk.EV0 + 200}",
           "topic": "kv"}
    sim = ["--port", str(rk.HTTP0), "--num-workers", str(n), "--time-scale", str(a.time_scale),
           "--stream-interval", str(a.stream_interval), "--max-total-tokens", str(a.max_total_tokens),
           "--page-size", str(rk.PAGE), "--tokenizer", "smollm2", "--kv-events-config", json.dumps(cfg),
           *sim_loads_args(a)]
    if dp > 1:
        sim += ["--dp-size", str(dp)]
    rows_def = [r for r in rk.routers(dp > 1, tdir, have_peer, bool(a.baseline_src), tuple(a.kv_variant))
                if r[0] not in a.skip and (r[0] != "round_robin" or a.with_round_robin)]
    share = a.foreign_share if foreign else 0.0
    out_file = RESULTS / f"{a.section}.json"
    res: dict = {"scenario": name, "workload": wname, "workers": n, "replicas": nrep, "direct_share": share,
                 "command": "python benchmarks/routing_experiment.py kv " + " ".join(shlex.quote(x) for x in a.argv),
                 "date": now_stamp(), "settings": {k: getattr(a, k, None) for k in RUN_SETTINGS},
                 "probes": [], "rows": [], "loads": [list(os.getloadavg())]}

    def save() -> None:
        RESULTS.mkdir(exist_ok=True)
        out_file.write_text(json.dumps(res, indent=1))

    reqs0 = None

    def run(label: str, kind: str, flags: list[str], rate: float) -> dict:
        bargs = bench_cli.build_parser().parse_args(
            [*rk.workload_argv(wname, a), "--seed", str(a.seed), "--time-scale", str(a.time_scale),
             "--request-rate", str(rate)])
        s = rk.run_router(label, kind, flags, urls, nrep, share, reqs0, bargs, a, {"streams": n * dp}, logdir, tok,
                          watch_every=a.watch_every)
        s["rate"] = rate
        s["queue"] = _row_figures(s)
        s["windows"] = _window_rows(s, a.window_marks)
        print(f"    rate {rate:.1f}: backlog mid {s['queue']['mid']} end {s['queue']['end']} peak "
              f"{s['queue']['peak']}  workers waiting max {s.get('worker_waiting_max')}  "
              f"utilisation {s.get('utilisation', 0):.0%}", flush=True)
        return s

    wp = start([bench_cli.sys.executable, "-m", "fleetserve.cli", "sim-worker", *sim], logdir / f"sim-rate-{name}.log")
    try:
        wait_healthy(urls, [wp], 180)
        bargs0 = bench_cli.build_parser().parse_args(
            [*rk.workload_argv(wname, a), "--seed", str(a.seed), "--time-scale", str(a.time_scale)])
        reqs0 = bench_cli.workload_from_args(bargs0)
        res["wait_reply"] = wname == "multi_turn" and a.mt_wait_reply  # each turn keeps its `after` link
        if not res["wait_reply"]:
            reqs0 = open_loop(reqs0)
        if wname == "multi_turn":
            reqs0 = stagger(reqs0, a.mt_stagger)
        res["requests"] = len(reqs0)
        res["stagger"] = a.mt_stagger if wname == "multi_turn" else 0
        print(f"== rate experiment {name}: {n} workers, {wname}, {len(reqs0)} requests, {nrep} router(s), "
              f"direct share {share:g}, KV {a.max_total_tokens} tokens per worker, k = {a.time_scale:g}; "
              f"routers {[r[0] for r in rows_def]}", flush=True)
        caps: dict[str, float] = {}
        if a.rates == ["search"]:
            def probe_for(label: str, kind: str, flags: list[str]) -> Callable[[float], bool]:
                def probe(rate: float) -> bool:
                    s = run(label, kind, flags, rate)
                    ok = sustained(s["queue"], len(reqs0)) and not s["failed"]
                    res["probes"].append({k: s[k] for k in ("label", "rate", "queue", "cache_hit_rate", "ttft_p90_s",
                                                            "sim_late_share", "loadavg_end", "failed",
                                                            "utilisation", "worker_waiting_max")} | {"sustained": ok})
                    save()
                    print(f"    probe {label} at {rate:.1f} req/s: {'sustained' if ok else 'NOT sustained'}",
                          flush=True)
                    return ok
                return probe

            brackets = bisect_rates({lbl: probe_for(lbl, kind, fl) for lbl, kind, fl in rows_def},
                                    a.rate_lo, a.rate_hi, a.search_steps)
            res["brackets"] = brackets
            for lbl, b in brackets.items():
                c = capacity_point(b)
                if c is None:
                    raise SystemExit(f"no capacity found for {lbl} in [{a.rate_lo}, {a.rate_hi}]")
                caps[lbl] = c
            res["capacities"] = caps
            rates = choose_rates(list(caps.values()), between=a.between, below=a.rate_below, above=a.rate_above)
        else:
            rates = sorted(float(x) for x in a.rates)
        res["rates"] = rates
        save()
        print(f"== table rates {[round(r, 1) for r in rates]} (capacities {caps})", flush=True)
        cells = [(rate, rep) for rate in rates for rep in range(a.repeats)]
        for i, (rate, rep) in enumerate(cells):  # the order of the routers alternates from cell to cell
            order = rows_def if i % 2 == 0 else list(reversed(rows_def))
            for lbl, kind, fl in order:
                s = run(lbl, kind, fl, rate)
                if a.dump_requests:  # every request's route, worker and TTFT, for a look at the decisions
                    (logdir / f"requests-{lbl.replace(' ', '_')}-{rate:g}-{rep}.json").write_text(
                        json.dumps(s["requests"]))
                s.pop("requests", None)
                s["rep"] = rep
                res["rows"].append(s)
                save()
    finally:
        stop(wp)
        res["loads"].append(list(os.getloadavg()))
        save()
    write_rate_doc(a, res)


def routed_p90_cells(r: dict, ref: dict | None) -> str:
    """``routed p90 (ms) | / cache_aware's |`` cells: the TTFT p90 of the requests the router placed
    (direct traffic excluded), and its ratio to ``ref``'s; ``-`` where a row has no split."""
    v = r.get("ttft_p90_routed_s")
    if v is None:
        return "- | - |"
    rv = ref.get("ttft_p90_routed_s") if ref else None
    return f"{v * 1e3:.0f} | " + (f"{v / rv:.2f}x |" if rv else "- |")


def rate_table(res: dict) -> str:
    """Markdown: one row per (rate, router), in rate order, with kv_aware's p90 over cache_aware's."""
    direct = any(r.get("ttft_p90_direct_s") is not None for r in res["rows"])  # a share went past the router
    follow = any("greedy_hit_rate" in r for r in res["rows"])  # simulated for runs with direct traffic
    own_h = (" own-worker bound |" if direct else "") + (" follow-the-cache |" if follow else "")
    head = ("| rate (req/s) | run | window (s) | router | hit rate | bound |" + own_h + " pool bound | TTFT p50 (ms) | "
            "TTFT p90 (ms) | TTFT p99 (ms) | "
            "p90 / cache_aware's | routed p90 (ms) | routed p90 / cache_aware's | req/s | backlog mid / end / peak | workers waiting max | busy | "
            "failed | sim late | load avg |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    by_rate: dict[float, list[dict]] = {}
    for r in res["rows"]:
        by_rate.setdefault(r["rate"], []).append(r)
    for rate in sorted(by_rate):
        rows = by_rate[rate]
        for r in sorted(rows, key=lambda r: (r.get("rep", 0), r["label"])):
            ref = next((x for x in rows if x["label"] == "cache_aware (ours)" and x.get("rep", 0) == r.get("rep", 0)),
                       None)  # the same repeat's cache_aware row
            q = r["queue"]
            bound = f"{r['bound_hit_rate']:.1%}" if "bound_hit_rate" in r else "-"
            pool = f"{r['pool_bound_hit_rate']:.1%}" if "pool_bound_hit_rate" in r else "-"  # older results: none
            own = (f" {r['split_bound_hit_rate']:.1%} |" if "split_bound_hit_rate" in r else " - |") if direct else ""
            if follow:
                own += f" {r['greedy_hit_rate']:.1%} |" if "greedy_hit_rate" in r else " - |"
            ratio = (f"{r['ttft_p90_s'] / ref['ttft_p90_s']:.2f}x"
                     if ref and ref.get("ttft_p90_s") and r.get("ttft_p90_s") else "-")
            p90 = f"{r['ttft_p90_s'] * 1e3:.0f}" if r.get("ttft_p90_s") else "-"
            out.append(
                f"| {rate:.1f} | {r.get('rep', 0) + 1} | {q['window_s']:.1f} | {r['label']} | {r['cache_hit_rate']:.1%} | "
                f"{bound} |{own} {pool} | "
                f"{r['ttft_s']['p50'] * 1e3:.0f} | {p90} | {r['ttft_s']['p99'] * 1e3:.0f} | {ratio} | "
                f"{routed_p90_cells(r, ref)} "
                f"{r['request_throughput']:.1f} | {q['mid']} / {q['end']} / {q['peak']} | "
                f"{r.get('worker_waiting_max', '-')} | {r.get('utilisation', 0):.0%} | {r['failed']} | "
                f"{r['sim_late_share']:.0%} | {r['loadavg_end'][0]:.1f} |")
    return "\n".join(out)


def window_table(res: dict) -> str:
    """Markdown: per (rate, repeat, router) the run cut at each window mark (:func:`window_figures`),
    with the p90 over the same repeat's cache_aware row cut at the same mark; "" when no row has cuts."""
    rows = [r for r in res["rows"] if r.get("windows")]
    if not rows:
        return ""
    out = ["| rate (req/s) | run | router | cut at (s) | arrived | backlog at cut | TTFT p90 up to cut (ms) | "
           "p90 / cache_aware's | segment hit rate | segment moved | segment p90 (ms) | failed |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}"

    for r in sorted(rows, key=lambda r: (r["rate"], r.get("rep", 0), r["label"])):
        ref = next((x for x in rows if x["label"] == "cache_aware (ours)" and x["rate"] == r["rate"]
                    and x.get("rep", 0) == r.get("rep", 0)), None)
        for j, w in enumerate(r["windows"]):
            rw = ref["windows"][j] if ref and j < len(ref["windows"]) else None
            ratio = (f"{w['p90_s'] / rw['p90_s']:.2f}x" if rw and rw.get("p90_s") and w.get("p90_s") else "-")
            moved = "-" if w.get("seg_moved") is None else f"{w['seg_moved']:.0%}"
            out.append(f"| {r['rate']:.1f} | {r.get('rep', 0) + 1} | {r['label']} | {w['t']:.1f} | {w['arrived']} | "
                       f"{w['backlog']} | {ms(w['p90_s'])} | {ratio} | {w['seg_hit']:.1%} | {moved} | {ms(w['seg_p90_s'])} | "
                       f"{w['failed']} |")
    return "\n".join(out)


def probe_table(res: dict) -> str:
    out = ["| probe | router | rate (req/s) | sustained | backlog mid / end | hit rate | TTFT p90 (ms) | "
           "busy | sim late | load avg |", "|---|---|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(res["probes"]):
        q = p["queue"]
        p90 = f"{p['ttft_p90_s'] * 1e3:.0f}" if p.get("ttft_p90_s") else "-"
        out.append(f"| {i + 1} | {p['label']} | {p['rate']:.1f} | {'yes' if p['sustained'] else 'no'} | "
                   f"{q['mid']} / {q['end']} | {p['cache_hit_rate']:.1%} | {p90} | {p.get('utilisation', 0):.0%} | "
                   f"{p['sim_late_share']:.0%} | {p['loadavg_end'][0]:.1f} |")
    return "\n".join(out)


def write_rate_doc(a: argparse.Namespace, res: dict) -> None:
    from doc_section import now_stamp, write_section
    from routing_experiment import sim_loads_note

    if a.no_doc:
        return
    import routing_kv as rk

    lo = min(x[0] for x in res["loads"] + [r["loadavg_end"] for r in res["rows"]])
    hi = max(x[0] for x in res["loads"] + [r["loadavg_end"] for r in res["rows"]])
    wl = (f"shared_prefix {a.groups} groups x {a.prompts_per_group} prompts (system {a.system_len} + question "
          f"{a.question_len} tokens)" if res["workload"] == "shared_prefix" else
          f"multi_turn {a.conversations} conversations x {a.turns} turns"
          + (f" (a {a.mt_system_len}-token system prompt of each conversation's own)" if a.mt_system_len else "")
          + f", {a.question_len}-token user turns, synthetic answers, "
          + ("each turn sent at its arrival time or when the previous turn's answer has ended, whichever is "
             "later (`--mt-wait-reply`: a user waits for the reply; over capacity the arrivals slow down)"
             if res.get("wait_reply") else "open loop (a turn does not wait for the previous answer)")
          + (f", staggered (`--mt-stagger {res['stagger']}`: conversation c's turn t in arrival slot c + t x "
             f"{res['stagger']}, so every stretch of the stream holds all turns alike)" if res.get("stagger") else
             ", turn-major (every first turn, then every second turn, ...)"))
    body = [
        f"Simulated workers: {res['workers']} `fleetserve sim-worker`s (profile `h100-llama8b`, `--page-size "
        f"{rk.PAGE}`, `--tokenizer smollm2`, KV pool `--max-total-tokens {a.max_total_tokens}` per worker, "
        f"`--stream-interval {a.stream_interval}`), k = {a.time_scale:g} (the sims run k times slower, the client "
        f"divides its clock by k: every time and rate here is model time). {res['replicas']} router "
        f"replica(s), each request to one at random (seeded)"
        + ((f", {res['direct_share']:.0%} of the requests straight to a worker, "
            + ("every direct request of a conversation to one worker drawn for it (`--foreign-by conversation`)"
               if getattr(a, "foreign_by", "request") == "conversation" else "each to a random one"))
           if res["direct_share"] else "")
        + f". Workload: {wl}, {a.output_len} output tokens, {res['requests']} requests per run, "
        + ("Poisson arrival times (seed 0; the same requests and the same arrival shape at every rate, times scaled "
           "by 1 / rate; a later turn goes at its time or after the previous answer, as above). "
           if res.get("wait_reply") else
           "open-loop Poisson arrivals (seed 0; the same requests and the same arrival shape at every rate, times "
           "scaled by 1 / rate). ")
        + "Every run starts with flushed worker caches and fresh routers. cache_aware: sgl-router's default "
        "thresholds (cache 0.3, balance abs 64 / rel 1.5); kv_aware: its defaults. "
        "**bound**: the hit rate of one infinite page-16 radix cache over the same requests in arrival order "
        "(no router can beat it); **own-worker bound** (with direct traffic): the same, except that a direct "
        "request can only hit what was routed earlier or sent straight to its own worker (`split_cache_bound`); "
        "**pool bound**: one cache the size of every worker's pool together, evicting offline-optimally "
        "(`finite_pool_bound`). "
        + ("**follow-the-cache**: the hit rate of a load-blind router that sends each routed request to the "
           "worker holding its longest prefix (ties at random, mean of 8 draws), on the same stream with the "
           "same direct destinations and infinite caches (`greedy_follow_hits`): what following the cache can "
           "reach when the direct requests land where they did; not a bound. "
           if any("greedy_hit_rate" in r for r in res["rows"]) else "")
        + "**window**: the arrival window (first to last arrival, model s); over capacity the backlog, and so "
        "the p90/p99, grow with it. **backlog**: requests that had arrived and had no first token yet, at the "
        "middle / end of the window, and its peak over 20 points (from the client's timestamps). **workers "
        "waiting max**: the largest summed `num_waiting_reqs` of the workers, polled every "
        f"{a.watch_every:g} s of wall time. **busy**: the workers' modelled step time (prefill or decode) over "
        "wall time; a worker decodes whenever anything runs, so this nears 100% well below capacity and is not "
        "a capacity measure. **sim late**: how far the simulated steps ran past their modelled end, as a share "
        "of busy time (a few % is harmless). **load avg**: the machine's 1-minute load average at the end of "
        f"the row (2 cores, shared; {lo:.1f}-{hi:.1f} over the run). " + sim_loads_note(a) + a.note, ""]
    if res.get("probes"):
        body += ["### Capacity search (open-loop probes, geometric bisection, routers in lockstep)", "",
                 "A probe is *sustained* when at most max(4, 3% of the requests) were still waiting for their first "
                 "token at the last arrival (backlog end).", "", probe_table(res), ""]
        caps = res.get("capacities", {})
        def side(x: float | None) -> str:
            return "?" if x is None else f"{x:.1f}"

        body += ["Sustainable rate (geometric middle of the last bracket; a `?` side never flipped in the search, "
                 "so the figure is only a bound): "
                 + ", ".join(f"{k} {v:.1f} req/s (sustained {side(res['brackets'][k][0])}, not sustained "
                             f"{side(res['brackets'][k][1])})" for k, v in caps.items()) + ".", ""]
    body += [f"### Every router at every rate ({res['scenario']}, order alternating per rate)", "",
             rate_table(res), ""]
    wt = window_table(res)
    if wt:
        body += ["### Backlog and TTFT p90 against the arrival window (each run cut at shares "
                 f"{', '.join(f'{m:g}' for m in a.window_marks)} of its window)", "",
                 "**cut at**: model s after the first arrival; **arrived**, **TTFT p90 up to cut**, **failed**: over "
                 "the requests that arrived by then (the run as if its window had ended there: what happens to a "
                 "request depends only on earlier arrivals, and the sims schedule FIFO); **backlog at cut**: "
                 "requests arrived and still without a first token then; **segment**: the requests that arrived "
                 "between the previous cut and this one; **segment moved**: of those whose conversation had an earlier "
                 "request, the share served by another worker than that earlier request (a turn leaving its "
                 "history's cache; `-`: not recorded).", "", wt, ""]
    cmd = "python benchmarks/routing_experiment.py kv " + " ".join(shlex.quote(x) for x in a.argv)
    stamp = None
    if res.get("command") and a.rates == ["render"]:  # re-rendered: name the measuring run and its date
        stamp = f"{res['date']} (tables re-rendered {now_stamp()} by the same command with `--rates render`)"
        cmd = res["command"]
    write_section(a.section, a.title, cmd.strip(), "\n".join(body), stamp=stamp)


def add_arguments(k: argparse.ArgumentParser) -> None:
    g = k.add_argument_group("rate experiment (kv --rates): open-loop Poisson at fixed rates around capacity")
    g.add_argument("--rates", nargs="+", default=None,
                   help="'search' (find each router's sustainable rate, then rates below, between, above), "
                        "'render' (rewrite the doc section from the results file of an earlier run) or "
                        "explicit fleet rates in req/s (model time); turns the rate experiment on")
    g.add_argument("--rate-lo", type=float, default=40.0, help="search: first low probe (req/s, fleet)")
    g.add_argument("--rate-hi", type=float, default=160.0, help="search: first high probe (req/s, fleet)")
    g.add_argument("--search-steps", type=int, default=3, help="search: bisection steps per router")
    g.add_argument("--between", type=int, default=2, help="table rates strictly between the capacities")
    g.add_argument("--rate-below", type=float, default=0.7,
                   help="search: the table's lowest rate, this times the lower capacity")
    g.add_argument("--rate-above", type=float, default=1.3,
                   help="search: the table's highest rate, this times the higher capacity (0: none above)")
    g.add_argument("--repeats", type=int, default=1,
                   help="table: runs of every (rate, router) cell, interleaved (the router order alternates)")
    g.add_argument("--mt-stagger", type=int, default=0,
                   help="multi_turn: conversation c's turn t in arrival slot c + t x this (0: turn-major); see stagger()")
    g.add_argument("--mt-wait-reply", action="store_true",
                   help="multi_turn: a turn waits for the previous turn's answer to end (sent at its arrival time "
                        "or then, whichever is later), as a user does; default: open loop (see open_loop())")
    g.add_argument("--window-marks", type=float, nargs="+", default=[],
                   help="table: also cut every run at these shares of its arrival window (ascending, in (0, 1], "
                        "e.g. 0.33 0.67 1): backlog and TTFT p90 against the window length; see window_figures()")
    g.add_argument("--watch-every", type=float, default=2.0, help="seconds between polls of the workers' queues")
    g.add_argument("--dump-requests", action="store_true",
                   help="table: write every run's requests (rid, start, worker, TTFT, route header, direct) to "
                        "--log-dir/requests-<router>-<rate>-<run>.json (with ROUTING_EXPERIMENT_ROUTER_LOG_LEVEL="
                        "debug the router logs there hold kv_aware's cost terms per decision)")
