"""HTTP layer over the real ZMQ protocol, with a scripted scheduler thread (no model).

Covers request parsing, every bad-input answer, SSE shapes, stop-string hold-back,
n > 1 fan-out, echo/logprobs assembly and abort on disconnect quickly; the
integration tests repeat the important cases on the real engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import tempfile
import threading
import time

import httpx
import openai
import pytest
import uvicorn

sys.path.insert(0, os.path.dirname(__file__))
from scripted_scheduler import SCRIPT, ByteTokenizer, ScriptedScheduler  # noqa: E402

from fleetserve.entrypoints.http import create_app  # noqa: E402
from fleetserve.entrypoints.tokenizer_manager import ModelInfo, TokenizerManager  # noqa: E402

MODEL = "toy"
API_KEY = "sekret"
CTX = 200
MAX_BODY = 20_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, delay: float, is_alive=None):
        self.is_alive = is_alive
        self.dir = tempfile.mkdtemp(prefix="fs-api-")
        self.in_ep = f"ipc://{self.dir}/in"
        self.out_ep = f"ipc://{self.dir}/out"
        self.port = free_port()
        self.ready = threading.Event()
        self.delay = delay
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        assert self.ready.wait(20), "server did not start"
        self.sched = ScriptedScheduler(self.in_ep, self.out_ep, delay=delay)

    async def _main(self):
        info = ModelInfo(model_path="/models/toy", served_model_name=MODEL, vocab_size=257, context_length=CTX,
                         eos_token_ids=[256])
        self.tm = TokenizerManager(ByteTokenizer(), info, self.in_ep, self.out_ep)
        app = create_app(self.tm, server_args={"model_path": "/models/toy", "api_key": API_KEY}, api_key=API_KEY,
                         max_request_bytes=MAX_BODY, is_alive=self.is_alive)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.02)
        self.ready.set()
        await task
        await self.tm.close()

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sched.close()


@pytest.fixture(scope="module")
def srv():
    s = Server(delay=0.01)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key=API_KEY, timeout=20, max_retries=0)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=20,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def script_text(n: int) -> str:
    return SCRIPT[:n].decode("utf-8", errors="replace")


def good_request_works(client) -> None:
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=5, temperature=0)
    assert r.choices[0].text == "Hello"


BAD = [
    # (description, path, raw body or json, status, param)
    ("malformed json", "/v1/completions", b'{"prompt": "x", ', 400, None),
    # once killed the scheduler (int64 overflow in the sampler / torch.Generator.manual_seed)
    ("top_k past int64", "/v1/completions", {"prompt": "x", "top_k": 10**20}, 400, "top_k"),
    ("seed past 64 bits", "/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("generate seed past 64 bits", "/generate", {"text": "x", "sampling_params": {"seed": 2**64}}, 400,
     "sampling_params.seed"),
    ("NaN temperature", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("infinite repetition_penalty", "/v1/completions", b'{"prompt": "x", "repetition_penalty": Infinity}', 400,
     "repetition_penalty"),
    ("JSON nested past the parser's depth", "/v1/completions", b"[" * 9_000 + b"]" * 9_000, 400, None),
    ("body not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("wrong type for temperature", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("wrong type for n", "/v1/completions", {"prompt": "x", "n": 2.0}, 400, "n"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("prompt beyond context", "/v1/completions", {"prompt": "x" * (CTX + 5), "max_tokens": 1}, 400, "prompt"),
    ("prompt+max_tokens beyond context", "/v1/completions", {"prompt": "x" * 150, "max_tokens": 100}, 400, "max_tokens"),
    ("chat max_completion_tokens beyond", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": CTX}, 400, "max_completion_tokens"),
    ("token id too large", "/v1/completions", {"prompt": [1, 257]}, 400, "prompt"),
    ("negative token id", "/v1/completions", {"prompt": [[5], [-1]]}, 400, "prompt"),
    ("boolean token id", "/v1/completions", {"prompt": [1, True]}, 400, "prompt"),
    ("float token id", "/v1/completions", {"prompt": [1.0, 2]}, 400, "prompt"),
    ("stop_token_ids outside vocab", "/v1/completions", {"prompt": "x", "stop_token_ids": [999]}, 400, "stop_token_ids"),
    ("n < 1", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("n above the cap", "/v1/completions", {"prompt": "x", "n": 129}, 400, "n"),
    ("chat n above the cap", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 5000},
     400, "n"),
    ("generate n above the cap", "/generate", {"text": "x", "sampling_params": {"n": 129}}, 400, "sampling_params.n"),
    ("temperature < 0", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "temperature": -0.5}, 400, "temperature"),
    ("top_p 0", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p > 1", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("suffix unsupported", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content.0.type"),
    ("template rejects", "/v1/chat/completions", {"messages": [{"role": "user", "content": "<reject>"}]}, 400,
     "messages"),
    ("tool message without its call id", "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages.0.tool_call_id"),
    ("generate both text and ids", "/generate", {"text": "x", "input_ids": [1]}, 400, "text"),
    ("generate bad id", "/generate", {"input_ids": [1, 300]}, 400, "input_ids"),
    ("generate unknown sampling key", "/generate", {"text": "x", "sampling_params": {"temp": 1}},
     400, "sampling_params.temp"),
    ("generate max_new_tokens beyond", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 500}},
     400, "sampling_params.max_new_tokens"),
    ("logit_bias unsupported", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    # OpenAI and vLLM refuse an output length below 1 (SGLang's /generate allows max_new_tokens 0)
    ("completion max_tokens 0", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completion max_tokens -5 even with echo", "/v1/completions", {"prompt": "x", "max_tokens": -5, "echo": True},
     400, "max_tokens"),
    ("chat max_tokens 0", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     400, "max_tokens"),
    ("chat max_completion_tokens 0", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("abort without rid", "/abort_request", {}, 400, "rid"),
    # a wrong type deep in a union names the field itself, not the top-level list
    ("chat content a number", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     400, "messages.0.content"),
    ("chat content part text a number", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, 400, "messages.0.content.0.text"),
    ("chat second message content a dict", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": {}}]}, 400, "messages.1.content"),
    ("completion stop a number", "/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("unknown route", "/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("desc,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_json_error_then_server_keeps_serving(http, client, desc, path, body, status, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    assert err["param"] == param
    good_request_works(client)


def test_body_over_limit_is_413(http, client):
    r = http.post("/v1/completions", json={"prompt": "x" * (MAX_BODY + 10)})
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "invalid_request_error"
    good_request_works(client)


def test_a_chat_post_without_content_type_is_read_as_json(http):
    """As FastAPI does for vLLM's typed body (no Content-Type: parsed as JSON) and SGLang's
    ``await raw_request.json()`` (the header is not read): the body is taken as JSON."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    r = http.post("/v1/chat/completions", content=body)
    assert "content-type" not in r.request.headers
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion" and r.json()["choices"][0]["message"]["role"] == "assistant"
    r = http.post("/v1/chat/completions", content=b"{not json")  # still a JSON body: a bad one is a 400
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_api_key_required(srv, client):
    base = f"http://127.0.0.1:{srv.port}"
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 401
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    good_request_works(client)


