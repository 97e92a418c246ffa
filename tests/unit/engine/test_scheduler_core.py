"""Scheduler on a fake runner whose tokens depend on the KV slots it reads back.

The KV invariant (free + cached + in use == pool, no slot twice) is checked
after every step (``check_invariants=True`` in conftest.make_scheduler).
"""

import torch

from fleetserve.core.forward_batch import ForwardMode
from fleetserve.engine.io_struct import TokenizedGenerateReq
from fleetserve.engine.sampling_params import SamplingParams
from helpers.scheduler_driver import prompt, run


def greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_shared_prefix_radix_on_off_same_tokens_exact_reuse(make_sched):
    shared = prompt(1, 40)
    suffixes = [[3, 4, 5], [7, 8], [9, 1, 2, 3, 4]]
    results = {}
    for disable in (False, True):
        s = make_sched(disable_radix_cache=disable)
        first = run(s, [TokenizedGenerateReq("a", shared + [11, 12], greedy(6))])
        rest = run(s, [TokenizedGenerateReq(f"r{i}", shared + suf, greedy(6)) for i, suf in enumerate(suffixes)])
        results[disable] = (first, rest)
        for rid, (ids, o) in rest.items():
            assert o.cached_tokens == (0 if disable else 40), (rid, o.cached_tokens)
            assert len(ids) == 6 and o.finish_reason == {"type": "length", "length": 6}
        assert s.get_stats().cached_prompt_tokens_total == (0 if disable else 120)
    on, off = results[False], results[True]
    assert on[0]["a"][0] == off[0]["a"][0]
    for rid in on[1]:
        assert on[1][rid][0] == off[1][rid][0]


def test_mixed_length_batch_equals_each_alone(make_sched):
    lens = [3, 17, 1, 40, 9]
    reqs = [TokenizedGenerateReq(f"m{i}", prompt(10 + i, n), greedy(5 + i)) for i, n in enumerate(lens)]
    together = run(make_sched(), reqs)
    for r in reqs:
        alone = run(make_sched(), [r])
        assert alone[r.rid][0] == together[r.rid][0]
        assert len(together[r.rid][0]) == r.sampling.max_new_tokens


def test_batches_really_mix_requests(make_sched):
    s = make_sched()
    run(s, [TokenizedGenerateReq(f"x{i}", prompt(i, 5 + i), greedy(8)) for i in range(4)])
    extend_bs = [bs for mode, bs, _ in s.runner.forwards if mode == ForwardMode.EXTEND]
    decode_bs = [bs for mode, bs, _ in s.runner.forwards if mode == ForwardMode.DECODE]
    assert extend_bs == [4] and max(decode_bs) == 4 and len(decode_bs) == 7


def test_chunked_prefill_equals_unchunked_and_progresses(make_sched):
    reqs = [TokenizedGenerateReq(f"c{i}", prompt(20 + i, n), greedy(6)) for i, n in enumerate([30, 5, 23])]
    whole = run(make_sched(chunked_prefill_size=-1), reqs)
    s = make_sched(chunked_prefill_size=7)
    chunked = run(s, reqs)
    for r in reqs:
        assert chunked[r.rid][0] == whole[r.rid][0]
    extends = [n for mode, _, n in s.runner.forwards if mode == ForwardMode.EXTEND]
    assert max(extends) <= 7
    assert sum(extends) == 30 + 5 + 23  # every prompt token computed exactly once


def test_small_pool_retracts_and_finishes_all_with_same_tokens(make_sched):
    reqs = [TokenizedGenerateReq(f"p{i}", prompt(30 + i, 10 + i), greedy(30)) for i in range(6)]
    roomy = run(make_sched(pool_size=1000), reqs)
    # an optimistic decode reserve admits too many, so decode runs out of KV
    s = make_sched(pool_size=90, schedule_conservativeness=0.05)
    tight = run(s, reqs)
    assert s.num_retracted > 0
    for r in reqs:
        assert tight[r.rid][0] == roomy[r.rid][0]
        assert tight[r.rid][1].finish_reason["type"] == "length"


def test_small_pool_retraction_keeps_seeded_samples(make_sched):
    reqs = [TokenizedGenerateReq(f"s{i}", prompt(40 + i, 12), SamplingParams(
        max_new_tokens=25, temperature=1.0, seed=100 + i, ignore_eos=True)) for i in range(5)]
    roomy = run(make_sched(pool_size=1000), reqs)
    s = make_sched(pool_size=80, disable_radix_cache=True, schedule_conservativeness=0.05)
    tight = run(s, reqs)
    assert s.num_retracted > 0
    for r in reqs:
        assert tight[r.rid][0] == roomy[r.rid][0]


