"""Issue 15: one-word chats through ``fleetserve router --policy cache_aware`` to four workers spread
over them (a role marker common to every conversation once made them all cache hits on one)."""

import aiohttp
import pytest

T = aiohttp.ClientTimeout(total=20)
WORDS = ["hi", "hello", "thanks", "yes", "no", "why", "ok", "bye"]


@pytest.mark.timeout(60)
async def test_one_word_chats_spread_over_four_workers(procs):
    urls = [procs.worker(f"w{i}")[0] for i in range(4)]
    router, _ = procs.router(urls, "--policy", "cache_aware")
    got = []
    async with aiohttp.ClientSession() as s:
        for w in WORDS:  # one at a time: every worker idle at each decision
            async with s.post(router + "/v1/chat/completions", timeout=T,
                              json={"messages": [{"role": "user", "content": w}]}) as r:
                assert r.status == 200
                got.append((await r.json(content_type=None))["worker"])
    assert len(set(got)) == 4 and max(got.count(x) for x in set(got)) == 2, got
