"""The sim-worker's HTTP API: OpenAI shapes, cached_tokens, errors, flush, timing."""

import json
import logging
import asyncio
import socket

import aiohttp
import pytest

from fleetserve.bench import sim_worker

def two_free_ports() -> int:
    """A port p with p and p + 1 both free (the sim-worker hosts its workers on consecutive ports);
    a fixed port collided with other test runs on a shared machine."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            if p >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
            return p
    raise RuntimeError("no two consecutive free ports")


PORT = two_free_ports()


@pytest.fixture
async def workers():
    args = sim_worker.build_parser().parse_args([
        "--port", str(PORT), "--num-workers", "2", "--stream-interval", "3",
        "--prefill-per-token-s", "0.001", "--prefill-overhead-s", "0", "--decode-base-s", "0.01",
        "--decode-per-req-s", "0", "--decode-per-ctx-token-s", "0"])
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(sim_worker.serve(args, ready, stop))
    await asyncio.wait_for(ready.wait(), 10)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        yield s
    stop.set()
    await asyncio.wait_for(task, 10)


PROMPT = " ".join(["time year people way day"] * 40)  # 200 words = 200 tokens


@pytest.mark.timeout(60)
async def test_openai_and_cache(workers):
    s = workers
    base = f"http://127.0.0.1:{PORT}"
    async with s.get(base + "/health") as r:
        assert r.status == 200 and r.headers["X-Fleetserve-Worker"] == f"127.0.0.1:{PORT}"
    async with s.get(base + "/v1/models") as r:
        assert (await r.json())["data"][0]["id"] == "sim-llama-8b"
    t0 = asyncio.get_running_loop().time()
    async with s.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 10}) as r:
        first = await r.json()
    t1 = asyncio.get_running_loop().time()
    assert first["usage"] == {"prompt_tokens": 200, "completion_tokens": 10, "total_tokens": 210,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert len(first["choices"][0]["text"].split()) == 10
    # modelled time: prefill 200 x 1 ms + 9 decode steps x 10 ms = 0.29 s
    assert 0.28 <= t1 - t0 < 0.6
    async with s.post(base + "/v1/completions", json={"prompt": PROMPT + " lake", "max_tokens": 10}) as r:
        second = await r.json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 200
    assert second["worker_id"] == f"127.0.0.1:{PORT}"
    # the other worker has its own cache
    async with s.post(f"http://127.0.0.1:{PORT + 1}/v1/completions",
                      json={"prompt": PROMPT + " lake", "max_tokens": 2}) as r:
        assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # streaming chat: chunks of stream_interval tokens, usage at the end
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 7, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = []
    async with s.post(base + "/v1/chat/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                import json
                chunks.append(json.loads(line[6:]))
    texts = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert [len(t.split()) for t in texts] == [1, 3, 3]
    assert chunks[-1]["usage"]["completion_tokens"] == 7
    # native /generate with input_ids
    async with s.post(base + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}) as r:
        g = await r.json()
    assert g["meta_info"]["prompt_tokens"] == 3 and len(g["output_ids"]) == 4
    async with s.get(base + "/metrics") as r:
        text = await r.text()
    assert "fleetserve:cached_tokens_total" in text and "} 200" in text


@pytest.mark.timeout(60)
async def test_errors_and_flush(workers):
    s = workers
    base = f"http://127.0.0.1:{PORT}"
    for path, body in (("/v1/completions", b"{nope"), ("/v1/completions", b'{"prompt": 5}'),
                       ("/v1/chat/completions", b'{"messages": []}'),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}'),
                       ("/v1/chat/completions", b'{"messages": [{"role": 7, "content": "hi"}]}'),
                       ("/v1/completions", b'{"prompt": "a", "max_tokens": -1}'),
                       ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": true}}'),
                       ("/v1/completions", b'{"prompt": "a", "max_tokens": 10000000}')):
        async with s.post(base + path, data=body) as r:
            assert r.status == 400, (path, body)
            err = (await r.json())["error"]
            assert err["type"] == "invalid_request_error" and err["message"]
    # a model other than --model-name: the engine's 404 (vLLM answers 404 too), the served name is fine
    for path, body in (("/v1/completions", {"prompt": "a", "model": "other"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "model": "other"})):
        async with s.post(base + path, json=body) as r:
            assert r.status == 404, path
            assert await r.json() == {"error": {
                "message": "the model 'other' does not exist; this server serves 'sim-llama-8b'",
                "type": "not_found_error", "param": "model", "code": "model_not_found"}}
    async with s.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                          "model": "sim-llama-8b", "max_tokens": 1}) as r:
        assert r.status == 200
    async with s.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}) as r:
        assert r.status == 200
    async with s.post(base + "/flush_cache") as r:
        assert r.status == 200
    async with s.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}) as r:
        assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    async with s.get(base + "/get_server_info") as r:
        info = await r.json()
    assert info["stats"]["num_requests"] == 3 and info["timing_model"]["decode_base_s"] == 0.01


def _engine_error(path: str, body: dict, prompt_len: int) -> dict:
    """The error body the engine's own validation gives ``body`` (entrypoints/validation.py)."""
    from fleetserve.entrypoints.errors import APIError
    from fleetserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
    from fleetserve.entrypoints.request_parse import parse_model
    from fleetserve.entrypoints.validation import chat_sampling, completion_sampling, native_sampling

    try:
        if path == "/v1/chat/completions" and body["messages"][0]["role"] == "wizard":
            parse_model(ChatCompletionRequest, body)
        if path == "/generate":
            native_sampling(body["sampling_params"], prompt_len=prompt_len, vocab_size=1 << 31, context_length=None)
        elif path == "/v1/completions":
            completion_sampling(parse_model(CompletionRequest, body), prompt_len=prompt_len, vocab_size=1 << 31,
                                context_length=None)
        else:
            chat_sampling(parse_model(ChatCompletionRequest, body), prompt_len=prompt_len, vocab_size=1 << 31,
                          context_length=None)
    except APIError as e:
        return e.to_dict()
    raise AssertionError(f"the engine accepts {body}")


