"""The decode-graph path of ModelRunner on CPU, through the eager stand-in: same
logits and tokens as the plain eager path, padding rows touch only the scratch
slot 0, the bucket chosen, the eager fallbacks, and the default (off) on CPU."""

import pytest
import torch

from fleetserve.core.forward_batch import ForwardBatch, ForwardMode
from fleetserve.engine.cuda_graph_runner import EagerDecodeGraphRunner
from fleetserve.engine.model_runner import ModelRunner
from helpers.batch_driver import Req, free, run_decode, run_extend

PROMPTS = [[5, 9, 14, 3, 7], [11, 2], [8, 8, 1, 30, 4, 6, 12]]


def _runner(path, **kw):
    return ModelRunner(path, dtype="float32", max_total_tokens=512, show_progress=False, **kw)


@pytest.fixture(scope="module")
def llama_pair(tiny_llama_dir):
    """(eager runner, stand-in runner with buckets 1, 2, 4 and KV widths 16, 32)."""
    return _runner(tiny_llama_dir), _runner(tiny_llama_dir, eager_graph_stand_in=True, cuda_graph_max_bs=4,
                                            graph_seq_len_buckets=[16, 32])


def _kv(runner):
    return torch.stack([torch.stack(runner.kv_pool.k_buffer), torch.stack(runner.kv_pool.v_buffer)])


def test_graphs_are_off_on_cpu_by_default(tiny_llama_dir, llama_pair):
    eager, graphed = llama_pair
    assert eager.graph_runner is None and not eager.decode_graphs_enabled
    assert isinstance(graphed.graph_runner, EagerDecodeGraphRunner) and graphed.decode_graphs_enabled
    assert graphed.graph_runner.batch_sizes == [1, 2, 4]
    off = _runner(tiny_llama_dir, eager_graph_stand_in=True, disable_cuda_graph=True)
    assert off.graph_runner is None


def test_stand_in_decode_matches_eager_and_pads_into_slot_zero(llama_pair):
    eager, graphed = llama_pair
    reqs = {r: [Req([]) for _ in PROMPTS] for r in ("eager", "graphed")}
    for name, runner in (("eager", eager), ("graphed", graphed)):
        run_extend(runner, reqs[name], PROMPTS)
    toks = [[3], [17], [40]]
    for step in range(6):
        nxt = [t[-1] for t in toks]
        before = _kv(graphed)
        want = run_decode(eager, reqs["eager"], nxt)
        got = run_decode(graphed, reqs["graphed"], nxt)
        # 3 requests -> bucket 4 (one padding row); longest sequence 8..13 -> KV width 16
        assert graphed.graph_runner.last_key == (4, 16)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        after = _kv(graphed)
        changed = (after != before).flatten(3).any(-1).any(0).any(0)  # per pool slot
        new_slots = {int(r.slots[-1]) for r in reqs["graphed"]}
        assert set(changed.nonzero().flatten().tolist()) <= new_slots | {0}
        if step == 0:
            assert bool(changed[0]), "the padding row writes its KV to the scratch slot 0"
        for r_e, r_g in zip(reqs["eager"], reqs["graphed"]):  # the real rows' KV is the eager one
            torch.testing.assert_close(after[:, :, int(r_g.slots[-1])], _kv(eager)[:, :, int(r_e.slots[-1])],
                                       rtol=1e-5, atol=1e-5)
        toks = [t + [int(x)] for t, x in zip(toks, want.argmax(-1))]
    free(eager, reqs["eager"])
    free(graphed, reqs["graphed"])


def test_too_long_for_every_width_still_pads_rows_and_matches(llama_pair):
    eager, graphed = llama_pair
    prompt = [[(7 * i) % 50 + 1 for i in range(40)]]  # 41 KV entries > widest captured (32)
    reqs = {r: [Req([])] for r in ("eager", "graphed")}
    run_extend(eager, reqs["eager"], prompt)
    run_extend(graphed, reqs["graphed"], prompt)
    want = run_decode(eager, reqs["eager"], [9])
    got = run_decode(graphed, reqs["graphed"], [9])
    assert graphed.graph_runner.last_key == (1, 41)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    free(eager, reqs["eager"])
    free(graphed, reqs["graphed"])


def test_extend_runs_eagerly_and_batches_past_the_largest_bucket_replay_in_slices(llama_pair):
    eager, graphed = llama_pair
    prompts = [[i + 1, i + 2, (3 * i) % 11 + 1] for i in range(11)]
    reqs = {r: [Req([]) for _ in prompts] for r in ("eager", "graphed")}
    graphed.graph_runner.last_key = None
    run_extend(eager, reqs["eager"], prompts)
    run_extend(graphed, reqs["graphed"], prompts)
    assert graphed.graph_runner.last_key is None          # EXTEND: never a graph
    keys = []
    run = graphed.graph_runner.run
    graphed.graph_runner.run = lambda inputs, bucket, seq_len: keys.append(
        (inputs["input_ids"].tolist(), bucket)) or run(inputs, bucket, seq_len)
    try:
        nxt = [20 + i for i in range(11)]
        want = run_decode(eager, reqs["eager"], nxt)
        got = run_decode(graphed, reqs["graphed"], nxt)    # 11 > cuda_graph_max_bs 4: 4 + 4 + 3
    finally:
        del graphed.graph_runner.run
    assert keys == [(nxt[0:4], 4), (nxt[4:8], 4), (nxt[8:11], 4)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for r_e, r_g in zip(reqs["eager"], reqs["graphed"]):  # each row's KV written once, as eagerly
        torch.testing.assert_close(_kv(graphed)[:, :, int(r_g.slots[-1])], _kv(eager)[:, :, int(r_e.slots[-1])],
                                   rtol=1e-5, atol=1e-5)
    out = run_decode(graphed, reqs["graphed"][:2], [6, 7])
    assert out.shape[0] == 2 and graphed.graph_runner.last_key == (2, 16)
    free(eager, reqs["eager"])
    free(graphed, reqs["graphed"])


def test_no_slices_under_dp_attention(tiny_llama_dir):
    graphed = _runner(tiny_llama_dir, eager_graph_stand_in=True, cuda_graph_max_bs=4)
    fb = ForwardBatch(ForwardMode.DECODE, *[torch.zeros(6, dtype=torch.int64)] * 6)
    assert [(a, b, k) for a, b, k in graphed._graph_chunks(fb)] == [(0, 4, 4), (4, 6, 2)]
    graphed.pstate = type(graphed.pstate)(tp_size=2, attn_dp_size=2)
    assert graphed._graph_chunks(fb) is None


def test_bucket_choice_follows_the_dp_counts_and_the_agreement(tiny_llama_dir):
    # Without a second rank, a single-rank runner shows which bucket a DP-attention
    # batch would get: from max(global_num_tokens), only when can_run_graph is set.
    graphed = _runner(tiny_llama_dir, eager_graph_stand_in=True, cuda_graph_max_bs=16)
    graphed.pstate = type(graphed.pstate)(tp_size=2, attn_dp_size=2)
    fb = ForwardBatch.idle()
    fb.global_num_tokens = [0, 5]
    assert graphed._graph_bucket(fb) is None          # no agreement: eager
    fb.can_run_graph = True
    assert graphed._graph_bucket(fb) == 8
    fb.global_num_tokens = [17, 0]
    assert graphed._graph_bucket(fb) is None          # past 16
    ext = ForwardBatch(ForwardMode.EXTEND, *[torch.zeros(0, dtype=torch.int64)] * 6)
    ext.can_run_graph, ext.global_num_tokens = True, [1, 1]
    assert graphed._graph_bucket(ext) is None
