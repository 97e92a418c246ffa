"""Stop strings belong to the detokenizing side (RequestDetokenizer), for the offline
Engine and the tokenizer manager alike; the scheduler only sees the abort that follows."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time

import pytest
import torch

from fleetserve.engine.io_struct import ReqOutput, TokenizedGenerateReq
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.entrypoints.detokenizer import RequestDetokenizer
from fleetserve.entrypoints.engine import Engine
from fleetserve.entrypoints.validation import native_sampling

sys.path.insert(0, os.path.dirname(__file__))
from scripted_scheduler import SCRIPT, ByteTokenizer, ScriptedScheduler  # noqa: E402


class LetterTokenizer:
    """Token t <-> letter chr(97 + t % 26)."""

    def encode(self, text):
        return [ord(c) - 97 for c in text]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(97 + t % 26) for t in ids)


def greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def prompt(seed, n, vocab=50):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def scheduler_tokens(sched, req):
    """Run one request on a bare scheduler; its output ids."""
    ids = []
    for o in sched.add_request(req):
        ids += o.new_token_ids
    while sched.has_work():
        for o in sched.step():
            ids += o.new_token_ids
    return ids


def base_and_stop(make_sched):
    """The fake runner's greedy 12 tokens for prompt(8, 8), a stop string inside them, and
    how many tokens it takes for that string to appear."""
    base = scheduler_tokens(make_sched(), TokenizedGenerateReq("b", prompt(8, 8), greedy(12)))
    text = LetterTokenizer().decode(base)
    stop = text[5:7]
    return base, text, stop, text.index(stop) + len(stop)


# --------------------------------------------------------------------- offline Engine
def test_offline_stop_string_found_by_detokenizer_and_scheduler_aborted(make_sched):
    # Same request and expectations as the scheduler test this replaces: tokens up to the one
    # that completes the stop string, finish_reason {"type": "stop", "matched": stop}.
    base, text, stop, first_end = base_and_stop(make_sched)
    engine = Engine(model_runner=make_sched().runner, tokenizer=LetterTokenizer(), random_seed=0)
    out = engine.generate(input_ids=prompt(8, 8), sampling_params={
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "stop": [stop]})
    assert out["output_ids"] == base[:first_end]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["meta_info"]["completion_tokens"] == first_end
    assert out["text"] == text[: text.index(stop)]
    s = engine.scheduler
    # aborted right after the token that completed the stop: no more generated, no KV held
    assert not s.has_work()
    assert s.generation_tokens_total == first_end
    assert s.allocator.available_size() + s.cache.evictable_size() == s.pool_size


def test_offline_stop_inside_a_streamed_chunk_counts_accepted_tokens(make_sched):
    # With stream_interval=4 the scheduler hands over several tokens at once, and may have
    # generated past the stop; the client gets (and is billed for) tokens up to the stop only.
    base, text, stop, first_end = base_and_stop(make_sched)
    engine = Engine(model_runner=make_sched().runner, tokenizer=LetterTokenizer(), random_seed=0,
                    stream_interval=4)
    out = engine.generate(input_ids=prompt(8, 8), return_logprob=True, sampling_params={
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "stop": stop})
    assert out["output_ids"] == base[:first_end]
    assert out["meta_info"]["completion_tokens"] == first_end
    assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == base[:first_end]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert engine.scheduler.generation_tokens_total < 12 and not engine.scheduler.has_work()


def test_offline_skip_tokenizer_init_ignores_stop_strings(make_sched):
    # As before the change: without a tokenizer there is no text, so stop strings cannot match;
    # the request runs to its length and returns no text.
    base, _, stop, _ = base_and_stop(make_sched)
    engine = Engine(model_runner=make_sched().runner, skip_tokenizer_init=True, random_seed=0)
    assert engine.tokenizer is None
    out = engine.generate(input_ids=prompt(8, 8), sampling_params={
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "stop": [stop]})
    assert out["output_ids"] == base and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert out["meta_info"]["completion_tokens"] == 12
    with pytest.raises(ValueError):
        engine.generate("abc")


# ------------------------------------------------------------------ RequestDetokenizer
def msg(ids, finished=False, reason=None, n=0, logprobs=False):
    lps = [(-0.1 * k, t) for k, t in enumerate(ids)] if logprobs else None
    return ReqOutput("r", list(ids), finished, reason, 3, n, 0, output_logprobs=lps,
                     output_top_logprobs=[[(-0.1, t)] for t in ids] if logprobs else None)


def test_detokenizer_cuts_a_chunk_at_the_stop_and_asks_for_an_abort():
    d = RequestDetokenizer(LetterTokenizer(), SamplingParams(stop=["cd"]))
    first = d.feed(msg([0, 1], n=2, logprobs=True))  # "ab"
    assert first.text == "ab" and not first.finished and first.completion_tokens == 2
    step = d.feed(msg([2, 3, 4, 5], n=6, logprobs=True))  # "cdef": stop completes at token 3
    assert step.token_ids == [2, 3] and step.text == ""
    assert step.output_logprobs == [(0.0, 2), (-0.1, 3)] and len(step.output_top_logprobs) == 2
    assert step.finished and step.abort_scheduler
    assert step.finish_reason == {"type": "stop", "matched": "cd"}
    assert step.completion_tokens == 4 and d.text == "ab"
    late = d.feed(msg([], True, {"type": "abort", "message": "aborted"}, n=6))  # the abort's answer
    assert late.finished and late.token_ids == [] and late.completion_tokens == 4


def test_detokenizer_stop_in_the_schedulers_last_message_needs_no_abort():
    d = RequestDetokenizer(LetterTokenizer(), SamplingParams(stop=["c"]))
    step = d.feed(msg([0, 1, 2], True, {"type": "length", "length": 3}, n=3))
    assert step.finish_reason == {"type": "stop", "matched": "c"} and not step.abort_scheduler
    assert step.text == "ab" and step.completion_tokens == 3


@pytest.mark.parametrize("trim, text", [(False, "abc"), (True, "ab")])
def test_detokenizer_stop_token_text_trimmed_only_when_asked(trim, text):
    d = RequestDetokenizer(LetterTokenizer(), SamplingParams(stop_token_ids=[2]), trim_stop_token=trim)
    step = d.feed(msg([0, 1, 2], True, {"type": "stop", "matched": 2}, n=3))
    assert step.text == text and step.token_ids == [0, 1, 2] and step.completion_tokens == 3
    assert step.finish_reason == {"type": "stop", "matched": 2} and not step.abort_scheduler


# ------------------------------------------------------------------- tokenizer manager
def test_tokenizer_manager_aborts_the_scheduler_on_a_stop_string():
    from fleetserve.entrypoints.tokenizer_manager import ModelInfo, TokenizerManager

    d = tempfile.mkdtemp(prefix="fs-stop-")
    in_ep, out_ep = f"ipc://{d}/in", f"ipc://{d}/out"
    full = SCRIPT.decode()
    expected_tokens = len(full[: full.index("STOP") + 4].encode())

    async def main():
        tm = TokenizerManager(ByteTokenizer(), ModelInfo("/m", "toy", 257, 200, [256]), in_ep, out_ep)
        sched = ScriptedScheduler(in_ep, out_ep, delay=0.01)
        try:
            await tm.wait_connected(10)
            sp = native_sampling({"max_new_tokens": 40, "stop": ["STOP"]}, prompt_len=1, vocab_size=257,
                                 context_length=200)
            [stream] = tm.submit([120], sp, rid="stop-1")
            outs = [o async for o in stream]
            t0 = time.monotonic()
            while "stop-1" not in sched.aborted and time.monotonic() - t0 < 2:
                await asyncio.sleep(0.01)
            return outs, list(sched.aborted)
        finally:
            await tm.close()
            sched.close()

    outs, aborted = asyncio.run(main())
    last = outs[-1]
    assert "".join(o.text for o in outs) == full[: full.index("STOP")]
    assert last.finish_reason == "stop" and last.matched_stop == "STOP"
    assert last.completion_tokens == expected_tokens == sum(len(o.token_ids) for o in outs)
    assert aborted == ["stop-1"]  # the scripted scheduler knows nothing of stop strings
