"""benchmarks/routing_kv_rate.py: open-loop schedule, backlog / queue-growth test, rate search, rate choice."""

import math
import random

import numpy as np
import pytest

from fleetserve.bench import workloads
from helpers.bench_module import BENCH, load_bench


@pytest.fixture(scope="module")
def rr():
    return load_bench("routing_kv_rate")


def fifo_ttfts(arrivals: list[float], service_s: float) -> list[float]:
    """One FIFO server with a fixed service time: time from arrival to the end of its service."""
    free, out = 0.0, []
    for t in arrivals:
        begin = max(t, free)
        free = begin + service_s
        out.append(free - t)
    return out


def test_open_loop_drops_after_and_keeps_the_synthetic_history(rr):
    reqs = workloads.multi_turn(num_conversations=3, num_turns=3, question_len=4, output_len=4, replies="synthetic")
    assert sum(r.after is not None for r in reqs) == 6
    ol = rr.open_loop(reqs)
    assert [r.after for r in ol] == [None] * 9
    assert [r.messages for r in ol] == [r.messages for r in reqs]  # turn t still carries turns < t
    assert len(ol[-1].messages) == 5  # question, answer, question, answer, question
    real = workloads.multi_turn(num_conversations=2, num_turns=2, question_len=4, output_len=4, replies="real")
    with pytest.raises(ValueError, match="c0-t0"):
        rr.open_loop(real)


def test_poisson_arrivals_are_the_clients_draws_and_scale_with_the_rate(rr):
    a = rr.poisson_arrivals(1000, 10.0, seed=0)
    b = rr.poisson_arrivals(1000, 20.0, seed=0)
    assert a[0] == 0.0 and b[0] == 0.0
    assert all(abs(x - 2 * y) < 1e-9 for x, y in zip(a, b))  # same shape, times / rate
    rng = random.Random(0)
    assert a[1] == pytest.approx(rng.expovariate(10.0))
    assert a[-1] / 999 == pytest.approx(0.1, rel=0.1)  # mean gap 1 / rate


def test_backlog_counts_arrived_requests_without_a_first_token(rr):
    starts = [0.0, 1.0, 2.0, 3.0]
    ttfts = [0.5, 3.0, math.inf, 0.1]
    assert rr.backlog(starts, ttfts, 0.2) == 1
    assert rr.backlog(starts, ttfts, 0.6) == 0
    assert rr.backlog(starts, ttfts, 2.5) == 2  # the second (till 4.0) and the failed third
    assert rr.backlog(starts, ttfts, 3.05) == 3
    q = rr.queue_growth(starts, ttfts)
    assert q == {"window_s": 3.0, "mid": 1, "end": 3, "peak": 3, "growth": 2}
    assert rr.queue_growth([], [])["growth"] == 0


@pytest.mark.parametrize("load, ok", [(0.6, True), (0.85, True), (1.15, False), (1.4, False)])
def test_sustained_tells_a_fifo_below_capacity_from_one_above(rr, load, ok):
    n, mu = 400, 100.0  # service rate 100/s
    arr = rr.poisson_arrivals(n, load * mu, seed=3)
    q = rr.queue_growth(arr, fifo_ttfts(arr, 1 / mu))
    assert rr.sustained(q, n) is ok, q


def test_bisect_rates_brackets_each_capacity_in_lockstep(rr):
    calls = []

    def probe(name, cap):
        def f(rate):
            calls.append(name)
            return rate <= cap
        return f

    br = rr.bisect_rates({"a": probe("a", 77.0), "b": probe("b", 130.0)}, lo=60.0, hi=120.0, steps=3)
    a_lo, a_hi = br["a"]
    b_lo, b_hi = br["b"]
    assert a_lo <= 77.0 < a_hi and a_hi / a_lo == pytest.approx(2 ** (1 / 8))
    assert b_lo <= 130.0 < b_hi  # 120 held: doubled to 240, then bisected
    assert calls[-6:] == ["a", "b"] * 3  # the search steps alternate
    # a capacity below lo: lo halves until a probe holds
    br = rr.bisect_rates({"c": probe("c", 20.0)}, lo=60.0, hi=120.0, steps=0)
    assert br["c"] == (15.0, 30.0)
    # never sustained: no lower side
    assert rr.bisect_rates({"d": probe("d", 1.0)}, lo=60.0, hi=120.0, steps=2)["d"] == (None, 15.0)


