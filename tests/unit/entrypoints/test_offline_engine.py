"""fleetserve.Engine.generate on the fake runner: result shape, n > 1, seeds, stop strings, logprobs."""

import pytest


from fleetserve.entrypoints.engine import Engine
from fleetserve.entrypoints.errors import APIError


class LetterTokenizer:
    """Token t <-> letter chr(97 + t) for t < 26."""

    def encode(self, text):
        return [ord(c) - 97 for c in text]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(97 + t % 26) for t in ids)


@pytest.fixture
def engine(make_sched):
    runner = make_sched(pool_size=400, vocab_size=26).runner
    return Engine(model_runner=runner, tokenizer=LetterTokenizer(), random_seed=0)


def test_single_prompt_returns_dict(engine):
    out = engine.generate("hello", {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    assert isinstance(out, dict)
    assert len(out["output_ids"]) == 6 and out["text"] == LetterTokenizer().decode(out["output_ids"])
    m = out["meta_info"]
    assert m["prompt_tokens"] == 5 and m["completion_tokens"] == 6 and m["cached_tokens"] == 0
    assert m["finish_reason"] == {"type": "length", "length": 6}
    again = engine.generate(input_ids=LetterTokenizer().encode("hello"),
                            sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    assert again["output_ids"] == out["output_ids"] and again["meta_info"]["cached_tokens"] == 4


def test_batch_and_n_samples(engine):
    outs = engine.generate(["abc", "xyz"], [{"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
                                            {"temperature": 1.0, "n": 3, "seed": 7, "max_new_tokens": 5,
                                             "ignore_eos": True}])
    assert len(outs) == 4
    assert len(outs[0]["output_ids"]) == 3 and all(len(o["output_ids"]) == 5 for o in outs[1:])
    # seeds 7, 8, 9 -> reproducible per sample
    again = engine.generate("xyz", {"temperature": 1.0, "n": 3, "seed": 7, "max_new_tokens": 5, "ignore_eos": True})
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs[1:]]
    single = engine.generate("xyz", {"temperature": 1.0, "seed": 8, "max_new_tokens": 5, "ignore_eos": True})
    assert single["output_ids"] == outs[2]["output_ids"]


def test_stop_string_cut_from_text(engine):
    base = engine.generate("stop", {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True})
    text = base["text"]
    stop = text[4:6]
    out = engine.generate("stop", {"temperature": 0, "max_new_tokens": 10, "stop": stop, "ignore_eos": True})
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_logprobs_in_meta_info(engine):
    out = engine.generate("logp", {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
                          return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
    m = out["meta_info"]
    assert [t for _, t, _ in m["output_token_logprobs"]] == out["output_ids"]
    assert all(len(x) == 2 for x in m["output_top_logprobs"])
    # greedy: the chosen token is the best alternative
    assert all(top[0][1] == t for top, t in zip(m["output_top_logprobs"], out["output_ids"]))
    assert [t for _, t, _ in m["input_token_logprobs"]] == LetterTokenizer().encode("logp")
    assert m["input_token_logprobs"][0][0] is None


def test_bad_arguments_raise(engine):
    with pytest.raises(ValueError):
        engine.generate()
    with pytest.raises(ValueError):
        engine.generate("a", {"temperature": -1})
    with pytest.raises(ValueError):
        engine.generate(["a", "b"], [{}])


@pytest.mark.parametrize("ids", [[], [1, 2.5], [1, True], [-1], [10**9]])
def test_bad_token_ids_raise_and_engine_keeps_working(engine, ids):
    with pytest.raises(ValueError, match="prompt 0"):
        engine.generate(input_ids=[ids] if not ids else ids, sampling_params={"max_new_tokens": 1})
    ok = engine.generate(input_ids=[1, 2, 3], sampling_params={"temperature": 0, "max_new_tokens": 2,
                                                               "ignore_eos": True})
    assert len(ok["output_ids"]) == 2


def test_offline_and_http_refuse_with_the_same_error(engine):
    """Engine.generate goes through the validation of POST /generate: same error type, same field names."""
    with pytest.raises(APIError) as err:
        engine.generate("a", {"temperature": -1})
    assert err.value.param == "sampling_params.temperature" and err.value.status == 400
    with pytest.raises(APIError) as err:
        engine.generate("a", {"temp": 1})
    assert err.value.param == "sampling_params.temp"
