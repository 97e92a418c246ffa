"""kv_aware end to end: publishers in their own processes (vLLM and SGLang layouts) over real ZMQ,
fake HTTP workers that point at them in /get_server_info, and a router in this process."""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

PUBLISHER = Path(__file__).resolve().parents[2] / "helpers" / "kv_publisher.py"
BS = 4
PREFIX = list(range(100, 164))  # 64 tokens = 16 blocks of 4


class Publisher:
    """``tests/helpers/kv_publisher.py`` in its own process, driven over stdin."""

    def __init__(self, layout: str, ranks: int = 1, replay: bool = False) -> None:
        args = [sys.executable, str(PUBLISHER), "--layout", layout, "--ranks", str(ranks), "--block-size", str(BS)]
        if replay:
            args.append("--replay")
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = json.loads(self._line())

    def _line(self) -> str:
        line = self.p.stdout.readline()
        assert line, "publisher exited"
        return line

    def do(self, **cmd) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        self.p.stdin.close()
        try:
            self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(timeout=5)


def fake_worker(name: str, pub: Publisher | None, dp_size: int = 1, seen: list | None = None) -> web.Application:
    async def generate(request):
        body = await request.json()
        if seen is not None:
            seen.append((name, body, dict(request.headers)))
        await asyncio.sleep(float(body.get("fake_sleep", 0)))
        return web.json_response({"worker": name, "text": "ok"})

    async def info(request):
        out = {"model_path": "fake", "dp_size": dp_size}
        if pub is not None:
            out["kv_events_config"] = json.dumps({"publisher": "zmq", "endpoint": pub.info["endpoint"],
                                                  "replay_endpoint": pub.info["replay_endpoint"], "topic": ""})
        return web.json_response(out)

    async def health(request):
        return web.json_response({"ok": True})

    async def flush(request):
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/get_server_info", info)
    app.router.add_get("/health", health)
    app.router.add_post("/flush_cache", flush)
    return app