def test_models_and_info(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    info = http.get("/get_model_info").json()
    assert info["context_length"] == CTX and info["vocab_size"] == 257
    si = http.get("/get_server_info").json()
    assert "api_key" not in si and si["stats"]["kv_pool_size"] == 1000
    import importlib.metadata
    version = importlib.metadata.version("fleetserve")
    assert si["version"] == version  # SGLang's field
    r = httpx.get(str(http.base_url.join("/version")), timeout=10)  # vLLM's route, open without the key
    assert (r.status_code, r.json()) == (200, {"version": version})


def test_completion_text_usage_and_multibyte(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=11)
    # 11 byte-tokens end in the middle of the emoji: the partial bytes come out as U+FFFD only at the end
    assert r.choices[0].text == script_text(11)
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 11
    assert r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=16)
    assert r.choices[0].text == "Hello 你好😀"


@pytest.mark.parametrize("stop", [["STOP"], ["好😀 w"], "world", ["zzz", "d S"]])
def test_stop_strings_stream_equals_non_stream(client, stop):
    full = SCRIPT.decode()
    first = min(full.find(s) for s in ([stop] if isinstance(stop, str) else stop) if s in full)
    expected = full[:first]
    r = client.completions.create(model=MODEL, prompt="p", max_tokens=40, stop=stop)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="p", max_tokens=40, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all("\ufffd" not in c.choices[0].text for c in chunks if c.choices)


