"""benchmarks/routing_kv_moves.py: later turns classed by how they were sent and where they went."""

import pytest
from helpers.bench_module import load_bench


@pytest.fixture(scope="module")
def mv():
    return load_bench("routing_kv_moves")


def rec(rid, worker, direct, cached, prompt=100):
    return {"rid": rid, "worker": worker, "direct": direct, "cached": cached, "prompt": prompt}


def test_classes_follow_the_previous_turn_and_the_last_routed_worker(mv):
    recs = [
        # a: routed w1, routed w1 (stay), direct w2, routed back to w1 (the last routed worker)
        rec("c0-t0", "w1", False, 0), rec("c0-t1", "w1", False, 80), rec("c0-t2", "w2", True, 0),
        rec("c0-t3", "w1", False, 60),
        # b: direct w3 first, then routed to w3 (the direct worker), then routed to w4 (moved)
        rec("c1-t0", "w3", True, 0), rec("c1-t1", "w3", False, 70), rec("c1-t2", "w4", False, 10),
        # c: direct w2, routed to w1 with no routed turn before: elsewhere, none yet; t2 is missing
        rec("c2-t0", "w2", True, 0), rec("c2-t1", "w1", False, 5), rec("c2-t3", "w1", False, 90),
    ]
    got = mv.classify(recs)
    assert got == {
        "direct after routed: moved": (1, 0, 100),
        "routed after direct: elsewhere, no routed turn yet": (1, 5, 100),
        "routed after direct: to the direct worker": (1, 70, 100),
        "routed after direct: to the last routed worker": (1, 60, 100),
        "routed after routed: moved": (1, 10, 100),
        "routed after routed: stay": (1, 80, 100),
    }


def test_an_id_of_another_shape_is_refused(mv):
    with pytest.raises(ValueError, match="g0-p1"):
        mv.classify([rec("g0-p1", "w1", False, 0)])