def test_abort_mid_decode_frees_kv(make_sched):
    s = make_sched(pool_size=200)
    s.add_request(TokenizedGenerateReq("keep", prompt(50, 10), greedy(20)))
    s.add_request(TokenizedGenerateReq("kill", prompt(51, 12), greedy(100)))
    for _ in range(5):
        s.step()
    assert s.cache.protected_size() > 0
    out = s.abort("kill")
    assert out and out[0].finished and out[0].finish_reason["type"] == "abort"
    s.check_kv()
    assert all(r.rid != "kill" for r in s.running)
    while s.has_work():
        s.step()
    assert s.cache.protected_size() == 0
    assert s.allocator.available_size() + s.cache.evictable_size() == 200
    assert s.abort("kill") == []


def test_abort_waiting_and_chunked(make_sched):
    s = make_sched(pool_size=300, chunked_prefill_size=4)
    s.add_request(TokenizedGenerateReq("long", prompt(52, 30), greedy(5)))
    s.step()
    assert s.chunked_req is not None and s.chunked_req.rid == "long"
    s.add_request(TokenizedGenerateReq("w", prompt(53, 3), greedy(5)))
    assert s.abort("long")[0].finish_reason["type"] == "abort"
    assert s.abort("w")[0].finish_reason["type"] == "abort"
    s.check_kv()
    assert not s.has_work() and s.cache.protected_size() == 0


def test_n_samples_share_one_prefill(make_sched):
    s = make_sched()
    p = prompt(60, 100)
    reqs = [TokenizedGenerateReq(f"n{i}", p, SamplingParams(max_new_tokens=4, temperature=1.0, seed=i,
                                                            ignore_eos=True)) for i in range(4)]
    out = run(s, reqs)
    extends = [n for mode, _, n in s.runner.forwards if mode == ForwardMode.EXTEND]
    assert sum(extends) == 100 + 3  # one prefill; the others recompute only the last prompt token
    assert sorted(o.cached_tokens for _, o in out.values()) == [0, 99, 99, 99]


def test_lpm_prefers_cached_prefix_fcfs_keeps_order(make_sched):
    cached = prompt(70, 30)
    orders = {}
    for policy in ("lpm", "fcfs"):
        s = make_sched(schedule_policy=policy, max_running_requests=1)
        run(s, [TokenizedGenerateReq("warm", cached + [1], greedy(2))])
        s.add_request(TokenizedGenerateReq("cold", prompt(71, 30), greedy(3)))
        s.add_request(TokenizedGenerateReq("hot", cached + [2], greedy(3)))
        order = []
        while s.has_work():
            order += [o.rid for o in s.step() if o.finished]
        orders[policy] = order
    assert orders["lpm"] == ["hot", "cold"]
    assert orders["fcfs"] == ["cold", "hot"]


def test_max_running_requests_bounds_batches(make_sched):
    s = make_sched(max_running_requests=3)
    out = run(s, [TokenizedGenerateReq(f"q{i}", prompt(80 + i, 6), greedy(5)) for i in range(7)])
    assert len(out) == 7
    assert max(bs for _, bs, _ in s.runner.forwards) <= 3


def test_admission_reserves_decode_room(make_sched):
    # 100 slots: each request needs 10 prompt + 40 output; admission must not
    # start all eight at once, and all finish.
    s = make_sched(pool_size=100)
    out = run(s, [TokenizedGenerateReq(f"r{i}", prompt(90 + i, 10), greedy(40)) for i in range(8)])
    assert all(len(ids) == 40 for ids, _ in out.values())
    assert max(bs for _, bs, _ in s.runner.forwards) < 8


def test_finish_reasons(make_sched):
    s = make_sched(eos=(7,))
    # find the greedy continuation, then use its 3rd token as stop token / eos
    base = run(s, [TokenizedGenerateReq("b", prompt(99, 8), greedy(10))])["b"][0]
    stop_tok = base[2]
    s = make_sched(eos=(stop_tok,))
    r = run(s, [
        TokenizedGenerateReq("eos", prompt(99, 8), SamplingParams(max_new_tokens=10, temperature=0.0)),
        TokenizedGenerateReq("ign", prompt(99, 8), greedy(10)),
    ])
    first = base.index(stop_tok)
    assert r["eos"][0] == base[: first + 1]
    assert r["eos"][1].finish_reason == {"type": "stop", "matched": stop_tok}
    assert r["ign"][0] == base
    s = make_sched()
    r = run(s, [TokenizedGenerateReq("st", prompt(99, 8), greedy(10, stop_token_ids=[stop_tok]))])
    assert r["st"][0] == base[: first + 1] and r["st"][1].finish_reason["matched"] == stop_tok