USER = [{"role": "user", "content": "hi"}]
BAD_SAMPLING = [
    ("/v1/completions", {"prompt": "a b", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "a b", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": "a b", "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"prompt": "a b", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "a b", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "a b", "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "top_k": -7}, "top_k"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "presence_penalty": 9}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/generate", {"text": "a b", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ("/generate", {"text": "a b", "sampling_params": {"max_new_tokens": -5}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "a b", "sampling_params": {"temp": 1}}, "sampling_params.temp"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,body,param", BAD_SAMPLING, ids=[f"{p} {b}" for p, b, _ in BAD_SAMPLING])
async def test_bad_sampling_values_get_the_engines_400(workers, path, body, param):
    s = workers
    base = f"http://127.0.0.1:{PORT}"
    async with s.post(base + path, json=body) as r:
        assert r.status == 400
        got = await r.json()
    assert got["error"]["param"] == param
    prompt_len = 2 if path != "/v1/chat/completions" else len(sim_worker.make_tokenizer("word").encode_chat(USER))
    assert got == _engine_error(path, body, prompt_len)
    async with s.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}) as r:
        assert r.status == 200  # and the worker keeps serving


@pytest.mark.timeout(60)
async def test_generate_with_max_new_tokens_zero_answers_no_token(workers):
    s = workers
    base = f"http://127.0.0.1:{PORT}"
    async with s.post(base + "/generate", json={"text": "a b c", "sampling_params": {"max_new_tokens": 0}}) as r:
        assert r.status == 200  # SGLang (and the engine) allow it
        meta = (await r.json())["meta_info"]
    assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] == 3


@pytest.mark.timeout(60)
async def test_generate_with_both_text_and_input_ids_is_refused_as_the_engine_does(workers):
    s = workers
    base = f"http://127.0.0.1:{PORT}"
    async with s.post(base + "/generate", json={"text": "a b c", "input_ids": [1, 2]}) as r:
        assert r.status == 400  # entrypoints/validation.py: the same message and param
        err = (await r.json())["error"]
    assert err["message"] == "send exactly one of 'text' and 'input_ids'" and err["param"] == "text"
    async with s.post(base + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}) as r:
        assert r.status == 200 and (await r.json())["meta_info"]["prompt_tokens"] == 3


async def _sse(s, url: str, body: dict) -> list[dict]:
    import json

    async with s.post(url, json=body) as r:
        assert r.status == 200
        return [json.loads(line[6:]) async for line in r.content
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_stats_gives_each_chunk_the_tokens_so_far(workers, path):
    """vLLM's ``continuous_usage_stats`` (the router asks for it to count a stream's tokens exactly):
    with ``--stream-interval 3`` and 7 tokens the chunks carry 1, 4, 7 completion tokens; without the
    field no chunk with choices has a usage."""
    s = workers
    url = f"http://127.0.0.1:{PORT}{path}"
    body = ({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]})
    body = {**body, "max_tokens": 7, "stream": True}
    on = await _sse(s, url, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert [c["usage"]["completion_tokens"] for c in on if c["choices"]] == [1, 4, 7]
    assert on[-1]["choices"] == [] and on[-1]["usage"]["completion_tokens"] == 7
    assert {c["usage"]["prompt_tokens"] for c in on} == {on[-1]["usage"]["prompt_tokens"]}
    off = await _sse(s, url, {**body, "stream_options": {"include_usage": True}})
    assert [("usage" in c) for c in off] == [False] * (len(off) - 1) + [True]


@pytest.mark.timeout(60)
async def test_n_choices_one_prefill_n_decode_streams(workers):
    """OpenAI ``n``: n choices (index 0..n-1), streaming or not, completion tokens summed over them
    (vLLM's shapes), and in modelled time one prefill of the prompt plus n sequences decoding together."""
    s = workers
    base, other = f"http://127.0.0.1:{PORT}", f"http://127.0.0.1:{PORT + 1}"
    async with s.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "n": 3}) as r:
        out = await r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [len(c["text"].split()) for c in out["choices"]] == [4, 4, 4]
    assert len({c["text"] for c in out["choices"]}) == 3  # each sample its own output
    assert out["usage"] == {"prompt_tokens": 200, "completion_tokens": 12, "total_tokens": 212,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    async with s.get(base + "/get_server_info") as r:
        st = (await r.json())["stats"]
    # sample 0 prefills 200 tokens; samples 1, 2 wait one step, find 199 cached and prefill 1 each;
    # then the three decode their 3 remaining tokens in 3 shared steps
    assert (st["prompt_tokens"], st["cached_tokens"], st["generation_tokens"]) == (600, 398, 12)
    assert (st["num_prefill_steps"], st["num_decode_steps"]) == (2, 3)
    async with s.post(other + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}) as r:
        assert (await r.json())["choices"][0]["text"] == out["choices"][0]["text"]  # n=1 is choice 0

    chunks = await _sse(s, other + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "n": 3, "stream": True,
                                                        "stream_options": {"include_usage": True}})
    texts, reasons = ["", "", ""], [[], [], []]
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"]
        reasons[choice["index"]].append(choice["finish_reason"])
    assert texts == [c["text"] for c in out["choices"]]
    assert all(r[-1] == "length" and r.count("length") == 1 for r in reasons)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12

    msgs = [{"role": "user", "content": PROMPT}]
    async with s.post(base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 5, "n": 2}) as r:
        chat = await r.json()
    assert [(c["index"], len(c["message"]["content"].split())) for c in chat["choices"]] == [(0, 5), (1, 5)]
    assert chat["usage"]["completion_tokens"] == 10
    chunks = await _sse(s, base + "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "n": 2,
                                                           "stream": True, "stream_options": {"include_usage": True}})
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]  # every choice's role first, as vLLM
    got = ["", ""]
    for c in chunks[2:-1]:
        assert "role" not in c["choices"][0]["delta"]
        got[c["choices"][0]["index"]] += c["choices"][0]["delta"]["content"]
    assert got == [c["message"]["content"] for c in chat["choices"]]
    assert chunks[-1]["usage"] == {"prompt_tokens": chat["usage"]["prompt_tokens"], "completion_tokens": 10,
                                   "total_tokens": chat["usage"]["prompt_tokens"] + 10,
                                   "prompt_tokens_details": {"cached_tokens": chunks[-1]["usage"][
                                       "prompt_tokens_details"]["cached_tokens"]}}


