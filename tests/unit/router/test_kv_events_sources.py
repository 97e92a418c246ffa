"""Where a worker's KV-event streams are: /get_server_info's kv_events_config and the flag."""

import json

import pytest

from fleetserve.router.kv_events.sources import (
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