def test_chat_streaming_matches_and_includes_usage(client):
    msgs = [{"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20)
    text = whole.choices[0].message.content
    assert text == script_text(20)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}))
    body = [c for c in chunks if c.choices]
    assert all(c.choices[0].index == 0 for c in body)
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == text
    assert body[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # the template saw "system: be brief\nuser: hi\nassistant: " (developer maps to system)
    assert whole.usage.prompt_tokens == len("system: be brief\nuser: hi\nassistant: ")


def test_chat_stream_sends_its_first_chunk_with_the_first_token(srv, http):
    """As vLLM and SGLang: no chunk (not even the role) before the engine's first token, so a router
    can take a stream's first bytes as the end of its prefill (kv_aware's queued-prefill term)."""
    got: list[tuple[float, str]] = []

    def read():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line:
                    got.append((time.monotonic(), line))

    srv.sched.run_steps.clear()
    t = threading.Thread(target=read, daemon=True)
    try:
        t.start()
        time.sleep(0.5)
        assert got == []  # the engine is still "prefilling"
        released = time.monotonic()
    finally:
        srv.sched.run_steps.set()
    t.join(20)
    first = json.loads(got[0][1][len("data: "):])
    assert got[0][0] >= released and first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert got[-1][1] == "data: [DONE]"
    # later deltas carry only what they hold (OpenAI's and vLLM's stream): no "role": null
    later = [json.loads(line[len("data: "):])["choices"][0] for _, line in got[1:-1]]
    assert [set(c["delta"]) for c in later] == [{"content"}] * (len(later) - 1) + [set()]
    assert later[-1]["finish_reason"] == "length" and all(c["delta"]["content"] for c in later[:-1])


def test_continuous_usage_stats_every_chunk_carries_usage_so_far(client):
    """vLLM's ``continuous_usage_stats`` (issue 15): with ``include_usage``, each chunk has the usage so far."""
    msgs = [{"role": "user", "content": "hi"}]
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, stream=True,
                                                 stream_options=opts))
    prompt = len("user: hi\nassistant: ")
    body = [c for c in chunks if c.choices]
    assert all(c.usage is not None and c.usage.prompt_tokens == prompt for c in body)
    assert body[0].usage.completion_tokens == 0  # the role chunk, before any token
    seen = [c.usage.completion_tokens for c in body]
    assert seen == sorted(seen) and seen[-1] == 16
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in body)
    # the text so far has exactly as many bytes as the tokens counted so far (one byte per token)
    text = ""
    for c in body:
        text += c.choices[0].delta.content or ""
        if "\ufffd" not in text and c.choices[0].finish_reason is None:
            assert len(text.encode()) <= c.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    comp = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=5, stream=True, stream_options=opts))
    assert [c.usage.completion_tokens for c in comp if c.choices] == [1, 2, 3, 4, 5]
    assert all(c.usage.prompt_tokens == 3 for c in comp)
    # without include_usage it has no effect (vLLM: both are needed)
    plain = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=3, stream=True,
                                           stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)


def test_n3_every_chunk_has_its_index(client):
    r = client.completions.create(model=MODEL, prompt="q", max_tokens=5, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.text == "Hello" for c in r.choices)
    assert r.usage.completion_tokens == 15
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}],
                                                 max_tokens=5, n=3, stream=True))
    per = {0: "", 1: "", 2: ""}
    for c in chunks:
        for ch in c.choices:
            per[ch.index] += ch.delta.content or ""
    assert per == {0: "Hello", 1: "Hello", 2: "Hello"}