@pytest.mark.timeout(60)
async def test_generate_n_answers_a_list_and_streams_indexed_results(workers):
    """SGLang's ``/generate`` with ``sampling_params.n``: a list of n results (sample order), each its own
    id and output; streamed, each event one sample's result so far with its ``index``; n=1 stays one dict."""
    s = workers
    base = f"http://127.0.0.1:{PORT}"
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "n": 3}}
    async with s.post(base + "/generate", json=body) as r:
        assert r.status == 200
        outs = await r.json()
    assert isinstance(outs, list) and len(outs) == 3
    assert [len(o["output_ids"]) for o in outs] == [4, 4, 4]
    assert len({o["text"] for o in outs}) == 3 and len({o["meta_info"]["id"] for o in outs}) == 3
    assert [o["meta_info"]["finish_reason"] for o in outs] == [{"type": "length", "length": 4}] * 3
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [200] * 3
    async with s.post(base + "/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 4}}) as r:
        one = await r.json()
    assert isinstance(one, dict) and one["text"] == outs[0]["text"]  # n=1 is sample 0
    events = await _sse(s, base + "/generate", {**body, "stream": True})
    last = {}
    for e in events:
        last[e["index"]] = e  # each event carries the sample's text so far
    assert sorted(last) == [0, 1, 2]
    assert [last[i]["text"] for i in range(3)] == [o["text"] for o in outs]
    assert all(last[i]["meta_info"]["finish_reason"] == {"type": "length", "length": 4} for i in range(3))
    assert sum(e["meta_info"]["finish_reason"] is not None for e in events) == 3
    async with s.post(base + "/generate", json={"text": "a b", "sampling_params": {"n": 0}}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "sampling_params.n"


CHAT = [
    # content null everywhere: the engine's "no content" 400 (this used to crash the sim with a 500)
    ({"messages": [{"role": "user", "content": None}]}, 400, "messages"),
    # content null beside a message with text, and text parts: the engine takes both
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]}, 200, None),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "yo"}]}]},
     200, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content.0.type"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, 400, "stream_options"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("body,status,param", CHAT, ids=[str(i) for i in range(len(CHAT))])
