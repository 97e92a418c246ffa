"""The router in front of real ``fleetserve serve`` instances (SmolLM2-135M, CPU), and request
migration on them: kill the serving instance mid-stream.

Two instances A and B of the default model (``--page-size 16``): B is the router tests' shared
engine, A this module's own.  First, a
``cache_aware`` router in front of B alone answers as B does, streams, and passes B's 4xx through.
Then A and B behind a round-robin router (greedy): a chat
stream and a ``/generate`` stream on ``input_ids`` both go to A (round robin: stream, a one-token
request that goes to B, stream); once each has streamed a few events with text, A is killed
(SIGKILL, its whole process group); the router continues both on B, and each client's text must
equal an uninterrupted run's.
"""

import asyncio
import contextlib
import json
import os
import signal

import aiohttp
import pytest

T = aiohttp.ClientTimeout(total=300)  # a stream also waits while the other one starts
ENGINE_T = aiohttp.ClientTimeout(total=120)
KILL_AFTER = 4  # events with text


def _text(path: str, obj: dict, so_far: str) -> str:
    if path == "/generate":
        return obj["text"]
    return so_far + (obj["choices"][0]["delta"].get("content") or "" if obj["choices"] else "")


async def _serving(s: aiohttp.ClientSession, router: str) -> str:
    async with s.get(router + "/list_workers") as r:
        workers = (await r.json())["workers"]
    busy = [w["url"] for w in workers if w["load"] > 0]
    assert len(busy) == 1, workers
    return busy[0]


class _Stream:
    """One client's streamed answer: its text, events with text, ``[DONE]`` count and ids."""

    def __init__(self, path: str) -> None:
        self.path, self.text, self.n, self.done, self.ids = path, "", 0, 0, set()
        self.started, self.reached = asyncio.Event(), asyncio.Event()

    async def read(self, r: aiohttp.ClientResponse) -> None:
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                self.done += 1
                continue
            obj = json.loads(data)
            assert "error" not in obj, obj
            self.ids.add(obj["meta_info"]["id"] if self.path == "/generate" else obj["id"])
            new = _text(self.path, obj, self.text)
            self.n += new != self.text
            self.text = new
            self.started.set()
            if self.n >= KILL_AFTER:
                self.reached.set()


@pytest.fixture(scope="module")
def engines(module_procs, request):
    """``[(url, process)]`` of A and B, both healthy. B is the router tests' shared
    ``smollm2_p16_engine`` (never killed here); A, the one killed, is this module's own, with
    B's flags but KV events (``--max-total-tokens 4096 --page-size 16``), started while B loads."""
    a = module_procs.spawn_engine("--max-total-tokens", "4096", "--page-size", "16")
    b = request.getfixturevalue("smollm2_p16_engine")
    module_procs.wait_engine(*a, timeout=400)
    return [a, b]


@pytest.mark.slow
@pytest.mark.timeout(600)  # the engines' start-up counts here when this test runs first
async def test_router_in_front_of_fleetserve_serve(procs, engines):
    engine_url = engines[1][0]  # B: the migration test below kills A
    router, _ = procs.router([engine_url], "--policy", "cache_aware")
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, "temperature": 0}
    async with aiohttp.ClientSession(timeout=ENGINE_T) as s:
        async with s.post(engine_url + "/v1/chat/completions", json=chat) as r:
            assert r.status == 200
            direct = await r.json()
        async with s.post(router + "/v1/chat/completions", json=chat) as r:
            assert r.status == 200
            routed = await r.json()
        assert routed["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
        assert routed["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"] > 0
        async with s.post(router + "/v1/chat/completions", json={**chat, "stream": True}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            events = [line for line in (await r.read()).split(b"\n") if line.startswith(b"data:")]
        assert events[-1].strip() == b"data: [DONE]" and len(events) >= 3
        async with s.get(router + "/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == direct["model"]
        async with s.post(router + "/v1/chat/completions", json={"messages": "not a list"}) as r:
            assert 400 <= r.status < 500  # the engine's 4xx passes through
        async with s.get(router + "/list_workers") as r:
            assert (await r.json())["workers"][0]["load"] == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_killing_the_serving_instance_keeps_the_greedy_text(procs, engines):
    (a_url, a_proc), (b_url, _) = engines
    router, _ = procs.router([a_url, b_url], "--policy", "round_robin", "--max-migrations", "1",
                             "--health-check-interval-secs", "3600")
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a long story about a cat."}],
                                  "max_tokens": 40, "temperature": 0, "ignore_eos": True}),
        ("/generate", {"input_ids": list(range(300, 330)),
                       "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}),
    ]
    async with aiohttp.ClientSession(timeout=T) as s:
        wants = []
        for path, body in cases:
            async with s.post(a_url + path, json=body) as r:  # the uninterrupted run
                assert r.status == 200, await r.text()
                ref = await r.json()
            wants.append(ref["text"] if path == "/generate" else ref["choices"][0]["message"]["content"])
        streams = [_Stream(path) for path, _ in cases]
        async with contextlib.AsyncExitStack() as stack:
            tasks = []
            for i, ((path, body), st) in enumerate(zip(cases, streams)):
                if i:  # round robin's turn is B now: one short request takes it, so the next stream is A's
                    async with s.post(router + "/generate", json={"input_ids": [1, 2, 3],
                                                                  "sampling_params": {"max_new_tokens": 1}}) as r:
                        assert r.status == 200, await r.text()
                r = await stack.enter_async_context(s.post(router + path, json={**body, "stream": True}))
                assert r.status == 200
                tasks.append(asyncio.create_task(st.read(r)))
                await asyncio.wait_for(st.started.wait(), 120)
            await asyncio.wait_for(asyncio.gather(*(st.reached.wait() for st in streams)), 120)
            killed = await _serving(s, router)  # both streams on one instance: A
            assert killed == a_url
            os.killpg(a_proc.pid, signal.SIGKILL)
            a_proc.wait(timeout=30)
            await asyncio.gather(*tasks)
        for st, want in zip(streams, wants):
            assert st.done == 1 and len(st.ids) == 1
            assert st.text == want, (st.path, st.text, want)
        async with s.get(router + "/metrics") as r:
            assert "fleetserve_router_migrations_total 2.0" in await r.text()
    await asyncio.sleep(0)