def test_choose_rates_below_between_above(rr):
    r = rr.choose_rates([80.0, 100.0], between=2)
    assert r[0] == pytest.approx(56.0) and r[-1] == pytest.approx(130.0)
    assert 80.0 < r[1] < r[2] < 100.0
    assert r[1] == pytest.approx(80.0 * 1.25 ** (1 / 3))
    assert rr.choose_rates([90.0, 90.0]) == pytest.approx([63.0, 117.0])  # nothing strictly between
    assert rr.choose_rates([80.0, 100.0], between=1, below=0.9, above=0) == pytest.approx([72.0, 89.4427191])
    with pytest.raises(ValueError):
        rr.choose_rates([0.0, 10.0])
    assert rr.capacity_point((64.0, 100.0)) == pytest.approx(80.0)
    assert rr.capacity_point((None, 15.0)) == 15.0


def test_stagger_puts_turn_t_of_conversation_c_in_slot_c_plus_t_gap(rr):
    reqs = rr.open_loop(workloads.multi_turn(num_conversations=6, num_turns=3, question_len=2, output_len=2,
                                             replies="synthetic"))
    st = rr.stagger(reqs, 2)
    assert sorted(r.rid for r in st) == sorted(r.rid for r in reqs)  # a permutation
    assert [r.rid for r in st[:8]] == ["c0-t0", "c1-t0", "c0-t1", "c2-t0", "c1-t1", "c3-t0",
                                       "c0-t2", "c2-t1"]  # slot 4: c0-t2 before c2-t1 before c4-t0
    pos = {r.rid: i for i, r in enumerate(st)}
    assert all(pos[f"c{c}-t{t}"] < pos[f"c{c}-t{t + 1}"] for c in range(6) for t in range(2))
    # after the ramp, every window of one slot holds one request of each turn
    assert [sorted(r.meta["turn"] for r in st[i:i + 3]) for i in (6, 9)] == [[0, 1, 2]] * 2  # slots 4, 5
    assert [r.rid for r in rr.stagger(reqs, 0)] == [r.rid for r in reqs]  # 0: turn-major as generated
    with pytest.raises(ValueError, match=">= 0"):
        rr.stagger(reqs, -1)
    with pytest.raises(ValueError, match="g0-p0"):
        rr.stagger([r for r in workloads.shared_prefix(1, 2, 4, 2, 2) if r.rid == "g0-p0"], 2)
    # --mt-wait-reply staggers the requests as generated: each turn keeps its link to the one before
    linked = rr.stagger(workloads.multi_turn(num_conversations=6, num_turns=3, question_len=2, output_len=2,
                                             replies="synthetic"), 2)
    assert [r.rid for r in linked] == [r.rid for r in st]
    assert {r.rid: r.after for r in linked if r.meta["turn"]} == {
        f"c{c}-t{t}": f"c{c}-t{t - 1}" for c in range(6) for t in (1, 2)}


def _row(label, rate, rep, p90, hit=0.5):
    q = {"window_s": 4.0, "mid": 1, "end": 2, "peak": 3, "growth": 1}
    return {"label": label, "rate": rate, "rep": rep, "queue": q, "cache_hit_rate": hit, "bound_hit_rate": 0.7,
            "ttft_s": {"p50": 0.01, "p99": 0.5}, "ttft_p90_s": p90, "request_throughput": 50.0,
            "worker_waiting_max": 4, "utilisation": 0.9, "failed": 0, "sim_late_share": 0.02,
            "loadavg_end": [3.0, 2.0, 1.0]}


