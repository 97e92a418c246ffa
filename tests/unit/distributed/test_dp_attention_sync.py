"""DP attention: per-step token-count agreement, IDLE / skip / graph decisions, FFN gather and scatter."""

import torch

from fleetserve.distributed.dp_attention import (batch_num_tokens, dp_schedule_rule, gather_tokens,
                                                 scatter_tokens, sync_step)
from fleetserve.testing.rank_pool import build_state
from fleetserve.core.forward_batch import ForwardMode

# (tokens, decode_or_idle) per rank, for each step
STEPS_2 = [
    [(5, False), (0, True)],    # rank 1 has nothing while rank 0 extends -> rank 1 idles
    [(3, True), (7, True)],     # both decode
    [(0, True), (0, True)],     # nobody has work -> nobody steps
    [(0, True), (1, True)],     # rank 0 idle, rank 1 decodes
    [(4, True), (9, False)],    # one decodes, one extends -> no graph
]


def sync_job(rank, world, kw, steps):
    ps = build_state(rank, **kw)
    plans = []
    for step in steps:
        n, dec = step[rank]
        p = sync_step(ps, n, dec)
        plans.append((p.global_num_tokens, p.run_idle, p.skip, p.can_run_graph))
    return plans


def test_sync_step_over_two_dp_ranks(pool2):
    kw = dict(tp_size=2, dp_size=2, enable_dp_attention=True)
    got = pool2.run(__file__, "sync_job", kw, STEPS_2)
    for rank in range(2):
        counts = [g[0] for g in got[rank]]
        assert counts == [[5, 0], [3, 7], [0, 0], [0, 1], [4, 9]]
        assert [g[2] for g in got[rank]] == [False, False, True, False, False]      # skip
        assert [g[3] for g in got[rank]] == [False, True, False, True, False]       # graph (MIN)
    assert [g[1] for g in got[0]] == [False, False, False, True, False]             # rank 0 idles at step 3
    assert [g[1] for g in got[1]] == [True, False, False, False, False]             # rank 1 idles at step 0


def test_sync_step_with_attention_groups_of_two_ranks(pool4):
    # tp4 dp2: ranks {0,1} are group 0 and {2,3} group 1; members of a group report the same count.
    kw = dict(tp_size=4, dp_size=2, enable_dp_attention=True, ep_size=2)
    steps = [[(6, False), (6, False), (0, True), (0, True)], [(2, True), (2, True), (5, True), (5, True)]]
    got = pool4.run(__file__, "sync_job", kw, steps)
    for rank in range(4):
        assert [g[0] for g in got[rank]] == [[6, 0], [2, 5]]
        assert got[rank][1][3] is True and got[rank][0][3] is False
    assert [got[r][0][1] for r in range(4)] == [False, False, True, True]


def gather_job(rank, world, kw, counts, hidden):
    ps = build_state(rank, **kw)
    g = torch.Generator().manual_seed(100 + ps.attn_dp_rank)
    mine = torch.randn(counts[ps.attn_dp_rank], hidden, generator=g)
    gathered = gather_tokens(mine, counts, ps)
    back = scatter_tokens(gathered * 2.0, counts, ps)
    return gathered, back, mine


def _expected_rows(counts, hidden):
    return torch.cat([torch.randn(n, hidden, generator=torch.Generator().manual_seed(100 + d))
                      for d, n in enumerate(counts)])


def test_gather_and_scatter_with_uneven_and_zero_counts(pool2):
    kw = dict(tp_size=2, dp_size=2, enable_dp_attention=True)
    for counts in ([3, 5], [4, 0], [0, 2], [1, 1]):
        got = pool2.run(__file__, "gather_job", kw, counts, 6)
        want = _expected_rows(counts, 6)
        for rank in range(2):
            gathered, back, mine = got[rank]
            assert gathered.shape == (sum(counts), 6)
            torch.testing.assert_close(gathered, want, rtol=0, atol=0)
            torch.testing.assert_close(back, mine * 2.0, rtol=0, atol=0)


def test_gather_and_scatter_over_four_ranks_in_two_groups(pool4):
    kw = dict(tp_size=4, dp_size=2, enable_dp_attention=True)
    got = pool4.run(__file__, "gather_job", kw, [0, 3], 4)
    want = _expected_rows([0, 3], 4)
    for rank in range(4):
        torch.testing.assert_close(got[rank][0], want, rtol=0, atol=0)
        assert got[rank][1].shape[0] == (0 if rank < 2 else 3)


def test_reported_count_follows_the_forward_mode():
    assert batch_num_tokens(None, 0, 0) == 0
    assert batch_num_tokens(ForwardMode.IDLE, 0, 0) == 0
    assert batch_num_tokens(ForwardMode.DECODE, 11, 11) == 11
    assert batch_num_tokens(ForwardMode.EXTEND, 40, 3) == 40


def test_schedule_rule_is_more_conservative_under_dp_attention():
    assert dp_schedule_rule(1.0, 8192, 1) == (1.0, 8192)
    cons, chunk = dp_schedule_rule(1.0, 8192, 4)
    assert cons == 1.5 and chunk == 2048
    assert dp_schedule_rule(2.0, None, 2) == (3.0, None)
    assert dp_schedule_rule(1.0, -1, 2) == (1.5, -1)   # chunking off stays off
