"""A router registered as its own worker answers its own looped requests 508 at once (``Via``, via.py).

Helper trial: ``/add_worker`` with the router's own URL was accepted, and every request it sent to
that "worker" came back to it and went round again: 66 hops for one request with cache_aware.  A second
trial: with the loop answered 508, each request still paid a hop until the circuit opened; now
``/add_worker`` refuses the router's own URL (400 ``worker_is_this_router``) and its health checks,
which carry the router's ``Via`` entry, find such a worker unhealthy."""

import asyncio

import aiohttp
import pytest

from fleetserve.router.via import forwarded_via, loop_answer, new_pseudonym
from helpers.fault_worker import FaultWorker


def test_via_entries_and_the_loop_check():
    own = new_pseudonym()
    assert own.startswith("1.1 fleetserve-") and len(own) == len("1.1 fleetserve-") + 8 and own != new_pseudonym()
    assert forwarded_via(None, own) == own and forwarded_via("1.1 proxy-a", own) == f"1.1 proxy-a, {own}"
    assert loop_answer({}, own, "/generate") is None
    assert loop_answer({"via": "1.1 fleetserve-00000000"}, own, "/generate") is None  # another router
    r = loop_answer({"via": f"1.0 edge, {own}"}, own, "/generate")
    assert r.status == 508 and b'"code":"loop_detected"' in r.body


@pytest.mark.timeout(30)
async def test_a_router_that_is_its_own_worker_answers_the_loop_508_and_serves_from_the_others(InProcessRouter):
    real = await FaultWorker("real").start()
    try:
        async with aiohttp.ClientSession() as s, InProcessRouter(
                worker_urls=[real.url], policy="round_robin", retry_initial_backoff_ms=1,
                retry_max_backoff_ms=2) as r:
            # /add_worker refuses it: its /health answers a check carrying its own Via entry with 508
            async with s.post(f"{r.url}/add_worker?url={r.url}") as resp:
                assert resp.status == 400, await resp.text()
                err = (await resp.json())["error"]
            assert (err["code"], err["param"]) == ("worker_is_this_router", "url")
            assert [w.url for w in r.router.registry.workers] == [real.url]
            # registered all the same (as a second router's url pointing back would be): requests loop once
            r.router.registry.add(r.router.new_worker(r.url))
            assert [w.url for w in r.router.registry.workers] == [real.url, r.url]
            for _ in range(4):
                r.router.policy._next = 1  # the router itself is asked first
                async with s.post(r.url + "/generate", json={"text": "hi"}, headers={"Via": "1.1 client-proxy"}) as a:
                    assert a.status == 200 and (await a.json())["worker"] == "real"
            assert real.requests == 4  # each request reached the real worker once, nothing went round again
            assert r.router.stats.retries == 4  # the one hop to itself, answered 508, then the real worker
            me = r.router.registry.get(r.url)
            assert me.requests == 4 and me.failures == 4
            # a request that arrives with this router's own Via entry is refused at once
            async with s.post(r.url + "/v1/completions", json={"prompt": "x"},
                              headers={"Via": f"1.1 client-proxy, {r.router.via}"}) as a:
                assert a.status == 508
                err = (await a.json())["error"]
            assert err["code"] == "loop_detected" and "already passed through this router" in err["message"]
            async with s.get(r.url + "/get_server_info", headers={"Via": r.router.via}) as a:
                assert a.status == 508
    finally:
        await real.close()


@pytest.mark.timeout(30)
async def test_health_checks_find_a_router_registered_as_its_own_worker_unhealthy(InProcessRouter):
    """Registered by a path that does not check (here: directly), the router's periodic health checks of
    itself carry its Via entry, get 508, and take it out of routing."""
    real = await FaultWorker("real").start()
    try:
        async with InProcessRouter(worker_urls=[real.url], policy="round_robin", health_check_interval_secs=0.1,
                                   health_failure_threshold=1) as r:
            r.router.registry.add(r.router.new_worker(r.url))
            me = r.router.registry.get(r.url)
            for _ in range(100):
                if not me.healthy:
                    break
                await asyncio.sleep(0.05)
            assert not me.healthy and r.router.registry.get(real.url).healthy
            assert [w.url for w in r.router.registry.available()] == [real.url]
    finally:
        await real.close()
