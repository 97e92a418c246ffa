"""Where a worker's KV-event streams are: /get_server_info's kv_events_config and the flag."""

import json

import pytest

from fleetserve.router.kv_events.sources import (
    MAX_DP_SIZE,
    connecting_endpoint,
    endpoints_from_info,
    parse_endpoint_flags,
    rank_endpoint,
)


def test_wildcard_host_is_the_workers_and_ranks_offset_the_port():
    assert rank_endpoint("tcp://*:5557", "http://10.0.0.7:30000", 0) == "tcp://10.0.0.7:5557"
    assert rank_endpoint("tcp://0.0.0.0:5557", "http://10.0.0.7:30000", 3) == "tcp://10.0.0.7:5560"
    assert rank_endpoint("tcp://[::]:5557", "http://[fd00::1]:30000", 1) == "tcp://[fd00::1]:5558"
    assert rank_endpoint("tcp://pubhost:6000", "http://10.0.0.7:30000", 1) == "tcp://pubhost:6001"
    assert rank_endpoint("ipc:///tmp/kv", "http://h:1", 2) == "ipc:///tmp/kv_dp2"  # vLLM's suffix rule


def test_sglang_style_server_info():
    info = {"dp_size": 2, "kv_events_config": json.dumps(
        {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600", "topic": "kv"})}
    assert endpoints_from_info(info, "http://h:30000") == [
        (0, "tcp://h:5557", "tcp://h:5600", "kv"), (1, "tcp://h:5558", "tcp://h:5601", "kv")]
    assert endpoints_from_info({"kv_events_config": {"endpoint": "tcp://*:1"}}, "http://h:2") == [
        (0, "tcp://h:1", None, "")]  # an object works as well as its JSON string


@pytest.mark.parametrize("info", [{}, {"kv_events_config": None}, {"kv_events_config": "{not json"},
                                  {"kv_events_config": json.dumps({"publisher": "null"})},
                                  {"kv_events_config": json.dumps({"publisher": "null", "endpoint": "tcp://*:1"})}])
def test_no_usable_config_is_none(info):
    assert endpoints_from_info(info, "http://h:1") is None


def test_a_named_publisher_host_connects_and_a_wildcard_binds():
    """vLLM's and SGLang's rule (docs/kv_events.md): only a named tcp host makes the PUB socket connect."""
    named = {"kv_events_config": json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:25557"})}
    assert connecting_endpoint(named) == "tcp://127.0.0.1:25557"
    assert connecting_endpoint({"kv_events_config": {"endpoint": "tcp://collector.local:6000"}}) == \
        "tcp://collector.local:6000"
    for ep in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557", "ipc:///tmp/kv", "inproc://kv"):
        assert connecting_endpoint({"kv_events_config": {"endpoint": ep}}) is None, ep
    assert connecting_endpoint({}) is None and connecting_endpoint({"kv_events_config": "{bad"}) is None


def test_flag_parsing():
    assert parse_endpoint_flags(["127.0.0.1:8000=tcp://127.0.0.1:5557"]) == {
        "http://127.0.0.1:8000": "tcp://127.0.0.1:5557"}
    for bad in ["http://h:1", "http://h:1=udp://h:2", "http://h:1=tcp://h:0", "http://h:1=tcp://h:x",
                "notaurl=tcp://h:1"]:
        with pytest.raises(ValueError):
            parse_endpoint_flags([bad])


def test_a_worker_naming_no_publisher_is_logged_once(caplog):
    """A kv_aware router in front of an engine started without --kv-events-config says so once
    (its requests show branch=fallback with no reason= in the route header)."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from fleetserve.router.kv_events.policy import KvAwarePolicy
    from fleetserve.router.kv_events.sources import KvEventSources

    async def main():
        async def info(_request):
            return web.json_response({"dp_size": 1})  # no kv_events_config

        async def keyed_info(_request):
            return web.json_response({"error": {"message": "missing API key"}}, status=401)

        async def null_info(_request):  # started with --kv-events-config '{"publisher": "null"}'
            return web.json_response({"dp_size": 1, "kv_events_config": '{"publisher": "null"}'})

        async def named_info(_request):  # its publisher connects: the router connecting too gets nothing
            return web.json_response({"dp_size": 1, "kv_events_config": {"endpoint": "tcp://127.0.0.1:1"}})

        app = web.Application()
        app.router.add_get("/get_server_info", info)
        app.router.add_get("/keyed/get_server_info", keyed_info)
        app.router.add_get("/named/get_server_info", named_info)
        app.router.add_get("/null/get_server_info", null_info)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

        class Registry:
            def urls(self):
                return [url, url + "/keyed", url + "/named", url + "/null"]

        class Router:
            registry = Registry()

            @staticmethod
            def own_headers(url):
                return {}

        sources = KvEventSources(KvAwarePolicy())
        try:
            async with aiohttp.ClientSession() as session:
                Router.session = session
                with caplog.at_level("WARNING", logger="fleetserve.router"):
                    await sources.sync(Router)
                    sources._asked.clear()  # ask again at once: still no publisher, no second line
                    await sources.sync(Router)
        finally:
            sources.close()
            await runner.cleanup()
        return url

    url = asyncio.run(main())
    lines = sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("kv-events: "))
    assert lines == [f"kv-events: {url} names no KV-event publisher (no kv_events_config in its /get_server_info, "
                     "no --kv-events-endpoint for it): routed on the approximate tree (branch=fallback) until it "
                     "does; start it with --kv-events-config",
                     f"kv-events: {url}/keyed/get_server_info answered 401, so its KV-event publisher is unknown: "
                     "routed on the approximate tree (branch=fallback); name it with --kv-events-endpoint "
                     f"{url}/keyed=tcp://HOST:PORT",
                     f"kv-events: {url}/named publishes on tcp://127.0.0.1:1, a named host, so its PUB socket "
                     "connects to a collector there instead of binding (as vLLM and SGLang do); this router connects "
                     "too and receives nothing unless something binds that address: start the worker with tcp://*:1 "
                     "to publish to routers directly",
                     f"kv-events: {url}/null names no KV-event publisher (its kv_events_config names publisher "
                     "'null', which publishes nothing to subscribe to, no --kv-events-endpoint for it): routed on "
                     "the approximate tree (branch=fallback) until it does; start it with --kv-events-config"]


def test_unusable_ports_and_dp_sizes_raise_naming_the_field():
    for ep, rank in (("tcp://*:notaport", 0), ("tcp://*:70000", 0), ("tcp://*:0", 0), ("tcp://*:65535", 1)):
        with pytest.raises(ValueError, match="KV-event endpoint"):
            rank_endpoint(ep, "http://h:1", rank)
    assert rank_endpoint("tcp://*:65535", "http://h:1", 0) == "tcp://h:65535"
    cfg = {"publisher": "zmq", "endpoint": "tcp://*:5557"}
    for dp in (100_000, MAX_DP_SIZE + 1, 0, -2, "2", 1.5, True):
        with pytest.raises(ValueError, match="dp_size"):
            endpoints_from_info({"dp_size": dp, "kv_events_config": cfg}, "http://h:1")
    assert len(endpoints_from_info({"dp_size": MAX_DP_SIZE, "kv_events_config": cfg}, "http://h:1")) == MAX_DP_SIZE
    assert endpoints_from_info({"dp_size": None, "kv_events_config": cfg}, "http://h:1") == [
        (0, "tcp://h:5557", None, "")]  # not reported: one rank
    with pytest.raises(ValueError, match="over 65535"):  # ranks 0..9 would run past 65535 from 65530
        endpoints_from_info({"dp_size": 10, "kv_events_config": {"endpoint": "tcp://*:65530"}}, "http://h:1")


def test_a_worker_with_an_unusable_config_leaves_the_others_subscribed(caplog):
    """One worker whose /get_server_info names a port that is not a number, one that reports dp_size 100000
    (which once made the router open a socket and a thread per rank until it ran out of files and stalled):
    each is logged once and routed on the tree; the good worker beside them is subscribed, no thread is
    started for the bad ones, and --dp-aware does not take the huge dp_size as 100000 targets."""
    import asyncio
    import threading

    import aiohttp
    from aiohttp import web

    from fleetserve.router.kv_events.policy import KvAwarePolicy
    from fleetserve.router.kv_events.sources import KvEventSources

    async def main():
        def answer(body):
            async def handler(_request):
                return web.json_response(body)
            return handler

        app = web.Application()
        app.router.add_get("/good/get_server_info", answer(
            {"dp_size": 2, "kv_events_config": {"publisher": "zmq", "endpoint": "tcp://*:25911"}}))
        app.router.add_get("/port/get_server_info", answer(
            {"dp_size": 1, "kv_events_config": {"publisher": "zmq", "endpoint": "tcp://*:notaport"}}))
        app.router.add_get("/huge/get_server_info", answer(
            {"dp_size": 100_000, "kv_events_config": {"publisher": "zmq", "endpoint": "tcp://*:25920"}}))
        app.router.add_get("/huge-no-events/get_server_info", answer({"dp_size": 100_000}))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        urls = [url + "/port", url + "/huge", url + "/good", url + "/huge-no-events"]

        class Registry:
            def urls(self):
                return urls

        class Router:
            registry = Registry()

            @staticmethod
            def own_headers(url):
                return {}

        policy = KvAwarePolicy(dp_aware=True)
        sources = KvEventSources(policy)
        threads_before = threading.active_count()
        try:
            async with aiohttp.ClientSession() as session:
                Router.session = session
                with caplog.at_level("WARNING", logger="fleetserve.router"):
                    await sources.sync(Router)
                    sources._asked.clear()  # ask again at once: no second line for the same worker
                    await sources.sync(Router)
                subscribed = {u: sorted(s) for u, s in policy.subs.items()}
                threads = threading.active_count() - threads_before
                ranks = {u: policy.ranks(u) for u in urls}
        finally:
            sources.close()
            await runner.cleanup()
        return url, subscribed, threads, ranks

    url, subscribed, threads, ranks = asyncio.run(main())
    assert subscribed == {url + "/good": [0, 1]}
    assert threads == 2  # the good worker's two ranks
    assert ranks == {url + "/port": (0,), url + "/huge": (0,), url + "/good": [0, 1],
                     url + "/huge-no-events": (0,)}
    lines = sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("kv-events: "))
    assert lines == sorted([
        f"kv-events: {url}/port: KV-event endpoint 'tcp://*:notaport': port 'notaport' is not a number in 1..65535; "
        "routed on the approximate tree (branch=fallback)",
        f"kv-events: {url}/huge: its /get_server_info dp_size 100000 is not a whole number in 1..{MAX_DP_SIZE} (the "
        "most ranks this router subscribes to); routed on the approximate tree (branch=fallback)",
        f"kv-events: {url}/huge-no-events: its /get_server_info dp_size 100000 is not a whole number in "
        f"1..{MAX_DP_SIZE} (the most ranks this router subscribes to); routed on the approximate tree "
        "(branch=fallback)"])