def test_rate_table_pairs_each_repeat_with_its_own_cache_aware_row(rr):
    rows = [_row("cache_aware (ours)", 60.0, 0, 1.0), _row("kv_aware", 60.0, 0, 0.1, 0.68),
            _row("kv_aware", 60.0, 1, 0.3), _row("cache_aware (ours)", 60.0, 1, 2.0)]
    lines = rr.rate_table({"rows": rows}).splitlines()
    assert "| run |" in lines[0] and "| bound |" in lines[0]
    body = lines[2:]
    assert [ln.split(" | ")[1] for ln in body] == ["1", "1", "2", "2"]  # repeat 1's rows, then repeat 2's
    kv1, kv2 = body[1].split(" | "), body[3].split(" | ")
    assert kv1[3:7] == ["kv_aware", "68.0%", "70.0%", "-"] and kv1[10] == "0.10x"  # 0.1 / 1.0 of its own repeat
    assert kv2[10] == "0.15x"  # 0.3 / 2.0, not over repeat 1's cache_aware
    pooled = dict(rows[1], pool_bound_hit_rate=0.425)
    assert rr.rate_table({"rows": [pooled]}).splitlines()[2].split(" | ")[5:7] == ["70.0%", "42.5%"]
    old = _row("kv_aware", 60.0, 0, 0.1)
    del old["rep"], old["bound_hit_rate"]  # a results file from before the columns: still renders
    assert " | - | " in rr.rate_table({"rows": [old]}).splitlines()[2]


def test_window_figures_cut_a_fifo_over_capacity_and_its_backlog_grows(rr):
    n, mu = 600, 100.0
    arr = rr.poisson_arrivals(n, 1.3 * mu, seed=5)  # 30% over capacity: the queue grows with the window
    tt = fifo_ttfts(arr, 1 / mu)
    w = rr.window_figures(arr, tt, [100] * n, [40] * n, [1 / 3, 2 / 3, 1.0])
    assert [x["share"] for x in w] == [1 / 3, 2 / 3, 1.0]
    assert w[-1]["t"] == arr[-1] and w[-1]["arrived"] == n
    assert [x["arrived"] for x in w] == [sum(1 for s in arr if s <= x["t"]) for x in w]
    assert [x["backlog"] for x in w] == [rr.backlog(arr, tt, x["t"]) for x in w]
    b = [x["backlog"] for x in w]
    assert b[0] < b[1] < b[2] and b[2] > 0.15 * n  # ~ (1.3 - 1) / 1.3 of the arrivals left
    p = [x["p90_s"] for x in w]
    assert p[0] < p[1] < p[2]
    assert w[-1]["p90_s"] == pytest.approx(float(np.percentile(tt, 90)))
    assert all(x["seg_hit"] == pytest.approx(0.4) and x["failed"] == 0 for x in w)
    # below capacity the backlog stays small at every cut
    arr2 = rr.poisson_arrivals(n, 0.6 * mu, seed=5)
    assert max(x["backlog"] for x in rr.window_figures(arr2, fifo_ttfts(arr2, 1 / mu), [1] * n, [0] * n,
                                                       [0.5, 1.0])) <= 6


def test_window_figures_segments_and_failed_requests(rr):
    starts = [0.0, 1.0, 2.0, 3.0, 4.0]
    ttfts = [0.1, 0.2, math.inf, 0.4, 0.5]  # the third never got a first token
    w = rr.window_figures(starts, ttfts, [10, 10, 10, 10, 20], [10, 0, 10, 5, 10], [0.5, 1.0])
    assert [x["arrived"] for x in w] == [3, 5]  # cut at 2.0 (inclusive), 4.0
    assert [x["failed"] for x in w] == [1, 1]
    assert w[0]["backlog"] == 1  # the failed one, still waiting at 2.0
    assert w[0]["seg_hit"] == pytest.approx(10 / 20)  # successes 0 and 1 only
    assert w[1]["seg_hit"] == pytest.approx(15 / 30)  # 3 and 4 (the segment after 2.0)
    assert w[1]["seg_p90_s"] == pytest.approx(0.49)  # linear between 0.4 and 0.5
    assert rr.window_figures([], [], [], [], [1.0]) == []
    for bad in ([0.0], [1.5], [0.7, 0.3]):
        with pytest.raises(ValueError, match="window marks"):
            rr.window_figures(starts, ttfts, [1] * 5, [0] * 5, bad)