async def test_chat_messages_go_through_the_engines_checks(workers, body, status, param):
    async with workers.post(f"http://127.0.0.1:{PORT}/v1/chat/completions", json={**body, "max_tokens": 2}) as r:
        assert r.status == status, await r.text()
        doc = await r.json()
    if status == 400:
        assert doc["error"]["param"] == param
    else:
        assert doc["usage"]["completion_tokens"] == 2


@pytest.mark.timeout(60)
async def test_a_body_over_the_engines_limit_gets_413_and_the_worker_keeps_serving(workers):
    from fleetserve.entrypoints.http.state import DEFAULT_MAX_REQUEST_BYTES

    assert sim_worker.MAX_BODY_BYTES == DEFAULT_MAX_REQUEST_BYTES
    base = f"http://127.0.0.1:{PORT}"
    big = {"prompt": "word " * (DEFAULT_MAX_REQUEST_BYTES // 5 + 10), "max_tokens": 1}
    async with workers.post(base + "/v1/completions", json=big) as r:
        assert r.status == 413
        assert (await r.json())["error"]["code"] == "request_too_large"
    async with workers.post(base + "/v1/completions", json={"prompt": "a b", "max_tokens": 1}) as r:
        assert r.status == 200


@pytest.mark.timeout(60)
async def test_a_client_that_leaves_a_non_streamed_request_frees_the_engine(workers):
    base = f"http://127.0.0.1:{PORT}"
    with pytest.raises(asyncio.TimeoutError):  # 2000 decode steps of 10 ms: 20 s if nobody aborts it
        async with workers.post(base + "/v1/completions", json={"prompt": "a b", "max_tokens": 2000},
                                timeout=aiohttp.ClientTimeout(total=0.5)) as r:
            await r.read()
    for _ in range(100):
        async with workers.get(base + "/get_load") as r:
            load = await r.json()
        load = load[0] if isinstance(load, list) else load
        if load["num_reqs"] == 0:
            break
        await asyncio.sleep(0.05)
    assert load["num_reqs"] == 0


@pytest.mark.timeout(60)
async def test_unknown_paths_and_wrong_methods_get_json_errors(workers):
    base = f"http://127.0.0.1:{PORT}"
    async with workers.get(base + "/v1/chat/completions") as r:
        assert r.status == 405 and "POST" in r.headers["Allow"]
        assert (await r.json())["error"]["message"] == "GET is not allowed on /v1/chat/completions"
    async with workers.post(base + "/nowhere", json={}) as r:
        assert r.status == 404
        assert (await r.json())["error"] == {"message": "no route for /nowhere", "type": "not_found_error",
                                             "param": None, "code": None}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "a b", "max_tokens": 2000, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 2000, "stream": True}),
    ("/generate", {"text": "a b", "sampling_params": {"max_new_tokens": 2000}, "stream": True}),
])
async def test_a_client_that_leaves_a_stream_frees_the_engine_without_a_traceback(workers, caplog, path, body):
    """A user trial: a router aborting its connection mid-stream made the worker log a full traceback
    ('Error handling request ... Cannot write to closing transport') for each such stream."""
    base = f"http://127.0.0.1:{PORT}"
    reader, writer = await asyncio.open_connection("127.0.0.1", PORT)
    raw = json.dumps(body).encode()
    writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), len(raw), raw))
    assert b"data: " in await asyncio.wait_for(reader.readuntil(b"data: "), 10)  # the stream has begun
    writer.transport.abort()  # gone, as a router aborts its connection to a worker
    for _ in range(100):
        async with workers.get(base + "/get_load") as r:
            load = await r.json()
        load = load[0] if isinstance(load, list) else load
        if load["num_reqs"] == 0:
            break
        await asyncio.sleep(0.05)
    assert load["num_reqs"] == 0  # aborted in the engine, not decoded to the end
    await asyncio.sleep(0.2)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "a b", "max_tokens": 2000, "stream": True}),
    ("/generate", {"text": "a b", "sampling_params": {"max_new_tokens": 2000}, "stream": True}),
])
async def test_a_stream_write_that_finds_the_transport_closing_ends_the_stream_quietly(workers, caplog, monkeypatch,
                                                                                       path, body):
    """The window the user trial hit: the router aborted its connection, the worker saw the reset (its
    transport closing) and a stream write raised aiohttp's ClientConnectionResetError before the
    connection's loss was handled; the worker then logged 'Error handling request' with a traceback."""
    real_write = aiohttp.web.StreamResponse.write
    calls = {"n": 0}

    async def write(self, data):
        calls["n"] += 1
        if calls["n"] == 3:  # a few events in: the client has gone
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        return await real_write(self, data)

    monkeypatch.setattr(aiohttp.web.StreamResponse, "write", write)
    base = f"http://127.0.0.1:{PORT}"
    async with workers.post(base + path, json=body) as r:
        assert r.status == 200
        text = (await r.read()).decode()
    assert text.count("data: ") == 2 and "[DONE]" not in text  # cut where the write failed, no error event
    for _ in range(100):
        async with workers.get(base + "/get_load") as r:
            load = await r.json()
        load = load[0] if isinstance(load, list) else load
        if load["num_reqs"] == 0:
            break
        await asyncio.sleep(0.05)
    assert load["num_reqs"] == 0  # aborted in the engine
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