def test_max_tokens_zero_is_a_400_with_vllms_message_but_generate_allows_it(http, client):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "max_tokens must be at least 1, got 0.", "type": "invalid_request_error",
                                 "param": "max_tokens", "code": None}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}],
                                       max_completion_tokens=0)
    r = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 0  # SGLang's /generate: allowed
    good_request_works(client)


def test_echo_with_max_tokens_zero_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="héllo", max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == "héllo"
    assert c.logprobs.token_logprobs[0] is None
    assert len(c.logprobs.tokens) == len("héllo".encode())
    assert r.usage.completion_tokens == 0


def test_logprobs_chat_and_completion(client):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["H", "e", "l"] and lp.token_logprobs == [-0.5] * 3 and lp.text_offset == [0, 1, 2]
    assert lp.top_logprobs[0] == {"H": -0.5, "\x00": -1.5}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       logprobs=True, top_logprobs=1)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ["H", "e"] and content[0].bytes == [72]
    assert len(content[0].top_logprobs) == 1


def test_prompt_forms_batch(client):
    r = client.completions.create(model=MODEL, prompt=["a", "bb"], max_tokens=2, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 3
    r = client.completions.create(model=MODEL, prompt=[[104, 105], [106]], max_tokens=1)
    assert [c.text for c in r.choices] == ["H", "H"]


def test_cached_tokens_reported(client, http):
    assert http.post("/flush_cache").json()["success"] is True
    long = "shared prefix " * 8
    client.completions.create(model=MODEL, prompt=long + "one", max_tokens=1)
    r = client.completions.create(model=MODEL, prompt=long + "two", max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens == len(long.encode())


def test_generate_native(http):
    r = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).json()
    assert r["text"] == "Hello"
    assert r["meta_info"]["completion_tokens"] == 5 and r["meta_info"]["prompt_tokens"] == 1
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    rs = http.post("/generate", json={"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2}}).json()
    assert [x["text"] for x in rs] == ["He", "He"] and [x["meta_info"]["prompt_tokens"] for x in rs] == [2, 1]
    r = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 30, "stop": "STOP"}}).json()
    assert r["text"] == "Hello 你好😀 world " and r["meta_info"]["finish_reason"]["matched"] == "STOP"
    with http.stream("POST", "/generate", json={"text": "x", "stream": True,
                                                "sampling_params": {"max_new_tokens": 4}}) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    import json as _json
    assert _json.loads(lines[-2][5:])["text"] == "Hell"


def test_health_metrics(http):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    text = http.get("/metrics").text
    assert "fleetserve:num_running_reqs" in text and "fleetserve:time_to_first_token_seconds_bucket" in text


def test_disconnect_aborts_within_a_second(srv, http):
    """A slow stream (long script with a per-step delay): close after 2 chunks, the scheduler must see the abort."""
    srv.sched.delay = 0.2
    try:
        n_before = len(srv.sched.aborted)
        with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 30, "stream": True}) as s:
            it = s.iter_lines()
            got = 0
            for line in it:
                if line.startswith("data:"):
                    got += 1
                    if got == 2:
                        break
        t0 = time.monotonic()
        while len(srv.sched.aborted) == n_before and time.monotonic() - t0 < 1.0:
            time.sleep(0.02)
        assert len(srv.sched.aborted) == n_before + 1
        assert not srv.sched.running
        assert not srv.tm.streams
    finally:
        srv.sched.delay = 0.01