def test_window_table_pairs_each_cut_with_cache_aware_at_the_same_cut(rr):
    def wrow(label, rep, p90s):
        r = _row(label, 60.0, rep, p90s[-1])
        r["windows"] = [{"share": m, "t": 6.0 * m, "arrived": 100 * (j + 1), "backlog": 3 * (j + 1), "p90_s": p,
                         "failed": 0, "seg_p90_s": p, "seg_hit": 0.5} for j, (m, p) in enumerate(zip((0.5, 1.0), p90s))]
        return r

    res = {"rows": [wrow("cache_aware (ours)", 0, [0.4, 1.0]), wrow("kv_aware", 0, [0.2, 0.1]),
                    wrow("cache_aware (ours)", 1, [0.5, 2.0]), wrow("kv_aware", 1, [0.1, 0.2])]}
    lines = rr.window_table(res).splitlines()
    assert "| cut at (s) |" in lines[0]
    kv = [ln.split(" | ") for ln in lines[2:] if "kv_aware" in ln]
    assert [(c[3], c[7]) for c in kv] == [("3.0", "0.50x"), ("6.0", "0.10x"), ("3.0", "0.20x"), ("6.0", "0.10x")]
    assert rr.window_table({"rows": [_row("kv_aware", 60.0, 0, 0.1)]}) == ""  # no cuts: no table


def test_window_figures_seg_moved_counts_turns_served_away_from_their_previous_worker(rr):
    # conversation a: w1, w1, w2 (moved); b: w2, w2; c: w1 (first turn: not counted)
    starts = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    groups = ["a", "b", "a", "b", "a", "c"]
    workers = ["w1", "w2", "w1", "w2", "w2", "w1"]
    w = rr.window_figures(starts, [0.1] * 6, [1] * 6, [0] * 6, [0.5, 1.0], groups, workers)
    assert w[0]["seg_moved"] == 0.0  # a-t1 (2.0) stayed on w1
    assert w[1]["seg_moved"] == pytest.approx(1 / 2)  # b-t1 stayed, a-t2 moved w1 -> w2; c-t0 has no earlier
    assert rr.window_figures(starts, [0.1] * 6, [1] * 6, [0] * 6, [0.3])[0]["seg_moved"] is None  # no workers
    row = _row("kv_aware", 60.0, 0, 0.1)
    row["windows"] = w
    assert "| 50% |" in rr.window_table({"rows": [row]}).splitlines()[-1]


def test_rate_table_shows_the_routed_p90_next_to_the_overall_one(rr):
    """With direct traffic the overall p90 mixes in the direct requests' misses: the routed-only p90 and
    its ratio to the same repeat's cache_aware are their own columns; a row without the split shows -."""
    ca, kv = _row("cache_aware (ours)", 54.0, 0, 0.56), _row("kv_aware", 54.0, 0, 0.32)
    ca["ttft_p90_routed_s"], kv["ttft_p90_routed_s"] = 0.5, 0.1
    lines = rr.rate_table({"rows": [ca, kv]}).splitlines()
    head = [c.strip() for c in lines[0].split("|")]
    i = head.index("routed p90 (ms)")
    assert head[i + 1] == "routed p90 / cache_aware's"
    kv_cells = [c.strip() for c in lines[3].split("|")]
    assert kv_cells[4] == "kv_aware" and kv_cells[i:i + 2] == ["100", "0.20x"]
    assert [c.strip() for c in lines[2].split("|")][i:i + 2] == ["500", "1.00x"]
    del kv["ttft_p90_routed_s"]
    assert [c.strip() for c in rr.rate_table({"rows": [ca, kv]}).splitlines()[3].split("|")][i:i + 2] == ["-", "-"]
    assert len(lines[0].split("|")) == len(lines[1].split("|")) == len(lines[3].split("|"))


