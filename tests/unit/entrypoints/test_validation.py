"""entrypoints.validation: one function per request dialect, one error type, the client's field names."""

import pytest

from fleetserve.entrypoints.errors import APIError
from fleetserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from fleetserve.entrypoints.request_parse import parse_model
from fleetserve.entrypoints.validation import (
    chat_messages,
    chat_sampling,
    check_chat_request,
    check_completion_request,
    check_input_ids,
    completion_prompts,
    completion_sampling,
    fit_sampling,
    generate_prompts,
    generate_rids,
    generate_sampling_dicts,
    native_sampling,
)

VOCAB, CTX = 50, 100
LIMITS = {"vocab_size": VOCAB, "context_length": CTX}
USER = [{"role": "user", "content": "hi"}]


def refused(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as err:
        fn(*args, **kwargs)
    return err.value


def test_the_error_is_a_plain_value_error():
    e = APIError("nope", 413, "prompt", "request_too_large")
    assert isinstance(e, ValueError)
    assert e.to_dict() == {"error": {"message": "nope", "type": "invalid_request_error", "param": "prompt",
                                     "code": "request_too_large"}}
    assert APIError("down", 503).to_dict()["error"]["code"] is None  # OpenAI: a string or null, never the status


def test_completion_default_max_tokens_is_16_capped_by_the_room_left():
    req = CompletionRequest(prompt="x")
    assert completion_sampling(req, prompt_len=10, **LIMITS).max_new_tokens == 16
    assert completion_sampling(req, prompt_len=CTX - 5, **LIMITS).max_new_tokens == 5


def test_chat_without_max_tokens_gets_the_whole_room():
    req = ChatCompletionRequest(messages=USER)
    assert chat_sampling(req, prompt_len=30, **LIMITS).max_new_tokens == CTX - 30


@pytest.mark.parametrize("fields,param", [
    ({"max_completion_tokens": 90}, "max_completion_tokens"),
    ({"max_tokens": 90}, "max_tokens"),
    ({"max_tokens": 1, "max_completion_tokens": 90}, "max_completion_tokens"),
])
def test_chat_overflow_names_the_field_the_client_sent(fields, param):
    e = refused(chat_sampling, ChatCompletionRequest(messages=USER, **fields), prompt_len=20, **LIMITS)
    assert (e.status, e.param, e.code) == (400, param, "context_length_exceeded")


@pytest.mark.parametrize("fn,req,param", [
    (completion_sampling, CompletionRequest(prompt="x", max_tokens=0), "max_tokens"),
    (completion_sampling, CompletionRequest(prompt="x", max_tokens=-3, echo=True), "max_tokens"),
    (chat_sampling, ChatCompletionRequest(messages=USER, max_tokens=0), "max_tokens"),
    (chat_sampling, ChatCompletionRequest(messages=USER, max_completion_tokens=0), "max_completion_tokens"),
    (chat_sampling, ChatCompletionRequest(messages=USER, max_tokens=0, max_completion_tokens=5), "max_tokens"),
])
def test_openai_output_length_below_one_is_refused_as_vllm_does(fn, req, param):
    e = refused(fn, req, prompt_len=1, **LIMITS)
    got = getattr(req, param)
    assert (e.status, e.param, e.message) == (400, param, f"{param} must be at least 1, got {got}.")


def test_echo_with_max_tokens_zero_generates_nothing_and_native_zero_stays_allowed():
    req = CompletionRequest(prompt="x", max_tokens=0, echo=True)  # vLLM's "echo without generation"
    assert completion_sampling(req, prompt_len=1, **LIMITS).max_new_tokens == 0
    assert native_sampling({"max_new_tokens": 0}, prompt_len=1, **LIMITS).max_new_tokens == 0  # SGLang allows it


def test_prompt_filling_the_context_is_blamed_on_the_prompt():
    e = refused(fit_sampling, {"max_new_tokens": 1}, prompt_len=CTX, **LIMITS)
    assert e.param == "prompt" and e.code == "context_length_exceeded"


def test_a_chat_prompt_filling_the_context_is_blamed_on_the_messages():
    req = parse_model(ChatCompletionRequest, {"messages": USER, "max_tokens": 1})
    e = refused(chat_sampling, req, prompt_len=CTX, **LIMITS)
    assert (e.status, e.param, e.code) == (400, "messages", "context_length_exceeded")


@pytest.mark.parametrize("model,check,body", [
    (CompletionRequest, check_completion_request, {"prompt": "hi"}),
    (ChatCompletionRequest, check_chat_request, {"messages": USER}),
])
def test_stream_options_need_stream_true(model, check, body):
    opts = {"stream_options": {"include_usage": True}}
    for stream in (None, False):
        extra = {} if stream is None else {"stream": stream}
        e = refused(check, parse_model(model, {**body, **opts, **extra}))
        assert (e.status, e.param) == (400, "stream_options") and "stream" in str(e)
    check(parse_model(model, {**body, **opts, "stream": True}))  # allowed when streaming
    check(parse_model(model, {**body, "stream": False, "stream_options": None}))  # null is no option


def test_range_errors_name_the_sampling_field():
    e = refused(completion_sampling, CompletionRequest(prompt="x", top_p=1.5), prompt_len=1, **LIMITS)
    assert e.param == "top_p" and "top_p" in e.message
    e = refused(completion_sampling, CompletionRequest(prompt="x", stop_token_ids=[VOCAB]), prompt_len=1, **LIMITS)
    assert e.param == "stop_token_ids"


def test_native_sampling_prefixes_fields_and_defaults_to_128():
    assert native_sampling(None, prompt_len=1, vocab_size=VOCAB, context_length=None).max_new_tokens == 128
    assert native_sampling({"max_new_tokens": None}, prompt_len=10, **LIMITS).max_new_tokens == CTX - 10
    assert refused(native_sampling, {"temp": 1}, prompt_len=1, **LIMITS).param == "sampling_params.temp"
    assert refused(native_sampling, {"temperature": -1}, prompt_len=1, **LIMITS).param == "sampling_params.temperature"
    assert refused(native_sampling, {"max_new_tokens": 200}, prompt_len=1, **LIMITS).param == \
        "sampling_params.max_new_tokens"
    assert refused(native_sampling, {}, prompt_len=CTX, **LIMITS).param == "prompt"


def test_native_sampling_without_a_context_skips_the_fit():
    sp = native_sampling({"max_new_tokens": 10_000, "stop": "x"}, prompt_len=10_000, vocab_size=VOCAB,
                         context_length=None)
    assert sp.max_new_tokens == 10_000 and sp.stop == ["x"]


@pytest.mark.parametrize("ids,message", [
    ([], "p must not be empty"),
    ([1, True], "token ids must be integers; p[1] is True"),
    ([VOCAB], f"token id {VOCAB} at p[0] is outside the vocabulary [0, {VOCAB})"),
])
def test_check_input_ids_messages(ids, message):
    e = refused(check_input_ids, ids, VOCAB, "p")
    assert e.message == message and e.param == "p"


def test_completion_prompt_forms():
    enc = lambda t: [ord(c) % VOCAB for c in t]  # noqa: E731
    assert completion_prompts("ab", enc, VOCAB) == [enc("ab")]
    assert completion_prompts(["a", "b"], enc, VOCAB) == [enc("a"), enc("b")]
    assert completion_prompts([[1], [2, 3]], enc, VOCAB) == [[1], [2, 3]]
    assert completion_prompts([4, 5], enc, VOCAB) == [[4, 5]]
    assert refused(completion_prompts, ["a", ""], enc, VOCAB).message == "prompt[1] must not be empty"


def test_generate_batch_fields():
    enc = lambda t: [1] * len(t)  # noqa: E731
    assert generate_prompts(GenerateRequest(input_ids=[[1], [2]]), enc, VOCAB) == [[1], [2]]
    assert refused(generate_prompts, GenerateRequest(text="a", input_ids=[1]), enc, VOCAB).param == "text"
    assert refused(generate_prompts, GenerateRequest(text=["a", ""]), enc, VOCAB).param == "text"
    assert generate_sampling_dicts({"n": 2}, 3) == [{"n": 2}] * 3
    assert refused(generate_sampling_dicts, [{}], 2).param == "sampling_params"
    assert generate_rids(None, 2) == [None, None] and generate_rids(["a", "b"], 2) == ["a", "b"]
    assert refused(generate_rids, "a", 2).param == "rid"  # one id cannot name two prompts


def test_chat_messages_join_text_parts_and_rename_developer():
    req = ChatCompletionRequest(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"}])
    assert chat_messages(req) == [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "a\nb", "name": "u"}]
    bad = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    assert refused(chat_messages, bad).param == "messages.0.content.0.type"
    assert refused(chat_messages, ChatCompletionRequest(messages=[{"role": "user"}])).param == "messages"


def test_n_is_capped_at_max_n():
    from fleetserve.entrypoints.validation import MAX_N

    assert MAX_N == 128
    assert completion_sampling(CompletionRequest(prompt="x", n=MAX_N), prompt_len=1, **LIMITS).n == MAX_N
    e = refused(completion_sampling, CompletionRequest(prompt="x", n=5000), prompt_len=1, **LIMITS)
    assert (e.status, e.param, str(e)) == (400, "n", "n must be at most 128, got 5000")
    e = refused(chat_sampling, ChatCompletionRequest(messages=USER, n=129), prompt_len=1, **LIMITS)
    assert (e.status, e.param, str(e)) == (400, "n", "n must be at most 128, got 129")
    e = refused(native_sampling, {"n": 129}, prompt_len=1, **LIMITS)
    assert (e.status, e.param, str(e)) == (400, "sampling_params.n", "n must be at most 128, got 129")


@pytest.mark.parametrize("bad_ids, index, value", [([3, VOCAB + 7], 1, VOCAB + 7), ([-2], 0, -2)])
def test_stop_token_id_outside_the_vocabulary_is_named(bad_ids, index, value):
    """Issue 15: the error names the offending id and its place, not only the range."""
    e = refused(completion_sampling, CompletionRequest(prompt="x", stop_token_ids=bad_ids), prompt_len=1, **LIMITS)
    assert e.param == "stop_token_ids"
    assert f"stop_token_ids[{index}] = {value}" in e.message and f"[0, {VOCAB})" in e.message
    e = refused(native_sampling, {"stop_token_ids": bad_ids}, prompt_len=1, **LIMITS)
    assert e.param == "sampling_params.stop_token_ids" and f"= {value}" in e.message


def test_prompt_id_outside_the_vocabulary_is_named():
    e = refused(generate_prompts, GenerateRequest(input_ids=[1, 2, VOCAB + 3]), lambda t: [1], VOCAB)
    assert e.param == "input_ids" and f"token id {VOCAB + 3} at input_ids[2]" in e.message


def test_a_union_error_names_the_union_field_and_what_it_expected():
    body = {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 5}]}
    with pytest.raises(APIError) as exc:
        parse_model(ChatCompletionRequest, body)
    assert exc.value.param == "messages.1.content"
    assert str(exc.value) == "invalid value for 'messages.1.content': expected a valid list or a valid string"


def test_a_union_branch_that_took_the_value_reports_its_inner_error():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": 3}]}]}
    with pytest.raises(APIError) as exc:
        parse_model(ChatCompletionRequest, body)
    assert exc.value.param == "messages.0.content.1.text"
    assert str(exc.value) == "invalid value for 'messages.0.content.1.text': Input should be a valid string"