@pytest.fixture
def publishers():
    made = []

    def make(*a, **kw):
        made.append(Publisher(*a, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


async def wait_for(cond, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def generate(session, url: str, ids: list[int], **extra) -> str:
    async with session.post(url + "/generate", json={"input_ids": ids, **extra}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["worker"]


async def fleet(start_app, pubs_and_dp, seen=None):
    runners, urls = [], []
    for i, (pub, dp) in enumerate(pubs_and_dp):
        runner, url = await start_app(fake_worker(f"w{i}", pub, dp, seen))
        runners.append(runner)
        urls.append(url)
    return runners, urls


async def prefix_indexed(pol, pub: Publisher, url: str) -> None:
    """Once ``url``'s one stream is subscribed and connected, ``pub`` stores PREFIX (16 blocks); returns when
    the router's index holds them."""
    await wait_for(subs_ready(pol, [url]), what="subscription")
    await asyncio.sleep(0.3)  # let the SUB connect (a PUB drops what it sends before that)
    pub.do(op="store", tokens=PREFIX)
    await wait_for(lambda: pol.index.blocks_of((url, 0)) == 16, what="the prefix indexed")


def subs_ready(policy, urls, ranks=1):
    return lambda: all(len(policy.subs.get(u, {})) == ranks for u in urls)


@pytest.mark.parametrize("layout", ["sglang", "vllm"])
async def test_routing_follows_the_events_not_the_routers_own_traffic(start_app, InProcessRouter, publishers,
                                                                      layout):
    pa, pb = publishers(layout), publishers(layout)
    runners, urls = await fleet(start_app, [(pa, 1), (pb, 1)])
    try:
        async with InProcessRouter(worker_urls=urls, policy="kv_aware", kv_speculative_ttl_secs=0.0) as r, \
                aiohttp.ClientSession() as s:
            pol = r.router.policy
            await wait_for(subs_ready(pol, urls), what="subscriptions")
            await asyncio.sleep(0.3)  # let the SUBs connect (a PUB drops what it sends before that)
            pa.do(op="store", tokens=[1, 1, 1, 1])  # w0's stream is live from seq 0: exact
            await wait_for(lambda: pol.trust(urls[0], 0) == "exact", what="w0 exact")
            # the router's own traffic: the prefix goes to w0 first (all equal: registration order)
            assert await generate(s, r.url, PREFIX) == "w0"
            # ... but the engines say w1 holds it (events first, then wait until the index has them)
            pb.do(op="store", tokens=PREFIX)
            await wait_for(lambda: pol.index.blocks_of((urls[1], 0)) == 16, what="w1's blocks indexed")
            assert pol.trust(urls[1], 0) == "exact"
            assert await generate(s, r.url, PREFIX + [1, 2, 3]) == "w1"
            assert pol.decisions["exact"] >= 1
            # w0's engine never said it held anything, so it is not a candidate for the cache
            assert pol.index.blocks_of((urls[0], 0)) == 1
    finally:
        for rn in runners:
            await rn.cleanup()


async def test_block_removed_moves_the_next_request_by_load(start_app, InProcessRouter, publishers):
    pa, pb = publishers("sglang"), publishers("vllm")
    runners, urls = await fleet(start_app, [(pa, 1), (pb, 1)])
    try:
        async with InProcessRouter(worker_urls=urls, policy="kv_aware", kv_speculative_ttl_secs=0.0,
                                   kv_load_weight=0.1) as r, aiohttp.ClientSession() as s:
            pol = r.router.policy
            await wait_for(subs_ready(pol, urls), what="subscriptions")
            await asyncio.sleep(0.3)
            pa.do(op="store", tokens=[1, 1, 1, 1])
            pb.do(op="store", tokens=PREFIX)
            await wait_for(lambda: pol.index.blocks_of((urls[1], 0)) == 16, what="indexed")
            await wait_for(lambda: pol.trust(urls[0], 0) == "exact", what="w0 exact")
            slow = asyncio.ensure_future(generate(s, r.url, PREFIX, fake_sleep=1.0))  # in flight on w1
            await wait_for(lambda: pol.inflight.get((urls[1], None)) == 1, what="slow request on w1")
            assert await generate(s, r.url, PREFIX) == "w1"  # cached there beats its load (weight 0.1)
            pb.do(op="remove", tokens=PREFIX)
            await wait_for(lambda: pol.index.blocks_of((urls[1], 0)) == 0, what="removal applied")
            # the slow request is still in flight there and, not streamed, not known to be prefilled: its
            # prompt counts as cached on w1 whatever the events say (an engine holds a running request's pages)
            assert await generate(s, r.url, PREFIX) == "w1"
            assert await slow == "w1"
            assert await generate(s, r.url, PREFIX) == "w0"  # nobody holds it now: w1 was chosen last
            assert pol.load_tokens == {} and pol.inflight == {}  # every request released its tokens
    finally:
        for rn in runners:
            await rn.cleanup()


async def test_gap_with_replay_is_repaired_and_stays_exact(start_app, InProcessRouter, publishers):
    pa = publishers("vllm", replay=True)
    runners, urls = await fleet(start_app, [(pa, 1), (None, 1)])
    try:
        async with InProcessRouter(worker_urls=urls, policy="kv_aware", kv_speculative_ttl_secs=0.0) as r, \
                aiohttp.ClientSession() as s:
            pol = r.router.policy
            await wait_for(lambda: len(pol.subs.get(urls[0], {})) == 1, what="subscription")
            await asyncio.sleep(0.3)  # let the SUB connect (a PUB drops messages sent before that)
            pa.do(op="store", tokens=[1, 2, 3, 4])
            sub = pol.subs[urls[0]][0]
            await wait_for(lambda: sub.last_seq == 0, what="first batch")
            pa.do(op="drop", n=1)
            pa.do(op="store", tokens=PREFIX)  # seq 1: buffered, never published
            pa.do(op="store", tokens=[9, 9, 9, 9])  # seq 2: shows the gap
            await wait_for(lambda: sub.last_seq == 2, what="gap handled")
            assert sub.gaps == 1 and sub.replays == 1 and sub.state == "exact"
            assert pol.index.blocks_of((urls[0], 0)) == 1 + 16 + 1  # the dropped batch came by replay
            assert await generate(s, r.url, PREFIX[::-1]) == "w0"  # a tie (nobody has it), nobody chosen yet: registration order
            assert await generate(s, r.url, PREFIX) == "w0"
            assert pol.decisions["exact"] >= 1
    finally:
        for rn in runners:
            await rn.cleanup()


async def test_gap_without_replay_falls_back_until_a_clean_state(start_app, InProcessRouter, publishers):
    pa, pb = publishers("sglang"), publishers("sglang")
    runners, urls = await fleet(start_app, [(pa, 1), (pb, 1)])
    try:
        async with InProcessRouter(worker_urls=urls, policy="kv_aware", kv_speculative_ttl_secs=0.0) as r, \
                aiohttp.ClientSession() as s:
            pol = r.router.policy
            await wait_for(subs_ready(pol, urls), what="subscriptions")
            await asyncio.sleep(0.3)
            pa.do(op="store", tokens=[1, 1, 1, 1])
            pb.do(op="store", tokens=PREFIX)
            sub = pol.subs[urls[1]][0]
            await wait_for(lambda: sub.last_seq == 0 and sub.state == "exact", what="exact")
            await wait_for(lambda: pol.trust(urls[0], 0) == "exact", what="w0 exact")
            pb.do(op="drop", n=1)
            pb.do(op="remove", tokens=PREFIX)  # lost: the router cannot know it is gone
            pb.do(op="store", tokens=[7, 7, 7, 7])
            await wait_for(lambda: sub.last_seq == 2, what="gap seen")
            assert sub.state == "fallback" and sub.gaps == 1
            assert pol.index.blocks_of((urls[1], 0)) == 1  # entries before the gap were dropped
            # fallback: w1 is routed by the approximate tree, which follows the router's own traffic
            slow = asyncio.ensure_future(generate(s, r.url, [5] * 8, fake_sleep=0.5))  # w0 busy
            await wait_for(lambda: pol.inflight.get((urls[0], None)) == 1, what="w0 busy")
            assert await generate(s, r.url, PREFIX) == "w1"  # by load
            assert await slow == "w0"
            assert await generate(s, r.url, PREFIX) == "w1"  # by the tree: w1 was sent the prefix
            assert pol.decisions["fallback"] >= 2
            pb.do(op="clear")
            await wait_for(lambda: sub.state == "exact", what="exact again after AllBlocksCleared")
            assert pol.index.blocks_of((urls[1], 0)) == 0
            # exact again: the tree no longer counts for w1, so the same prefix goes by order now
            n_exact = pol.decisions["exact"]
            assert await generate(s, r.url, PREFIX) == "w0"
            pb.do(op="store", tokens=PREFIX)
            await wait_for(lambda: pol.index.blocks_of((urls[1], 0)) == 16, what="indexed")
            assert await generate(s, r.url, PREFIX) == "w1"
            assert pol.decisions["exact"] == n_exact + 2
            async with s.get(r.url + "/metrics") as m:
                text = await m.text()
            assert f'fleetserve_router_kv_stream_state{{dp_rank="0",state="exact",worker="{urls[1]}"}} 1.0' in text
            assert f'fleetserve_router_kv_gaps_total{{dp_rank="0",worker="{urls[1]}"}} 1.0' in text
            assert f'fleetserve_router_kv_index_blocks{{dp_rank="0",worker="{urls[1]}"}} 16.0' in text
            assert 'fleetserve_router_kv_decisions_total{branch="fallback"} 2.0' in text
            for u in urls:  # every answer ended: no prefill queued on either worker
                assert f'fleetserve_router_kv_worker_active_prefill_tokens{{dp_rank="-",worker="{u}"}} 0.0' in text
    finally:
        for rn in runners:
            await rn.cleanup()


async def test_malformed_frames_and_a_flood_leave_the_router_serving(start_app, InProcessRouter, publishers):
    pa, pb = publishers("sglang"), publishers("vllm")
    runners, urls = await fleet(start_app, [(pa, 1), (pb, 1)])
    try:
        async with InProcessRouter(worker_urls=urls, policy="kv_aware", kv_index_max_blocks=5000) as r, \
                aiohttp.ClientSession() as s:
            pol = r.router.policy
            await wait_for(subs_ready(pol, urls), what="subscriptions")
            await asyncio.sleep(0.3)
            pa.do(op="malformed", n=200)
            sa = pol.subs[urls[0]][0]
            await wait_for(lambda: sa.malformed == 200, what="malformed counted")
            flood = asyncio.get_running_loop().run_in_executor(None, lambda: pb.do(op="flood", n=20000))
            worst = 0.0
            for i in range(40):
                t0 = time.monotonic()
                assert await generate(s, r.url, PREFIX + [i]) in ("w0", "w1")
                worst = max(worst, time.monotonic() - t0)
            await flood
            sb = pol.subs[urls[1]][0]
            await wait_for(lambda: sb.batches + sb.gaps >= 1 and sb.last_seq == 19999, timeout=60,
                           what="flood consumed")
            assert len(pol.index) <= 5000  # the bound holds
            # bounded, with room for a loaded 2-core machine (a stalled loop would take the whole flood)
            assert worst < 5.0, f"a request took {worst:.2f} s during the flood"
            async with s.get(r.url + "/health") as h:
                assert h.status == 200
    finally:
        for rn in runners:
            await rn.cleanup()


async def test_dp_ranks_are_discovered_and_removed_workers_dropped(start_app, InProcessRouter, publishers):
    pa = publishers("sglang", ranks=2)
    runners, urls = await fleet(start_app, [(pa, 2)])
    try:
        async with InProcessRouter(worker_urls=urls, policy="kv_aware") as r, aiohttp.ClientSession() as s:
            pol = r.router.policy
            await wait_for(subs_ready(pol, urls, ranks=2), what="two rank subscriptions")
            base = int(pa.info["endpoint"].rsplit(":", 1)[1])
            assert [pol.subs[urls[0]][k].endpoint for k in (0, 1)] == [f"tcp://127.0.0.1:{base}",
                                                                       f"tcp://127.0.0.1:{base + 1}"]
            await asyncio.sleep(0.3)
            pa.do(op="store", rank=1, tokens=PREFIX)
            await wait_for(lambda: pol.index.blocks_of((urls[0], 1)) == 16, what="rank 1 indexed")
            assert pol.index.blocks_of((urls[0], 0)) == 0
            async with s.post(r.url + f"/remove_worker?url={urls[0]}") as resp:
                assert resp.status == 200
            await wait_for(lambda: urls[0] not in pol.subs, what="unsubscribed")
            assert pol.index.blocks_of((urls[0], 1)) == 0 and len(pol.index) == 0
    finally:
        for rn in runners:
            await rn.cleanup()


@pytest.mark.parametrize("header", [True, False])
async def test_dp_aware_sends_the_rank_and_the_route_header_says_why(start_app, InProcessRouter, publishers, header):
    pa = publishers("vllm", ranks=2)
    seen = []
    runners, urls = await fleet(start_app, [(pa, 2)], seen)
    try:
        async with InProcessRouter(worker_urls=urls, policy="kv_aware", dp_aware=True, kv_speculative_ttl_secs=0,
                                   no_route_header=not header) as r, aiohttp.ClientSession() as s:
            pol = r.router.policy
            await wait_for(subs_ready(pol, urls, ranks=2), what="two rank subscriptions")
            await asyncio.sleep(0.3)
            pa.do(op="store", rank=0, tokens=[1, 1, 1, 1])
            pa.do(op="store", rank=1, tokens=PREFIX)
            await wait_for(lambda: pol.index.blocks_of((urls[0], 1)) == 16 and pol.trust(urls[0], 0) == "exact",
                           what="both ranks live")
            async with s.post(r.url + "/generate", json={"input_ids": PREFIX + [5], "max_new_tokens": 4}) as resp:
                assert resp.status == 200
                route = resp.headers.get("x-fleetserve-route")
            name, body, headers = seen[-1]
            assert body["routed_dp_rank"] == 1 and body["input_ids"] == PREFIX + [5]
            assert headers["X-data-parallel-rank"] == "1"
            if header:
                assert route == f"target={urls[0]}; dp_rank=1; branch=exact; cached_tokens=64; prompt_tokens=65"
            else:
                assert route is None
            # a prompt no rank holds goes to the rank with less in flight: rank 0 (tie: order)
            async with s.post(r.url + "/generate", json={"input_ids": [3] * 9}) as resp:
                assert resp.status == 200
            assert seen[-1][1]["routed_dp_rank"] == 0
    finally:
        for rn in runners:
            await rn.cleanup()


async def test_tokenization_runs_off_the_event_loop(start_app, InProcessRouter):
    """A request whose tokenization blocks (a stand-in for a 100k-token prompt) holds no other request."""
    import threading

    runners, urls = await fleet(start_app, [(None, 1)])
    gate = threading.Event()
    entered = threading.Event()

    class SlowTokenizer:
        def inline(self, path, body):
            return False  # as RouterTokenizer.inline for a prompt over INLINE_MAX_CHARS: tokenized on the pool

        def request_ids(self, path, body):
            entered.set()
            assert gate.wait(20)
            return [1, 2, 3, 4]

    try:
        async with InProcessRouter(worker_urls=urls, policy="kv_aware") as r, aiohttp.ClientSession() as s:
            pol = r.router.policy
            from concurrent.futures import ThreadPoolExecutor
            pol.tokenizer, pol._pool = SlowTokenizer(), ThreadPoolExecutor(1)
            big = asyncio.ensure_future(s.post(r.url + "/v1/completions", json={"prompt": "a long prompt"}))
            await wait_for(entered.is_set, what="tokenizing")
            for i in range(3):  # token-id requests need no tokenizer: served while the other one waits
                assert await generate(s, r.url, [i] * 8) == "w0"
            assert not big.done()
            gate.set()
            async with await big as resp:
                assert resp.status == 404  # the fake worker has no /v1/completions: it got through
                assert resp.headers["x-fleetserve-route"].endswith("prompt_tokens=4")
    finally:
        gate.set()
        for rn in runners:
            await rn.cleanup()


async def test_kv_events_endpoint_flag_for_a_worker_without_server_info_config(start_app, InProcessRouter,
                                                                               publishers):
    pa = publishers("vllm")
    runners, urls = await fleet(start_app, [(None, 1), (None, 1)])  # neither names a publisher
    port = pa.info["endpoint"].rsplit(":", 1)[1]
    try:
        async with InProcessRouter(worker_urls=urls, policy="kv_aware",
                                   kv_events_endpoint=[f"{urls[1]}=tcp://127.0.0.1:{port}"]) as r:
            pol = r.router.policy
            await wait_for(lambda: urls[1] in pol.subs, what="flag subscription")
            assert pol.subs[urls[1]][0].endpoint == f"tcp://127.0.0.1:{port}"
            await asyncio.sleep(0.3)
            pa.do(op="store", tokens=PREFIX)
            await wait_for(lambda: pol.index.blocks_of((urls[1], 0)) == 16, what="indexed")
            assert urls[0] not in pol.subs and pol.trust(urls[0], 0) == "fallback"
    finally:
        for rn in runners:
            await rn.cleanup()


async def test_a_publisher_that_exits_takes_its_entries_with_it(start_app, InProcessRouter, publishers):
    """The engine behind w0 exits (its publisher process is killed): its KV-event connection drops, so the
    router drops w0's index entries and its approximate-tree entries and turns it degraded.  Before, the
    entries stayed until the restarted engine's first event, and the first request after a restart was
    predicted a hit (``cached_tokens=60``) that the new engine did not have."""
    pa = publishers("sglang")
    runners, urls = await fleet(start_app, [(pa, 1)])
    try:
        async with InProcessRouter(worker_urls=urls, policy="kv_aware", kv_speculative_ttl_secs=0.0) as r, \
                aiohttp.ClientSession() as s:
            pol = r.router.policy
            await prefix_indexed(pol, pa, urls[0])
            assert pol.trust(urls[0], 0) == "exact"
            async with s.post(r.url + "/generate", json={"input_ids": PREFIX + [7, 7, 7, 7]}) as resp:
                assert resp.status == 200
                assert "cached_tokens=64" in resp.headers["x-fleetserve-route"]
            assert pol.tree.tenant_sizes().get(urls[0], 0) > 0
            pa.p.kill()  # the engine exits
            pa.p.wait(timeout=5)
            sub = pol.subs[urls[0]][0]
            await wait_for(lambda: sub.disconnects == 1, what="the lost connection")
            await wait_for(lambda: urls[0] not in pol.tree.tenant_sizes(), what="the tree entries dropped")
            assert pol.index.blocks_of((urls[0], 0)) == 0
            assert pol.trust(urls[0], 0) == "degraded"
            async with s.post(r.url + "/generate", json={"input_ids": PREFIX + [7, 7, 7, 7]}) as resp:
                assert resp.status == 200
                assert "cached_tokens=0" in resp.headers["x-fleetserve-route"], resp.headers["x-fleetserve-route"]
    finally:
        for rn in runners:
            await rn.cleanup()


async def test_a_prompt_over_the_tokenize_limit_is_routed_on_its_text(start_app, InProcessRouter, monkeypatch,
                                                                      caplog):
    """A prompt over MAX_TOKENIZE_CHARS (4 Mi characters; 10,000 here) is not tokenized (that took a core for
    seconds per 12 MB, with a 512 MiB body limit): routed on its text, ``reason=text``, one warning; a
    shorter one is tokenized as before."""
    from fleetserve.models.tokenizer import tokenizer_dir
    from fleetserve.router.kv_events import policy as policy_mod
    from fleetserve.router.kv_events.tokenize import RouterTokenizer

    monkeypatch.setattr(policy_mod, "MAX_TOKENIZE_CHARS", 10_000)
    runners, urls = await fleet(start_app, [(None, 1)])
    try:
        async with InProcessRouter(worker_urls=urls, policy="kv_aware", tokenizer_path=tokenizer_dir()) as r, \
                aiohttp.ClientSession() as s:
            with caplog.at_level("WARNING", logger="fleetserve.router"):
                for words, reason in ((2_000, "reason=text"), (1_500, None)):  # 12,000 and 9,000 characters
                    async with s.post(r.url + "/v1/completions", json={"prompt": "hello " * words}) as resp:
                        route = resp.headers["x-fleetserve-route"]
                        assert (reason in route) if reason else ("reason=" not in route), route
                        n = 12_000 // 4 if reason else len(RouterTokenizer(tokenizer_dir()).encode("hello " * words))
                        assert f"prompt_tokens={n};" in route + ";", route  # text: 4 characters a token
            assert r.router.policy.too_long == 1
            assert [m.getMessage() for m in caplog.records if "routed on its text" in m.getMessage()] == [
                "kv_aware: a prompt of 12000 characters, over the 10000 this router tokenizes, is routed on its "
                "text (branch=fallback reason=text; 1 so far)"]
            # the same size as a chat's content parts (a user trial: those were tokenized whatever their size)
            chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello " * 1_000}] * 2}]}
            async with s.post(r.url + "/v1/chat/completions", json=chat) as resp:  # (this test worker: 404)
                assert "reason=text" in resp.headers["x-fleetserve-route"], resp.headers["x-fleetserve-route"]
            assert r.router.policy.too_long == 2
    finally:
        for rn in runners:
            await rn.cleanup()


async def test_a_flushed_workers_entries_go_with_the_flush(start_app, InProcessRouter, publishers):
    """``POST /flush_cache`` answered 200: the worker's index and tree entries are dropped at once, so the
    next request is predicted 0 cached even before the engine's AllBlocksCleared arrives (none is sent
    here); a user trial saw ``cached_tokens=377`` predicted right after a flush, 0 reported."""
    pa = publishers("vllm")
    runners, urls = await fleet(start_app, [(pa, 1)])
    try:
        async with InProcessRouter(worker_urls=urls, policy="kv_aware", kv_speculative_ttl_secs=0.0) as r, \
                aiohttp.ClientSession() as s:
            pol = r.router.policy
            await prefix_indexed(pol, pa, urls[0])
            async with s.post(r.url + "/generate", json={"input_ids": PREFIX + [7, 7, 7, 7]}) as resp:
                assert "cached_tokens=64" in resp.headers["x-fleetserve-route"]
            async with s.post(r.url + "/flush_cache") as resp:
                assert resp.status == 200 and (await resp.json())["workers"] == {urls[0]: 200}
            assert pol.index.blocks_of((urls[0], 0)) == 0 and urls[0] not in pol.tree.tenant_sizes()
            assert pol.trust(urls[0], 0) == "exact"  # the stream itself is as trusted as before
            async with s.post(r.url + "/generate", json={"input_ids": PREFIX + [7, 7, 7, 7]}) as resp:
                assert "cached_tokens=0" in resp.headers["x-fleetserve-route"], resp.headers["x-fleetserve-route"]
            pa.do(op="store", tokens=[1, 2, 3, 4])  # later events index as before (the block size was kept)
            await wait_for(lambda: pol.index.blocks_of((urls[0], 0)) == 1, what="a new block indexed")
    finally:
        for rn in runners:
            await rn.cleanup()
