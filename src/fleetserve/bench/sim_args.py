"""``fleetserve sim-worker``'s flags and their checks, without the simulator.

Kept apart from :mod:`.sim_worker` (which imports torch through the engine's radix cache) so
that ``fleetserve launch --worker-kind sim`` checks its instance flags in its own process, at
no cost, before it starts any instance.
"""

from __future__ import annotations

import argparse

from fleetserve.bench import timing_model
from fleetserve.entrypoints.cli_parser import OneLineParser
from fleetserve.engine.kv_events.config import parse_kv_events_config


def build_parser(exit_on_error: bool = True) -> argparse.ArgumentParser:
    """The flags; ``exit_on_error=False``: a bad value raises ``argparse.ArgumentError`` instead of exiting."""
    p = OneLineParser(prog="fleetserve sim-worker",
                                description="simulated engine workers speaking the engine's HTTP API",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, exit_on_error=exit_on_error)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=31000,
                   help="port of the first worker; 0 (with --num-workers 1): pick a free port, printed at start")
    p.add_argument("--num-workers", type=int, default=1, help="workers hosted by this process, on consecutive ports")
    p.add_argument("--model-name", default="sim-llama-8b", help="model id reported by /v1/models and responses")
    p.add_argument("--tokenizer", choices=("word", "smollm2"), default="word",
                   help="word: one token per word (fast); smollm2: the real tokenizer (slow to load)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="decode steps between streamed chunks (SGLang's --stream-interval); the first token is "
                        "always sent at once")
    p.add_argument("--kv-events-config", default=None,
                   help="publish KV-cache events as vLLM/SGLang do (JSON, see docs/kv_events.md); rank r of "
                        "worker i uses the endpoint ports + i * dp_size + r, data_parallel_rank r")
    p.add_argument("--dp-size", type=int, default=1,
                   help="DP-attention ranks per worker (SGLang's --dp-size), each with its own radix cache and "
                        "KV pool; a request names its rank with routed_dp_rank or X-data-parallel-rank, else "
                        "the ranks take turns")
    p.add_argument("--loads-api", choices=("sglang", "vllm"), default="sglang",
                   help="the load surface a router sees: sglang: /get_load and /v1/loads in SGLang's shapes; "
                        "vllm: as a vLLM server, those routes answer 404 and /metrics adds vLLM's per-rank "
                        "gauges (vllm:num_requests_running, vllm:num_requests_waiting, "
                        "vllm:kv_cache_usage_perc, vllm:cache_config_info)")
    p.add_argument("--access-log", action="store_true",
                   help="log one line per HTTP request (aiohttp's access log, to stderr); off by default")
    timing_model.add_arguments(p)
    return p



MAX_DP_SIZE = 256  # as many DP ranks as a router subscribes to (router/kv_events/sources.py)


def check_args(args: argparse.Namespace) -> str | None:
    """One line naming the first bad flag in ``args`` (parsed by :func:`build_parser`), else None.

    The checks made before anything starts, ports aside (``fleetserve launch`` runs these on
    its instance flags before it starts any instance, and checks the ports itself).
    """
    for flag, value in (("--num-workers", args.num_workers), ("--stream-interval", args.stream_interval),
                        ("--dp-size", args.dp_size)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if args.dp_size > MAX_DP_SIZE:  # an engine per rank in one process: 100000 hung without a word
        return f"--dp-size must be at most {MAX_DP_SIZE} (a simulated engine per rank), got {args.dp_size}"
    try:
        parse_kv_events_config(args.kv_events_config)
        timing_model.from_args(args)
    except ValueError as e:
        return str(e)
    return None
