"""``fleetserve bench``: drive a workload against an OpenAI-compatible URL and report.

Example::

    fleetserve bench --base-url http://127.0.0.1:30000 --workload shared_prefix \\
        --num-groups 8 --prompts-per-group 4 --request-rate 4 --output-json out.json --output-png out.png

See :mod:`fleetserve.bench.workloads` for the workloads, :mod:`fleetserve.bench.client`
for what is measured and :mod:`fleetserve.bench.report` for the definitions.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys

import aiohttp

from fleetserve.bench import report, worker_stats, workloads
from fleetserve.entrypoints.cli_parser import OneLineParser
from fleetserve.bench.client import auth_headers, run_requests


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="fleetserve bench", description="Workload benchmark for OpenAI-compatible servers.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="router or worker URL")
    p.add_argument("--api", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions (messages) or /v1/completions (one prompt string)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or None,
                   help="sent as 'Authorization: Bearer <key>' on every request (and /flush_cache); "
                        "default: $OPENAI_API_KEY if set, else no header")
    p.add_argument("--model", default=None, help="model field of the requests; None leaves it out")
    p.add_argument("--workload", choices=workloads.WORKLOADS, default="shared_prefix",
                   help="who shares which prefix: groups with one system prompt, growing conversations, or none")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same requests and arrival times")
    g = p.add_argument_group("shared_prefix")
    g.add_argument("--num-groups", type=int, default=64, help="groups, each with its own system prompt")
    g.add_argument("--prompts-per-group", type=int, default=16, help="requests sharing one system prompt")
    g.add_argument("--system-prompt-len", type=int, default=None,
                   help="tokens (words) of the shared system prompt; None means 2048 for shared_prefix, 0 for multi_turn")
    g.add_argument("--question-len", type=int, default=128, help="tokens (words) of each request's own question")
    g.add_argument("--output-len", type=int, default=256, help="max_tokens of every request")
    g = p.add_argument_group("multi_turn")
    g.add_argument("--num-conversations", type=int, default=64, help="conversations, interleaved")
    g.add_argument("--num-turns", type=int, default=8, help="turns per conversation, each sent after the last answer")
    g.add_argument("--multi-turn-replies", choices=workloads.MULTI_TURN_REPLIES, default="real",
                   help="assistant turns of the history: real: the model's own answer to the previous turn, sent "
                        "back as a chat client does; synthetic: --output-len random words fixed by --seed (every "
                        "run sends the same requests)")
    g = p.add_argument_group("random")
    g.add_argument("--num-prompts", type=int, default=1024, help="independent prompts")
    g.add_argument("--random-input-len", type=int, default=2176, help="tokens (words) per prompt")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT = latency)")
    g.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (outputs may be shorter)")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="divide measured times by this (match sim-worker --time-scale)")
    g.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout, seconds")
    g = p.add_argument_group("workers and output")
    g.add_argument("--worker-urls", nargs="*", default=[],
                   help="worker URLs behind the router: per-worker figures from /metrics deltas when responses "
                        "do not name their worker")
    g.add_argument("--flush-cache", action="store_true", help="POST /flush_cache to every worker URL before the run")
    g.add_argument("--output-json", default=None, help="write the summary and per-request records here")
    g.add_argument("--output-png", default=None, help="write TTFT/ITL/latency charts here")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def workload_from_args(args: argparse.Namespace) -> list[workloads.BenchRequest]:
    return workloads.build(
        args.workload, num_groups=args.num_groups, prompts_per_group=args.prompts_per_group,
        system_prompt_len=(args.system_prompt_len if args.system_prompt_len is not None
                           else (2048 if args.workload == "shared_prefix" else 0)),
        question_len=args.question_len, output_len=args.output_len, num_conversations=args.num_conversations,
        num_turns=args.num_turns, num_prompts=args.num_prompts, input_len=args.random_input_len, seed=args.seed,
        replies=args.multi_turn_replies)


async def flush_workers(urls: list[str], api_key: str | None = None) -> dict[str, int]:
    """POST ``/flush_cache`` to each URL; ``{url: status}`` (0 on connection failure)."""
    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), headers=auth_headers(api_key)) as s:
        for u in urls:
            try:
                async with s.post(u.rstrip("/") + "/flush_cache") as r:
                    out[u] = r.status
            except (aiohttp.ClientError, asyncio.TimeoutError):
                out[u] = 0
    return out


async def run_bench(args: argparse.Namespace) -> tuple[dict, list]:
    """Build the workload, run it, and return ``(summary, results)``."""
    reqs = workload_from_args(args)
    if args.flush_cache and args.worker_urls:
        await flush_workers(args.worker_urls, args.api_key)
    before = await worker_stats.snapshot(args.worker_urls) if args.worker_urls else {}
    results, duration = await run_requests(
        args.base_url, reqs, api=args.api, model=args.model, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, seed=args.seed, stream=not args.no_stream,
        ignore_eos=not args.no_ignore_eos, time_scale=args.time_scale, progress=not args.disable_tqdm,
        timeout_s=args.timeout, api_key=args.api_key)
    after = await worker_stats.snapshot(args.worker_urls) if args.worker_urls else {}
    meta = {"workload": args.workload, "url": args.base_url, "api": args.api, "num_requests": len(reqs),
            "request_rate": args.request_rate, "max_concurrency": args.max_concurrency, "seed": args.seed,
            "time_scale": args.time_scale}
    if args.workload == "multi_turn":
        meta["multi_turn_replies"] = args.multi_turn_replies
    summary = report.summarize(results, duration, worker_stats.delta(before, after) if after else None, meta)
    return summary, results


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.request_rate > 0:  # also rejects NaN
        parser.error(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if args.num_prompts < 1:
        parser.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    summary, results = asyncio.run(run_bench(args))
    report.print_table(summary)
    if args.output_json:
        report.write_json(summary, results, args.output_json)
    if args.output_png:
        report.plot_png(summary, results, args.output_png)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
