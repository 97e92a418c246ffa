"""The scheduler on the real SmolLM2 model: caching, batching, chunking and retraction
change nothing in the greedy tokens; the chat model answers a fact question."""

import pytest

from fleetserve.entrypoints.engine import Engine
from fleetserve.engine.io_struct import TokenizedGenerateReq
from fleetserve.engine.sampling_params import SamplingParams
from helpers.scheduler_driver import run_to_completion as run

SHARED = ("You are a careful assistant. Answer briefly and precisely, and never invent facts. "
          "The following question is about geography and history of European countries.")
pytestmark = pytest.mark.slow

QUESTIONS = [" Which river flows through Paris?", " Name a mountain range in Spain.",
             " What sea lies east of Italy and west of the Balkans?"]


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def test_radix_cache_on_off_same_tokens_exact_reuse(smol, smol_sched):
    runner, tok = smol
    shared = tok.encode(SHARED)
    ids = [shared + tok.encode(q) for q in QUESTIONS]
    res = {}
    for disable in (False, True):
        s = smol_sched(disable_radix_cache=disable)
        run(s, [TokenizedGenerateReq("warm", shared + tok.encode(" Hello."), greedy(4))])
        res[disable] = run(s, [TokenizedGenerateReq(f"q{i}", x, greedy(6)) for i, x in enumerate(ids)])
        for i, x in enumerate(ids):
            # the questions share exactly the system text with the warm-up prompt (a fresh token follows it)
            expected = 0 if disable else len(shared)
            assert res[disable][f"q{i}"][1].cached_tokens == expected
    for rid in res[False]:
        assert res[False][rid][0] == res[True][rid][0]


def test_mixed_lengths_batch_and_chunked_prefill_match_alone(smol, smol_sched):
    runner, tok = smol
    prompts = [tok.encode(SHARED + q) for q in QUESTIONS[:2]] + [tok.encode("Hi")]
    reqs = [TokenizedGenerateReq(f"m{i}", p, greedy(6)) for i, p in enumerate(prompts)]
    together = run(smol_sched(disable_radix_cache=True), reqs)
    chunked = run(smol_sched(chunked_prefill_size=16), reqs)
    for r in reqs:
        alone = run(smol_sched(disable_radix_cache=True), [r])
        assert together[r.rid][0] == alone[r.rid][0]
        assert chunked[r.rid][0] == alone[r.rid][0]


def test_small_pool_retracts_and_gives_same_tokens(smol, smol_sched):
    runner, tok = smol
    reqs = [TokenizedGenerateReq(f"p{i}", tok.encode(q), greedy(12)) for i, q in enumerate(QUESTIONS)]
    roomy = run(smol_sched(), reqs)
    s = smol_sched(pool_size=40, schedule_conservativeness=0.05)
    tight = run(s, reqs)
    assert s.num_retracted > 0
    for r in reqs:
        assert tight[r.rid][0] == roomy[r.rid][0]


def test_smollm2_says_paris(smol, smol_view):
    runner, tok = smol
    engine = Engine(model_runner=smol_view, tokenizer=tok)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 16})
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
