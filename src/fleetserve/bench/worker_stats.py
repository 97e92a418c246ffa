"""Per-worker cache figures from the workers' own ``/metrics`` counters.

Used when responses do not say which worker served them (a real engine behind
a router that strips headers): snapshot every worker's Prometheus counters
before and after the run; the differences give each worker's requests,
prompt tokens and cached prompt tokens during the run. Counter names are
matched by suffix after an optional ``prefix:`` (``fleetserve:cached_tokens_total``,
``sglang:cached_tokens_total``), summed over label sets. Only valid when
nothing else sends traffic to the workers during the run.
"""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

KEYS = ("num_requests", "prompt_tokens", "cached_tokens", "generation_tokens")


def parse_counters(text: str) -> dict[str, float]:
    """``{key: value}`` for the :data:`KEYS` counters found in Prometheus exposition ``text``."""
    out = {k: 0.0 for k in KEYS}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name.split(":", 1)[-1]
            if not name.endswith("_total"):
                continue
            key = name[: -len("_total")]
            if key in out:
                out[key] += float(s.value)
    return out


async def snapshot(urls: list[str], timeout_s: float = 10.0) -> dict[str, dict[str, float] | None]:
    """``{url: counters}`` from each worker's ``/metrics`` (``None`` where it failed)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        async def one(u: str):
            try:
                async with s.get(u.rstrip("/") + "/metrics") as r:
                    return parse_counters(await r.text()) if r.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return None
        vals = await asyncio.gather(*(one(u) for u in urls))
    return dict(zip(urls, vals))


def delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per-worker differences ``after - before`` (workers missing from either side are left out)."""
    out = {}
    for u, a in after.items():
        b = before.get(u)
        if a is None or b is None:
            continue
        out[u] = {k: a[k] - b[k] for k in KEYS}
    return out
