"""Request migration on our real engine: kill the serving ``fleetserve serve`` mid-stream.

Three instances of the default model behind the router (round robin, greedy).  For a chat
stream and a ``/generate`` stream on ``input_ids``, the instance serving it is killed (SIGKILL,
its whole process group) after a few events; the router continues on another instance, and the
client's text must equal an uninterrupted run's.
"""

import asyncio
import json
import os
import signal

import aiohttp
import pytest

T = aiohttp.ClientTimeout(total=180)
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


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_killing_the_serving_instance_keeps_the_greedy_text(procs):
    engines = [procs.spawn_engine("--max-total-tokens", "4096") for _ in range(3)]
    for url, p in engines:
        procs.wait_engine(url, p, timeout=400)
    by_url = dict(engines)
    router, _ = procs.router([u for u, _ in engines], "--policy", "round_robin", "--max-migrations", "1",
                             "--health-check-interval-secs", "3600")
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a long story about a cat."}],
                                  "max_tokens": 40, "temperature": 0, "ignore_eos": True}),
        ("/generate", {"input_ids": list(range(300, 330)),
                       "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}),
    ]
    async with aiohttp.ClientSession(timeout=T) as s:
        for path, body in cases:
            alive = [u for u, p in engines if p.poll() is None]
            async with s.post(alive[0] + path, json=body) as r:  # the uninterrupted run
                assert r.status == 200, await r.text()
                ref = await r.json()
            want = ref["text"] if path == "/generate" else ref["choices"][0]["message"]["content"]
            text, n, killed, done, ids = "", 0, None, 0, set()
            async with s.post(router + path, json={**body, "stream": True}) as r:
                assert r.status == 200
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        done += 1
                        continue
                    obj = json.loads(data)
                    assert "error" not in obj, obj
                    ids.add(obj["meta_info"]["id"] if path == "/generate" else obj["id"])
                    new = _text(path, obj, text)
                    n += new != text
                    text = new
                    if n == KILL_AFTER and killed is None:
                        killed = await _serving(s, router)
                        os.killpg(by_url[killed].pid, signal.SIGKILL)
                        by_url[killed].wait(timeout=30)
            assert killed is not None and done == 1 and len(ids) == 1
            assert text == want, (path, text, want)
        async with s.get(router + "/metrics") as r:
            assert "fleetserve_router_migrations_total 2.0" in await r.text()
    await asyncio.sleep(0)
