"""The router in front of a real ``fleetserve serve`` instance (SmolLM2-135M, CPU)."""

import aiohttp
import pytest

T = aiohttp.ClientTimeout(total=120)


@pytest.mark.slow
@pytest.mark.timeout(290)
async def test_router_in_front_of_fleetserve_serve(procs):
    engine_url, _ = procs.engine("--max-total-tokens", "4096")
    router, _ = procs.router([engine_url], "--policy", "cache_aware")
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, "temperature": 0}
    async with aiohttp.ClientSession(timeout=T) as s:
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