def test_dead_scheduler_ends_requests_instead_of_hanging():
    alive = [True]
    s = Server(delay=0.01, is_alive=lambda: alive[0])
    try:
        s.sched.delay = 5.0  # the "scheduler" stalls after its first step ...
        with httpx.stream("POST", f"http://127.0.0.1:{s.port}/v1/completions", timeout=20,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"prompt": "x", "max_tokens": 30, "stream": True}) as r:
            assert r.status_code == 200
            events = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
            first = json.loads(next(events))
            assert first["choices"][0]["text"] == "H"
            alive[0] = False  # ... and its process is reported dead
            t0 = time.monotonic()
            rest = list(events)
        assert time.monotonic() - t0 < 4.0
        assert "[DONE]" not in rest  # a cut-short answer is not presented as a normal end
        assert json.loads(rest[-1]) == {"error": {
            "message": "the scheduler process exited while generating this request",
            "type": "service_unavailable", "param": None, "code": "engine_unavailable"}}
        assert all("abort" not in e for e in rest)
        r = httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=5)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        r = httpx.post(f"http://127.0.0.1:{s.port}/v1/completions", json={"prompt": "x"},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=5)
        assert r.status_code == 503 and "scheduler" in r.json()["error"]["message"]
    finally:
        s.sched.delay = 0.0
        s.close()


def test_non_streaming_disconnect_aborts(srv):
    """A non-streaming client that gives up (read timeout) also aborts its request."""
    srv.sched.delay = 0.2
    try:
        n_before = len(srv.sched.aborted)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"http://127.0.0.1:{srv.port}/v1/completions", json={"prompt": "x", "max_tokens": 30},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=0.5)
        t0 = time.monotonic()
        while len(srv.sched.aborted) == n_before and time.monotonic() - t0 < 1.0:
            time.sleep(0.02)
        assert len(srv.sched.aborted) == n_before + 1
        assert not srv.tm.streams
    finally:
        srv.sched.delay = 0.01


def test_no_scheduler_connected_is_503_not_a_hang():
    """A server whose scheduler never connected answers 503 at once and keeps no request state."""
    d = tempfile.mkdtemp(prefix="fs-api-")
    port = free_port()
    ready = threading.Event()
    box = {}

    async def main():
        info = ModelInfo(model_path="/m", served_model_name=MODEL, vocab_size=257, context_length=CTX)
        box["tm"] = tm = TokenizerManager(ByteTokenizer(), info, f"ipc://{d}/in", f"ipc://{d}/out")
        box["server"] = server = uvicorn.Server(uvicorn.Config(create_app(tm), host="127.0.0.1", port=port,
                                                               log_level="warning"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.02)
        ready.set()
        await task
        await tm.close()

    t = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    t.start()
    try:
        assert ready.wait(20)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "n": 2}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert box["tm"].streams == {}
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200
    finally:
        box["server"].should_exit = True
        t.join(10)


def test_abort_request_ends_its_streaming_and_waiting_clients_at_once():
    """Issue 15: ``/abort_request`` gives the aborted request's own clients a finished answer at once
    (SGLang: ``meta_info.finish_reason.type == "abort"``), streaming and not."""
    slow = Server(delay=0.3)  # the whole script would take > 10 s
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{slow.port}", timeout=20,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as h:
            body = {"text": "x", "rid": "ab-stream", "stream": True, "sampling_params": {"max_new_tokens": 100}}
            t0 = time.monotonic()
            with h.stream("POST", "/generate", json=body) as r:
                lines = r.iter_lines()
                first = next(x for x in lines if x.startswith("data: {"))
                assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
                assert h.post("/abort_request", json={"rid": "ab-stream"}).json() == {
                    "success": True, "aborted": ["ab-stream"]}
                events = [x for x in lines if x.startswith("data: ")]
            assert time.monotonic() - t0 < 5
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][6:])["meta_info"]["finish_reason"]["type"] == "abort"
            done: list = []
            waiter = threading.Thread(target=lambda: done.append(h.post("/generate", json={
                "text": "x", "rid": "ab-wait", "sampling_params": {"max_new_tokens": 100}})))
            waiter.start()
            deadline = time.monotonic() + 5
            while "ab-wait" not in slow.tm.streams and time.monotonic() < deadline:
                time.sleep(0.02)
            assert h.post("/abort_request", json={"rid": "ab-wait"}).json()["aborted"] == ["ab-wait"]
            waiter.join(5)
            assert done and done[0].json()["meta_info"]["finish_reason"]["type"] == "abort"
            assert not slow.tm.streams
    finally:
        slow.close()
