"""The DP controller's round-robin and shortest-queue (running + waiting tokens) decisions."""

import pytest

from fleetserve.engine.dp_controller import DPController


def test_round_robin_cycles_through_ranks():
    c = DPController(3, "round_robin")
    assert [c.assign(f"r{i}", 10 * i) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert c.num_requests() == [3, 2, 2]
    assert c.loads() == [0 + 30 + 60, 10 + 40, 20 + 50]


def test_shortest_queue_counts_prompt_and_generated_tokens():
    c = DPController(2, "shortest_queue")
    assert c.assign("a", 100) == 0
    assert c.assign("b", 30) == 1
    assert c.assign("c", 30) == 1          # rank 1: 30 < 100
    assert c.loads() == [100, 60]
    c.on_tokens("c", 50)                   # rank 1 now holds 110 tokens
    assert c.assign("d", 5) == 0
    assert c.loads() == [105, 110]
    c.on_finished("a")                     # 100 tokens leave rank 0
    assert c.loads() == [5, 110]
    assert c.rank_of("a") is None and c.rank_of("c") == 1
    assert c.assign("e", 1) == 0


def test_shortest_queue_spreads_equal_loads():
    c = DPController(4, "shortest_queue")
    picks = [c.assign(f"r{i}", 0) for i in range(8)]
    assert sorted(picks[:4]) == [0, 1, 2, 3] and sorted(picks[4:]) == [0, 1, 2, 3]


def test_reported_load_overrides_and_bad_input_is_refused():
    c = DPController(2, "shortest_queue")
    c.assign("x", 10)
    c.observe_load(0, 500)
    assert c.assign("y", 10) == 1
    with pytest.raises(ValueError, match="already assigned"):
        c.assign("x", 1)
    with pytest.raises(ValueError, match="load-balance-method"):
        DPController(2, "random")
    with pytest.raises(ValueError, match="dp_size"):
        DPController(0)


def test_routed_rank_wins_counts_there_and_keeps_the_round_robin_turn():
    c = DPController(2, "round_robin")
    assert c.assign("a", 10) == 0
    assert c.assign("b", 20, routed_rank=0) == 0      # named rank, though rank 1 had the turn
    assert c.assign("c", 5) == 1                      # the turn did not move
    assert c.loads() == [30, 5] and c.num_requests() == [2, 1]
    s = DPController(2, "shortest_queue")
    s.assign("x", 100)
    assert s.assign("y", 1, routed_rank=0) == 0       # shortest queue would say 1
    for bad in (2, -1):
        with pytest.raises(ValueError, match=r"routed_dp_rank=-?\d out of range \[0, 2\)"):
            s.assign(f"bad{bad}", 1, routed_rank=bad)
    assert s.rank_of("bad2") is None
