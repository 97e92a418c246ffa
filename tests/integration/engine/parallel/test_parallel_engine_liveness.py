"""Liveness of DP attention (IDLE batches, skipped steps, aborts, waking up) and its KV capacity."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from parallel_jobs import hf_greedy  # noqa: E402

JOBS = os.path.join(HERE, "parallel_jobs.py")

A = [256, 10, 20, 30, 40]                       # group 0: long decode
B = [256] + [(7 * i) % 250 for i in range(60)]  # group 1: long prompt arriving mid-decode
C = [256, 99, 98, 97, 96]                       # group 0: aborted mid-stream
D = [256, 5, 6, 7, 8, 9, 10]                    # both groups wake up after an all-idle gap
E = [256, 150, 151, 152, 153, 154, 155, 156, 157, 158, 159, 160]
NEW = {"A": 40, "B": 6, "C": 30, "D": 5, "E": 5}
ABORT_AT, WAKE_AT = 16, 90

PLAN = {
    0: ({0: [("A", A, NEW["A"])], 10: [("C", C, NEW["C"])], WAKE_AT: [("D", D, NEW["D"])]}, {ABORT_AT: ["C"]}),
    1: ({8: [("B", B, NEW["B"])], WAKE_AT: [("E", E, NEW["E"])]}, {}),
}


@pytest.fixture(scope="module")
def liveness_refs(tiny_deepseek_v3_dir):
    prompts = {"A": A, "B": B, "C": C, "D": D, "E": E}
    return {k: hf_greedy(tiny_deepseek_v3_dir, [p], min(NEW[k], 12))[0][0] for k, p in prompts.items()}


@pytest.mark.parametrize("backend", ["allgather", "all_to_all"])
def test_idle_rank_mixed_modes_abort_and_wake_up(pool2, tiny_deepseek_v3_dir, liveness_refs, backend):
    sizes = dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2, moe_a2a_backend=backend)
    r0, r1 = pool2.run(JOBS, "scenario_job", tiny_deepseek_v3_dir, sizes, PLAN, timeout=120)
    # Correct tokens (checked against transformers for the first 12 of each).
    for out, names in ((r0, "AD"), (r1, "BE")):
        for n in names:
            ids, finish = out["reqs"][n]
            assert len(ids) == NEW[n] and finish["type"] == "length", (n, finish)
            assert ids[:12] == liveness_refs[n][: len(ids[:12])], n
    # The aborted request stopped early with an abort and what it produced is right.
    ids, finish = r0["reqs"]["C"]
    assert finish["type"] == "abort" and 0 < len(ids) < NEW["C"]
    assert ids == liveness_refs["C"][: len(ids)]
    # Rank 1 joined rank 0's forwards with IDLE batches before B arrived; the groups ran
    # every forward together, and at some step one extended while the other decoded.
    assert len(r0["modes"]) == len(r1["modes"])
    assert r1["modes"][0] == "IDLE" and r0["modes"][0] == "EXTEND"
    assert any(a == "DECODE" and b == "EXTEND" for a, b in zip(r0["modes"], r1["modes"]))
    # Between A's end and the wake-up every rank was empty: steps without any forward.
    assert r0["steps"] == r1["steps"] and r0["steps"] > WAKE_AT
    assert len(r0["modes"]) < r0["steps"] - (WAKE_AT - NEW["A"] - 5)
    # Everything finished: no KV held by running requests, on either rank.
    assert r0["kv_used_end"] == 0 and r1["kv_used_end"] == 0


def test_dp_attention_holds_dp_size_times_the_tokens_of_tp(pool2, tiny_deepseek_v3_dir):
    """Same KV memory per rank: TP mirrors the whole MLA latent on both ranks, DP attention
    gives each rank its own requests, so the instance holds twice the tokens."""
    import json

    cfg = json.load(open(os.path.join(tiny_deepseek_v3_dir, "config.json")))
    bytes_per_token = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4  # fp32
    budget = 160 * bytes_per_token            # per rank
    prompts = [[256] + [(13 * i + j) % 250 for j in range(59)] for i in range(4)]  # 4 x (60 + 4) tokens
    results = {}
    for name, sizes in (("tp2", dict(tp_size=2)), ("dp2_attn", dict(tp_size=2, dp_size=2, enable_dp_attention=True))):
        per_rank = pool2.run(JOBS, "capacity_job", tiny_deepseek_v3_dir, sizes, budget // bytes_per_token,
                                    prompts, 4, timeout=120)
        for r in per_rank:
            assert r["kv_bytes_per_token"] == bytes_per_token       # the whole latent on every rank
            assert r["kv_pool_size"] * r["kv_bytes_per_token"] == budget
            assert len(r["finished"]) == (4 if name == "tp2" else 2)
        groups = {r["attn_dp_rank"]: r for r in per_rank if r["attn_tp_rank"] == 0}
        results[name] = (sum(g["kv_pool_size"] for g in groups.values()),
                         sum(g["peak_used"] for g in groups.values()))
    (cap_tp, peak_tp), (cap_dp, peak_dp) = results["tp2"], results["dp2_attn"]
    assert cap_dp == 2 * cap_tp == 2 * 160
    # Four 64-token requests: TP fits two at a time (<= 160), DP attention all four at once.
    assert peak_tp <= cap_tp < peak_dp <= cap_dp


RETRACT_PLAN = {  # group 0: four requests whose decode outgrows its pool; group 1: one long one, no pressure
    0: [(f"g0r{i}", [256] + [(11 * i + 3 * j) % 250 for j in range(11)], 20) for i in range(4)],
    1: [("g1r0", [256, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], 60)],
}


def test_dp_attention_retraction_on_one_group_keeps_tokens_and_lockstep(pool2, tiny_deepseek_v3_dir):
    """Group 0 admits 4 x 12-token prompts into 100 KV slots (low conservativeness: a small decode
    reserve), then 4 x (12 + 20) = 128 tokens do not fit: it retracts and later re-prefills the
    retracted requests (EXTEND) while group 1 still decodes its long request, and every output
    equals the single-rank engine's (ample pool, no retraction)."""
    from fleetserve.testing.rank_engine import build_rank_engine, drive
    from parallel_jobs import greedy_req

    plan = RETRACT_PLAN
    ref_eng = build_rank_engine(0, tiny_deepseek_v3_dir, dtype="float32", max_total_tokens=512)
    ref = drive(ref_eng, {0: [greedy_req(rid, p, n) for g in plan.values() for rid, p, n in g]})["reqs"]
    assert ref_eng.scheduler.num_retracted == 0
    sizes = dict(tp_size=2, dp_size=2, enable_dp_attention=True)
    r0, r1 = pool2.run(JOBS, "retract_job", tiny_deepseek_v3_dir, sizes, 100, 0.3, plan, timeout=120)
    assert r0["kv_pool"] == r1["kv_pool"] == 100
    assert r0["retracted"] >= 1 and r1["retracted"] == 0, (r0["retracted"], r1["retracted"])
    assert r0["max_running"] == 4  # all four were admitted before the pool ran short
    for out, group in ((r0, 0), (r1, 1)):
        want = {rid: n for rid, _, n in plan[group]}
        assert sorted(out["reqs"]) == sorted(want)
        for rid, (ids, finish) in out["reqs"].items():
            assert finish == {"type": "length", "length": want[rid]}, (rid, finish)
            assert ids == ref[rid]["ids"], f"{rid}: tokens differ from the single-rank engine after retraction"
        assert out["kv_used_end"] == 0
    # Lock-step: both groups ran the same number of forwards; group 0 re-prefilled a retracted
    # request while group 1 decoded, and ran IDLE batches once its requests were done.
    assert r0["steps"] == r1["steps"] and len(r0["modes"]) == len(r1["modes"])
    modes = list(zip(r0["modes"], r1["modes"]))
    assert any(a == "EXTEND" and b == "DECODE" for a, b in modes[1:]), modes
    assert modes[-1] == ("IDLE", "DECODE"), modes[-1]