def test_max_new_tokens_none_runs_to_context_length(make_sched):
    s = make_sched(context_length=30)
    r = run(s, [TokenizedGenerateReq("ctx", prompt(5, 12), SamplingParams(max_new_tokens=None, temperature=0.0,
                                                                          ignore_eos=True))])
    assert len(r["ctx"][0]) == 30 - 12 and r["ctx"][1].finish_reason["type"] == "length"
    s2 = make_sched(context_length=30)
    out = s2.add_request(TokenizedGenerateReq("big", prompt(5, 30), greedy(2)))
    assert out[0].finish_reason["type"] == "abort" and not s2.has_work()


def test_max_new_tokens_zero_prefills_only(make_sched):
    s = make_sched()
    r = run(s, [TokenizedGenerateReq("z", prompt(6, 12), greedy(0))])
    assert r["z"][0] == [] and r["z"][1].finish_reason == {"type": "length", "length": 0}
    assert s.cache.total_size() == 12


def test_scheduler_leaves_stop_strings_to_the_detokenizer(make_sched):
    # The scheduler has no tokenizer: a request with stop strings runs to its length limit
    # (the detokenizing side finds the string and aborts it; see
    # tests/unit/entrypoints/test_stop_strings.py, which checks the same stop on that side).
    s = make_sched()
    base = run(s, [TokenizedGenerateReq("b", prompt(8, 8), greedy(12))])["b"][0]
    stop = "".join(chr(97 + t % 26) for t in base)[5:7]
    s = make_sched()
    assert not hasattr(s, "tokenizer")
    r = run(s, [TokenizedGenerateReq("s", prompt(8, 8), greedy(12, stop=[stop]))])
    assert r["s"][0] == base
    assert r["s"][1].finish_reason == {"type": "length", "length": 12}


def test_streaming_sends_every_token_once(make_sched):
    s = make_sched()
    s.add_request(TokenizedGenerateReq("st", prompt(9, 5), greedy(6), stream=True))
    msgs = []
    while s.has_work():
        msgs += s.step()
    assert [len(m.new_token_ids) for m in msgs] == [1] * 6
    assert [m.finished for m in msgs] == [False] * 5 + [True]


def test_logprobs_match_log_softmax_and_prompt_logprobs(make_sched):
    s = make_sched()
    p = prompt(11, 9)
    req = TokenizedGenerateReq("lp", p, greedy(4), return_logprob=True, top_logprobs_num=3, logprob_start_len=0)
    r = run(s, [req])
    ids, o = r["lp"]
    runner = s.runner
    hist = list(p)
    for k, t in enumerate(ids):
        ref = torch.log_softmax(runner._row(hist), -1)
        lp, tok = o.output_logprobs[k]
        assert tok == t and abs(lp - float(ref[t])) < 1e-5
        top = o.output_top_logprobs[k]
        assert [x[1] for x in top] == ref.topk(3).indices.tolist()
        hist.append(t)
    assert o.input_logprobs[0] == (None, p[0])
    assert len(o.input_logprobs) == len(p)
    for q in range(1, len(p)):
        ref = torch.log_softmax(runner._row(p[:q]), -1)
        assert o.input_logprobs[q][1] == p[q]
        assert abs(o.input_logprobs[q][0] - float(ref[p[q]])) < 1e-5
    # from a later start and with a chunked prefill: same values, cache reuse still correct
    s2 = make_sched(chunked_prefill_size=4)
    run(s2, [TokenizedGenerateReq("warm", p + [1], greedy(1))])
    r2 = run(s2, [TokenizedGenerateReq("lp2", p, greedy(4), return_logprob=True, logprob_start_len=5)])
    o2 = r2["lp2"][1]
    assert r2["lp2"][0] == ids
    assert [x[1] for x in o2.input_logprobs] == p[5:]
    for a, b in zip(o2.input_logprobs, o.input_logprobs[5:]):
        assert abs(a[0] - b[0]) < 1e-5
    assert o2.cached_tokens == 4


def test_flush_cache_and_stats(make_sched):
    s = make_sched(pool_size=300)
    run(s, [TokenizedGenerateReq("f", prompt(12, 20), greedy(5))])
    st = s.get_stats()
    assert st.kv_pool_size == 300 and st.kv_cached_tokens == 24 and st.kv_used_tokens == 0
    assert st.prompt_tokens_total == 20 and st.generation_tokens_total == 5
    assert s.flush_cache() and s.cache.total_size() == 0 and s.allocator.available_size() == 300


def test_prompt_id_outside_the_vocabulary_is_named_in_the_abort(make_sched):
    s = make_sched()
    out = s.add_request(TokenizedGenerateReq("oov", [1, 2, s.vocab_size + 5, 3], greedy(2)))
    assert out[0].finished and out[0].finish_reason["type"] == "abort"
    assert f"prompt token id {s.vocab_size + 5} " in out[0].finish_reason["message"]
    assert not s.has_work()
