"""The ``/get_server_info`` fields a router reads to find an instance's KV-event streams and its
prefill budget (``--router-queue-threshold``).

Shared by ``fleetserve serve`` (``entrypoints/http/admin.py``) and
``fleetserve sim-worker`` so both answer in one shape. A router such as ours
(``router/kv_events/sources.py``) or SGLang's reads ``kv_events_config`` (the
``--kv-events-config`` JSON *text*, as SGLang's ``server_args`` holds it),
replaces a wildcard host by the worker's host, and subscribes to DP rank
``r`` at the endpoint's port ``+ r`` for ``r < dp_size``.
"""

from __future__ import annotations

import json
from typing import Any


def router_discovery_fields(args: dict[str, Any]) -> dict[str, Any]:
    """``{"page_size", "kv_events_config", "dp_size", "enable_dp_attention", "chunked_prefill_size",
    "max_prefill_tokens"}`` from server args.

    Args:
        args: the server's arguments as a dict (missing keys take the defaults).

    Returns:
        ``page_size``: int tokens per KV page (1 without the flag);
        ``kv_events_config``: str JSON text or ``None`` (an already parsed dict is
        dumped back to text); ``dp_size``: int; ``enable_dp_attention``: bool;
        ``chunked_prefill_size`` and ``max_prefill_tokens``: int tokens of prefill per step, or
        ``None`` when the args have none (a router's ``--router-queue-threshold`` budget,
        ``router/kv_events/router_queue.py``).  Under DP attention ``chunked_prefill_size`` is one
        rank's, the flag's value divided by ``dp_size``: SGLang's ``server_args`` holds it so
        divided, and each of our ranks prefills that much (``distributed/dp_attention.py``).
    """
    dp = int(args.get("dp_size") or 1)
    chunk = args.get("chunked_prefill_size")
    if args.get("enable_dp_attention") and dp > 1 and type(chunk) is int and chunk > 0:
        chunk = max(1, chunk // dp)
    kv = args.get("kv_events_config")
    if kv is not None and not isinstance(kv, str):  # parsed by the flag's owner: report it as JSON text
        kv = json.dumps(kv)
    return {
        "page_size": int(args.get("page_size") or 1),
        "kv_events_config": kv,
        "dp_size": dp,
        "enable_dp_attention": bool(args.get("enable_dp_attention", False)),
        "chunked_prefill_size": chunk,
        "max_prefill_tokens": args.get("max_prefill_tokens"),
    }
