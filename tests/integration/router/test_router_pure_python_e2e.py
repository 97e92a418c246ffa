"""The router run from its source (``FLEETSERVE_PURE_PYTHON=1``), as on a machine without a C compiler:
the rest of the suite runs the compiled hot path (router/compiled.py), so this keeps the source path
proven end to end: kv_aware in front of a simulated worker that publishes KV events."""

import json
import re
import time
import urllib.request

import pytest

from fleetserve.router import compiled


def complete(router: str, prompt: str, stream: bool) -> tuple[str, int]:
    """The route header and the cached tokens the worker reported, for one completion."""
    body = {"prompt": prompt, "max_tokens": 4, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(router + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        route, raw = r.headers["x-fleetserve-route"], r.read().decode()
    if stream:
        chunks = [json.loads(ln[6:]) for ln in raw.splitlines() if ln.startswith("data: {")]
        usage = [c["usage"] for c in chunks if c.get("usage")][-1]
    else:
        usage = json.loads(raw)["usage"]
    return route, (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def exact(router: str, worker: str) -> bool | None:
    """Whether the router trusts ``worker``'s KV-event stream (None: not subscribed yet)."""
    with urllib.request.urlopen(router + "/metrics", timeout=10) as r:
        text = r.read().decode()
    if f'state="fallback",worker="{worker}"' not in text:
        return None
    return f'fleetserve_router_kv_stream_state{{dp_rank="0",state="exact",worker="{worker}"}} 1.0' in text


def wait(check, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_kv_aware_routes_on_events_when_run_from_source(procs, monkeypatch):
    from fleetserve.models.tokenizer import tokenizer_dir

    monkeypatch.setenv(compiled.PURE_ENV, "1")  # the router process inherits it
    sims = [procs.sim_with_events("--tokenizer", "smollm2") for _ in range(2)]
    router, p = procs.router(sims, "--policy", "kv_aware", "--tokenizer-path", tokenizer_dir(), "--log-level", "info")
    wait(lambda: all(exact(router, s) is not None for s in sims), "no subscription")
    time.sleep(0.5)  # the SUB sockets connect (a batch published before that is not seen)
    prefix = "You answer questions about lighthouses, tides and the weather at sea. " * 12
    route, _ = complete(router, prefix + "First question?", stream=False)
    first = re.search(r"target=(\S+);", route).group(1)
    wait(lambda: exact(router, first), "the stream never became exact")
    route, cached = complete(router, prefix + "Second question?", stream=True)
    assert re.search(r"target=(\S+);", route).group(1) == first, route
    assert "branch=exact" in route, route
    predicted = int(re.search(r"cached_tokens=(\d+)", route).group(1))
    assert predicted > 100 and cached == predicted, (route, cached)
    p.log.seek(0)
    log = p.log.read().decode()
    assert "hot path compiled (Cython): 0 of " in log, log[-2000:]
