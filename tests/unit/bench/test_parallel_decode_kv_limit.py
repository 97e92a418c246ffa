"""benchmarks/parallel_decode.py part 3: how per-rank step records become the instance's figures."""

import pytest
from helpers.bench_module import load_bench


@pytest.fixture(scope="module")
def pd():
    return load_bench("parallel_decode")


def rank(leader, steps, outputs, pool=100):
    return {"leader": leader, "kv_pool_size": pool, "kv_bytes_per_token": 1152, "kv_used_end": 0,
            "steps": steps, "total_s": sum(s[4] for s in steps), "retracted": 1 if leader else 0,
            "outputs": outputs, "finish": {k: "length" for k in outputs}}


# (mode, batch size, running after, waiting after, wall s, collective s, CPU s)
G0 = [("EXTEND", 2, 2, 1, 0.5, 0.1, 0.4), ("DECODE", 2, 2, 1, 0.2, 0.05, 0.2), ("DECODE", 2, 0, 1, 0.2, 0.05, 0.2),
      ("EXTEND", 1, 1, 0, 0.3, 0.1, 0.3), ("DECODE", 1, 0, 0, 0.1, 0.02, 0.1)]
G1 = [("EXTEND", 2, 2, 0, 0.5, 0.1, 0.4), ("DECODE", 2, 2, 0, 0.2, 0.05, 0.2), ("DECODE", 2, 0, 0, 0.2, 0.05, 0.2),
      ("IDLE", 0, 0, 0, 0.3, 0.1, 0.1), ("IDLE", 0, 0, 0, 0.1, 0.02, 0.05)]
OUT0 = {"a": [1, 2, 3], "b": [1, 2, 3], "c": [4, 5, 6]}
OUT1 = {"d": [7, 8, 9], "e": [7, 8, 9]}


def test_dp_groups_are_added_step_by_step(pd):
    s = pd.summarize_capacity([rank(True, G0, OUT0), rank(True, G1, OUT1)], new_tokens=3, n_requests=5)
    assert s["kv_instance"] == 200 and s["kv_per_rank"] == 100
    # decode steps: 1, 2 (both groups, 4 rows each), 4 (group 0 alone, 1 row)
    assert s["decode_steps"] == 3 and s["mean_decode_bs"] == pytest.approx(3.0) and s["max_decode_bs"] == 4
    assert s["decode_tok_s"] == pytest.approx(9 / 0.5)         # rank 0's clock over the 3 decode steps
    assert s["decode_tok_per_cpu_s"] == pytest.approx(9 / (0.4 + 0.4 + 0.15))  # both ranks' CPU
    assert s["comm_ms_per_step"] == pytest.approx(1000 * 0.12 / 3)
    assert s["max_running"] == 4 and s["mean_running"] == pytest.approx((4 + 4 + 1) / 3)
    assert s["max_waiting"] == 1 and s["retracted"] == 2


def test_a_missing_token_or_held_kv_fails_loudly(pd):
    short = dict(OUT1, e=[7, 8])
    with pytest.raises(AssertionError):
        pd.summarize_capacity([rank(True, G0, OUT0), rank(True, G1, short)], new_tokens=3, n_requests=5)
    held = rank(True, G1, OUT1)
    held["kv_used_end"] = 3
    with pytest.raises(AssertionError):
        pd.summarize_capacity([rank(True, G0, OUT0), held], new_tokens=3, n_requests=5)
    with pytest.raises(AssertionError, match="step counts"):
        pd.summarize_capacity([rank(True, G0, OUT0), rank(True, G1[:-1], OUT1)], new_tokens=3, n_requests=5)
