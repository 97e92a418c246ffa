"""`fleetserve serve` on SmolLM2-135M, over HTTP, driven by the `openai` client.

The real server (HTTP process + scheduler process) is the entrypoint tests' shared
``smollm2_server`` (``conftest.py`` here: `--api-key`, a small body limit, 4096-token
context). Every request generates few tokens (CPU budget): greedy decoding makes the
streamed and non-streamed outputs comparable token for token.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from helpers.smollm2_server import API_KEY, MAX_BODY, MAX_TOTAL_TOKENS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models_and_info(client, http, model):
    assert model.startswith("SmolLM2-135M-Instruct")
    info = http.get("/get_model_info").json()
    assert info["vocab_size"] == 49152
    assert info["context_length"] == MAX_TOTAL_TOKENS == 4096  # min(model context 8192, --max-total-tokens)
    assert http.get("/health_generate").status_code == 200


def test_chat_stream_equals_non_stream(client, model):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                           top_logprobs=2)
    text = whole.choices[0].message.content
    assert "Paris" in text
    content = whole.choices[0].logprobs.content
    raw = bytes(b for t in content for b in t.bytes).decode()  # exact bytes per token
    assert raw == text or (whole.choices[0].finish_reason == "stop" and raw == text + "<|im_end|>")  # + EOS
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
               for t in content)
    chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    body = [c for c in chunks if c.choices]
    assert all(c.choices[0].index == 0 for c in body)
    assert "".join(c.choices[0].delta.content or "" for c in body) == text
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_n3_logprobs_and_stream(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3, temperature=0, n=3,
                                  logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = {c.text for c in r.choices}
    assert len(texts) == 1  # greedy: three identical samples
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3 and "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(val, abs=1e-4)  # greedy picks the top token
    assert r.usage.completion_tokens == 9
    per = {0: "", 1: "", 2: ""}
    for c in client.completions.create(model=model, prompt="The capital of France is", max_tokens=3, temperature=0,
                                       n=3, stream=True):
        for ch in c.choices:
            per[ch.index] += ch.text
    assert set(per.values()) == texts


def test_echo_with_max_tokens_zero(client, model):
    prompt = "Hello there, friend"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == prompt
    assert r.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == r.usage.prompt_tokens
    assert all(v is not None and v <= 0 for v in c.logprobs.token_logprobs[1:])
    assert "".join(c.logprobs.tokens) == prompt


def test_stop_string_across_token_boundary(client, model):
    prompt = "Q: Name three colors.\nA:"
    base = client.completions.create(model=model, prompt=prompt, max_tokens=7, temperature=0, logprobs=0)
    toks = base.choices[0].logprobs.tokens
    full = base.choices[0].text
    # a stop string made of the end of token 3 and the start of token 4 (both non-empty)
    k = next(i for i in range(2, len(toks) - 1) if toks[i].strip() and toks[i + 1].strip())
    stop = toks[k][-1:] + toks[k + 1][:1]
    start = full.find(stop)
    assert start >= 0
    r = client.completions.create(model=model, prompt=prompt, max_tokens=7, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:start] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=7, temperature=0, stop=[stop], stream=True) if c.choices)
    assert streamed == full[:start]


@pytest.mark.parametrize("prompt", ["Emoji list: 🍎 🍌 🍇 🍓 🍒", "日本語の文章：東京は"])
def test_multibyte_streaming(client, model, prompt):
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=7, temperature=0, logprobs=0)
    text = whole.choices[0].text
    # the model really emitted characters split over several byte tokens
    assert any(t == "\ufffd" for t in whole.choices[0].logprobs.tokens)
    deltas = [c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=7, temperature=0, stream=True) if c.choices]
    assert "".join(deltas) == text
    # no delta holds half a character: U+FFFD only where the output itself ends mid-character
    assert all("\ufffd" not in d for d in deltas[:-1])
    assert "".join(deltas).rstrip("\ufffd") == text.rstrip("\ufffd")
    assert any(ord(ch) > 0x2000 for ch in text)


def _good(client, model) -> None:
    r = client.completions.create(model=model, prompt="Hi", max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1


BAD = [
    ("malformed json", "/v1/chat/completions", b'{"messages": [', 400),
    ("wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400),
    ("unknown model", "/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400),
    ("prompt+max_tokens beyond context", "/v1/completions", {"prompt": [1] * (MAX_TOTAL_TOKENS - 96), "max_tokens": 100}, 400),
    ("token id = vocab", "/v1/completions", {"prompt": [1, 49152]}, 400),
    ("negative token id", "/v1/completions", {"prompt": [-3]}, 400),
    ("boolean token id", "/v1/completions", {"prompt": [False, 5]}, 400),
    ("float token id", "/v1/completions", {"prompt": [5, 6.5]}, 400),
    ("generate id outside vocab", "/generate", {"input_ids": [[1], [50000]]}, 400),
    ("stop_token_ids outside vocab", "/v1/completions", {"prompt": "x", "stop_token_ids": [49152]}, 400),
    ("n < 1", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400),
    ("temperature < 0", "/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("top_p = 0", "/v1/completions", {"prompt": "x", "top_p": 0.0}, 400),
    ("top_p > 1", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 1.01}, 400),
    ("body too large", "/v1/completions", {"prompt": "y" * (MAX_BODY + 1)}, 413),
]


@pytest.mark.parametrize("desc,path,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_then_good_request(http, client, model, desc, path, body, status):
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    if isinstance(body, dict) and path.startswith("/v1/") and "model" not in body:
        body["model"] = model
    r = http.post(path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and "param" in err and "code" in err
    _good(client, model)


def test_api_key(server, client, model):
    assert httpx.post(f"{server}/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 401
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model, prompt="x", max_tokens=1)
    _good(client, model)


def _stats(http) -> dict:
    return http.get("/get_server_info").json()["stats"]


def test_disconnect_frees_kv_within_a_few_decode_steps(http, model):
    # Counted in decode steps, not seconds: on a loaded 2-core machine one step can take over a
    # second, and what matters is that the request stops at once instead of running its 300 tokens.
    with http.stream("POST", "/v1/completions", json={"model": model, "prompt": "Count to one hundred: 1, 2,",
                                                      "max_tokens": 300, "temperature": 0, "stream": True}) as s:
        lines = s.iter_lines()  # keep a reference: dropping the iterator would close the connection
        got = 0
        for line in lines:
            if line.startswith("data:"):
                got += 1
                if got == 2:
                    break
        during = _stats(http)
        assert during["num_running_reqs"] == 1 and during["kv_used_tokens"] > 0
    t0 = time.monotonic()  # the response is closed here: the client went away mid-stream
    while True:
        st = _stats(http)
        if st["num_running_reqs"] == 0 and st["kv_used_tokens"] == 0:
            break
        assert time.monotonic() - t0 < 60.0, f"KV not freed: {st}"
        time.sleep(0.05)
    more = st["generation_tokens_total"] - during["generation_tokens_total"]
    assert more <= 16, f"{more} tokens decoded after the client left (of 300 asked)"
    metrics = http.get("/metrics").text
    assert "fleetserve:num_running_reqs" in metrics


def test_cached_tokens_equal_shared_prefix(client, http, model):
    assert http.post("/flush_cache").json()["success"] is True
    shared = list(range(1000, 1400))  # 400 ordinary token ids
    r1 = client.completions.create(model=model, prompt=shared + [2000, 2001], max_tokens=1, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    r2 = client.completions.create(model=model, prompt=shared + [3000, 3001], max_tokens=1, temperature=0)
    assert r2.usage.prompt_tokens == 402
    assert r2.usage.prompt_tokens_details.cached_tokens == len(shared)
    prom = http.get("/metrics").text
    line = next(ln for ln in prom.splitlines() if ln.startswith("fleetserve:cache_hit_rate"))
    assert float(line.rsplit(" ", 1)[1]) > 0


def test_generate_native(http):
    r = http.post("/generate", json={"text": "The capital of France is",
                                     "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    meta = r["meta_info"]
    assert meta["completion_tokens"] == 3 and meta["prompt_tokens"] > 0
    assert meta["finish_reason"] == {"type": "length", "length": 3} and "cached_tokens" in meta
    batch = http.post("/generate", json={"text": ["Hello", "The capital of France is"],
                                         "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    assert len(batch) == 2 and batch[1]["text"] == r["text"]
    with http.stream("POST", "/generate", json={"input_ids": [[504, 3575]], "stream": True,
                                                "sampling_params": {"max_new_tokens": 2, "temperature": 0}}) as s:
        events = [ln[5:].strip() for ln in s.iter_lines() if ln.startswith("data:")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["meta_info"]["completion_tokens"] == 2
    assert http.post("/abort_request", json={"rid": "nothing-running"}).json()["success"] is False


def test_chat_roles_parts_null_max_tokens_and_seed(client, http, model):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                         {"type": "text", "text": "of France?"}]}]
    # null max_tokens / max_completion_tokens mean "unset": generation ends at EOS, not at a default cap
    r = http.post("/v1/chat/completions", json={"model": model, "messages": msgs, "temperature": 0,
                                                "max_tokens": None, "max_completion_tokens": None}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and "Paris" in r["choices"][0]["message"]["content"]
    tool_chat = msgs[:1] + [{"role": "user", "content": "weather?"},
                            {"role": "assistant", "content": "calling the tool"},
                            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    r = client.chat.completions.create(model=model, messages=tool_chat, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
    kw = dict(model=model, prompt="My favourite animal is", max_tokens=5, temperature=1.0, top_p=0.9,
              extra_body={"top_k": 50, "min_p": 0.05, "ignore_eos": True})
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    assert a.usage.completion_tokens == b.usage.completion_tokens == 5
    assert a.choices[0].text == b.choices[0].text  # same seed, same sample


def test_penalties_over_http_change_a_repetitive_continuation(client, http, model):
    # A prompt SmolLM2 continues by repeating itself: strong penalties must change the
    # greedy text, and the server must keep serving (penalties once crashed the scheduler).
    prompt = "one two one two one two one two one two"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    pen = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                    frequency_penalty=2.0, presence_penalty=2.0,
                                    extra_body={"repetition_penalty": 1.5})
    assert pen.choices[0].finish_reason in ("length", "stop")
    assert pen.choices[0].text != plain.choices[0].text
    again = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert again.choices[0].text == plain.choices[0].text
