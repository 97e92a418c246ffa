"""--enable-torch-compile on two gloo ranks: the compiled decode step gives the eager greedy
tokens under TP 2 (tiny Llama: all-reduces and the LM-head all-gather inside the graph) and
under DP attention 2 with EP 2 (tiny DeepSeek-V2: the dense layer's token gather and all-reduce
inside the graph, the expert-parallel MoE eager inside the step), and under DP attention the all-reduce(MIN) decides for both ranks:
a step where one rank prefills runs eagerly on both, the others compiled at the same bucket.

One job covers both layouts (each compile costs about a minute per model on this machine)."""

from types import SimpleNamespace

import pytest
from torch._dynamo.utils import counters

import helpers.batch_driver as bd
from fleetserve.distributed.groups import ParallelConfig, build_parallel_state
from fleetserve.engine.dp_attention_hook import dp_attention_hook
from fleetserve.engine.model_runner import ModelRunner

PROMPTS = [[5, 9, 14, 3, 7], [11, 2], [8, 8, 1, 30, 4, 6, 12]]
NEW_TOKENS = 8
#: DP attention: group 0 prefills PROMPTS at step 0, group 1 prefills its prompt at step 2.
DP_PROMPTS = {0: PROMPTS, 1: [[4, 19, 7]]}
DP_START = {0: 0, 1: 2}
DP_STEPS = 8
#: Compiling runs inside the first compiled call, so one rank may wait in a collective while the
#: other still compiles: a generous collective timeout for this job's groups.
COLLECTIVE_TIMEOUT_S = 600.0


def _runners(path, ps):
    kw = dict(dtype="float32", max_total_tokens=256, pstate=ps, show_progress=False)
    return {"eager": ModelRunner(path, **kw),
            "compiled": ModelRunner(path, enable_torch_compile=True, graph_batch_sizes=[4],
                                    graph_seq_len_buckets=[16], **kw)}


def _dp_steps(runner, ps):
    """This rank's greedy tokens and, per step, the compiled runner's ``last_key`` (None: eager)."""
    hook, keys = dp_attention_hook(ps), []

    def agreed_forward(fb):
        _, logits, key = bd.dp_agreed_forward(hook, runner, fb)
        keys.append(key)
        return logits

    driver = SimpleNamespace(allocator=runner.allocator, forward=agreed_forward)
    g = ps.attn_dp_rank
    reqs, outs = [bd.Req([]) for _ in DP_PROMPTS[g]], []
    for step in range(DP_STEPS):
        if step < DP_START[g]:
            agreed_forward(None)
        elif step == DP_START[g]:
            outs = [[int(x)] for x in bd.run_extend(driver, reqs, DP_PROMPTS[g]).argmax(-1)]
        else:
            for o, x in zip(outs, bd.run_decode(driver, reqs, [o[-1] for o in outs]).argmax(-1)):
                o.append(int(x))
    bd.free(runner, reqs)
    return outs, keys


def compiled_job(rank, world, llama_dir, deepseek_dir):
    result = {}
    ps = build_parallel_state(ParallelConfig(tp_size=2), rank, timeout_s=COLLECTIVE_TIMEOUT_S)
    runners = _runners(llama_dir, ps)
    graphs = counters["stats"]["unique_graphs"]
    result["tp"] = {name: bd.greedy_generate(r, PROMPTS, NEW_TOKENS) for name, r in runners.items()}
    result["tp_key"] = runners["compiled"].graph_runner.last_key
    result["tp_recompiles"] = counters["stats"]["unique_graphs"] - graphs

    ps = build_parallel_state(ParallelConfig(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2), rank,
                              timeout_s=COLLECTIVE_TIMEOUT_S)
    runners = _runners(deepseek_dir, ps)
    graphs = counters["stats"]["unique_graphs"]
    result["dp"] = {name: _dp_steps(r, ps) for name, r in runners.items()}
    result["dp_recompiles"] = counters["stats"]["unique_graphs"] - graphs
    return result


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_compiled_decode_under_tp2_and_dp_attention2_ep2(pool2, tiny_llama_dir, tiny_deepseek_v2_dir):
    got = pool2.run(__file__, "compiled_job", tiny_llama_dir, tiny_deepseek_v2_dir, timeout=1400)
    for rank in range(2):
        r = got[rank]
        assert r["tp"]["compiled"] == r["tp"]["eager"], rank
        assert r["tp"]["compiled"] == got[0]["tp"]["eager"]  # TP ranks sample the same tokens
        # last step: 3 requests padded to bucket 4, KV width = longest sequence 7 + 8 - 1
        assert r["tp_key"] == (4, 14) and r["tp_recompiles"] == 0
        (eager_toks, eager_keys), (toks, keys) = r["dp"]["eager"], r["dp"]["compiled"]
        assert toks == eager_toks and len(toks) == len(DP_PROMPTS[rank]), rank
        assert eager_keys == [None] * DP_STEPS
        # step 0 (group 0 prefills) and step 2 (group 1 prefills): eager on both ranks; the other
        # steps compiled at the bucket of the larger group (3 -> 4), even on the IDLE rank
        assert [k and k[0] for k in keys] == [None, 4, None, 4, 4, 4, 4, 4], (rank, keys)
        assert r["dp_recompiles"] == 0
    # KV widths are each rank's own longest sequence (the IDLE rank's padding: 2)
    assert [k[1] for k in got[0]["dp"]["compiled"][1] if k] == [8, 10, 11, 12, 13, 14]
    assert [k[1] for k in got[1]["dp"]["compiled"][1] if k] == [2, 4, 5, 6, 7, 8]