def test_rate_table_shows_the_own_worker_bound_only_with_direct_traffic(rr):
    """With a share sent past the router the own-worker bound (``split_cache_bound``) gets its own column
    after the plain bound; without direct traffic the column is not there."""
    ca, kv = _row("cache_aware (ours)", 54.0, 0, 0.56), _row("kv_aware", 54.0, 0, 0.32)
    assert "own-worker bound" not in rr.rate_table({"rows": [ca, kv]}).splitlines()[0]
    ca["ttft_p90_direct_s"], kv["ttft_p90_direct_s"] = 0.7, 0.4
    ca["split_bound_hit_rate"], kv["split_bound_hit_rate"] = 0.612, 0.598
    lines = rr.rate_table({"rows": [ca, kv]}).splitlines()
    head = [c.strip() for c in lines[0].split("|")]
    i = head.index("own-worker bound")
    assert head[i - 1] == "bound" and head[i + 1] == "pool bound"
    assert [[c.strip() for c in ln.split("|")][i] for ln in lines[2:]] == ["61.2%", "59.8%"]
    del kv["split_bound_hit_rate"]  # an older results file: still renders
    assert [c.strip() for c in rr.rate_table({"rows": [ca, kv]}).splitlines()[3].split("|")][i] == "-"
    assert len({len(ln.split("|")) for ln in lines}) == 1
    kv["split_bound_hit_rate"], kv["greedy_hit_rate"] = 0.598, 0.553  # pinned direct traffic: one more column
    lines = rr.rate_table({"rows": [ca, kv]}).splitlines()
    head = [c.strip() for c in lines[0].split("|")]
    j = head.index("follow-the-cache")
    assert head[j - 1] == "own-worker bound" and head[j + 1] == "pool bound"
    assert [[c.strip() for c in ln.split("|")][j] for ln in lines[2:]] == ["-", "55.3%"]


def test_render_keeps_the_measuring_runs_command_and_date(rr, monkeypatch, tmp_path):
    """``--rates render`` rewrites a section from a results file: the section still names the command
    and the date of the run that measured it (the file keeps both), and says when it was re-rendered."""
    import argparse

    monkeypatch.syspath_prepend(BENCH)
    import doc_section

    doc = tmp_path / "bench.md"
    real = doc_section.write_section
    monkeypatch.setattr(doc_section, "write_section", lambda *x, **k: real(*x, doc=doc, **k))
    a = argparse.Namespace(
        no_doc=False, conversations=3, turns=2, mt_system_len=0, question_len=8, output_len=4, groups=0,
        prompts_per_group=0, system_len=0, stream_interval=16, max_total_tokens=1000, time_scale=8.0,
        watch_every=2.0, note="", window_marks=[1.0], section="s1", title="T", foreign_by="conversation",
        rates=["render"], argv=["--scenarios", "foreign", "--rates", "render"])
    row = _row("kv_aware", 64.0, 0, 0.3)
    row["loadavg_end"] = [0.5, 0.4, 0.3]
    res = {"scenario": "foreign", "workload": "multi_turn", "workers": 4, "replicas": 1, "direct_share": 0.3,
           "requests": 6, "loads": [[0.2, 0.2, 0.2]], "rows": [row],
           "command": "python benchmarks/routing_experiment.py kv --scenarios foreign --rates 64",
           "date": "2026-12-06 20:12 UTC"}
    rr.write_rate_doc(a, res)
    text = doc.read_text()
    assert "Command: `python benchmarks/routing_experiment.py kv --scenarios foreign --rates 64`" in text
    assert "Date: 2026-12-06 20:12 UTC (tables re-rendered " in text
    assert "--rates render`" in text.split("Date:")[1]  # named only as how the tables were redrawn
    assert "each to a random one" not in text and "every direct request of a conversation" in text
    # the render's own flags differ from the run's: the recorded settings describe it
    flagged = argparse.Namespace(**{**vars(a), "conversations": 32, "turns": 6, "foreign_by": "request"})
    res["settings"] = {"conversations": 3, "turns": 2, "foreign_by": "conversation"}
    rr.write_rate_doc(rr.as_run(flagged, res), res)
    text = doc.read_text()
    assert "multi_turn 3 conversations x 2 turns" in text and "every direct request of a conversation" in text
    assert rr.as_run(flagged, {}).conversations == 32  # an older file: the flags as given
    del res["command"]  # an older results file: the render's own command and date, as before
    rr.write_rate_doc(a, res)
    assert "Command: `python benchmarks/routing_experiment.py kv --scenarios foreign --rates render`" in doc.read_text()
