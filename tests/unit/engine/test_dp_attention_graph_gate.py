"""DP attention over two gloo ranks with the decode-graph path: the all-reduce(MIN)
runs only when the runner has decode graphs, an IDLE rank runs the same bucket as a
busy one, and the padded path gives the busy rank the plain eager logits."""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from fleetserve.distributed import comm_stats
from fleetserve.engine.dp_attention_hook import dp_attention_hook
from fleetserve.engine.model_runner import ModelRunner
from fleetserve.testing.rank_pool import build_state

PROMPTS = [[5, 9, 14, 3, 7], [11, 2], [8, 8, 1, 30, 4, 6, 12]]
DECODE_STEPS = 4


def _steps(runner, hook, ps):
    """Rank of attention group 0: prefill PROMPTS then decode; group 1: nothing (IDLE)."""
    import helpers.batch_driver as bd

    out = {"logits": [], "keys": [], "graph": []}

    def agreed_forward(fb):
        batch, logits, key = bd.dp_agreed_forward(hook, runner, fb)
        out["graph"].append(batch.forward_batch.can_run_graph)
        out["keys"].append(key)
        out["logits"].append(logits)
        return logits

    if ps.attn_dp_rank == 0:
        driver = SimpleNamespace(allocator=runner.allocator, forward=agreed_forward)
        reqs = [bd.Req([]) for _ in PROMPTS]
        bd.run_extend(driver, reqs, PROMPTS)
        toks = [3, 17, 40]
        for _ in range(DECODE_STEPS):
            toks = [int(x) for x in bd.run_decode(driver, reqs, toks).argmax(-1)]
        bd.free(runner, reqs)
    else:
        for _ in range(1 + DECODE_STEPS):
            agreed_forward(None)
    return out


def gate_job(rank, world, model_dir):
    ps = build_state(rank, tp_size=2, dp_size=2, enable_dp_attention=True)
    kw = dict(dtype="float32", max_total_tokens=256, pstate=ps, show_progress=False)
    runners = {"eager": ModelRunner(model_dir, **kw),
               "graphed": ModelRunner(model_dir, eager_graph_stand_in=True, cuda_graph_max_bs=8,
                                      graph_seq_len_buckets=[16, 64], **kw)}
    real_all_reduce = dist.all_reduce
    result = {}
    for name, runner in runners.items():
        mins = []

        def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
            if op == dist.ReduceOp.MIN:
                mins.append(int(tensor.item()))
            return real_all_reduce(tensor, op, *args, **kwargs)

        comm_stats.reset()
        dist.all_reduce = counting_all_reduce
        try:
            out = _steps(runner, dp_attention_hook(ps), ps)
        finally:
            dist.all_reduce = real_all_reduce
        out["min_all_reduces"] = len(mins)
        out["dp_sync_calls"] = comm_stats.snapshot()["dp_sync"][0]
        result[name] = out
    return result


def test_min_all_reduce_only_with_graphs_and_idle_rank_runs_the_same_bucket(pool2, tiny_deepseek_v2_dir):
    got = pool2.run(__file__, "gate_job", tiny_deepseek_v2_dir)
    steps = 1 + DECODE_STEPS
    for rank in range(2):
        eager, graphed = got[rank]["eager"], got[rank]["graphed"]
        # Graphs off: one collective per step (the count all-gather), no MIN, never a graph.
        assert eager["min_all_reduces"] == 0 and eager["dp_sync_calls"] == steps
        assert eager["graph"] == [False] * steps and eager["keys"] == [None] * steps
        # Graphs on: the MIN runs every step; the prefill step (one rank EXTEND) may not replay.
        assert graphed["min_all_reduces"] == steps and graphed["dp_sync_calls"] == 2 * steps
        assert graphed["graph"] == [False] + [True] * DECODE_STEPS
        # 3 requests on group 0, none on group 1: both run bucket 4 (widths: KV up to 11 -> 16).
        assert graphed["keys"] == [None] + [(4, 16)] * DECODE_STEPS
    idle = got[1]["graphed"]["logits"]
    assert all(x.shape[0] == 0 for x in idle)
    busy_e, busy_g = got[0]["eager"]["logits"], got[0]["graphed"]["logits"]
    for e, g in zip(busy_e, busy_g):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        assert torch.equal(g.argmax(-1), e.argmax(-1))
