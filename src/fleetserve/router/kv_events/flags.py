"""The ``kv_aware`` flags of ``fleetserve router`` (their fields live in :class:`~..config.RouterConfig`).

``--tokenizer-path``, ``--tokenizer-cache-enable-l0``,
``--tokenizer-cache-l0-max-entries`` and ``--dp-aware`` are sglang-router's
flag names (and defaults); ``--router-queue-threshold`` is NVIDIA Dynamo's; the ``--kv-*`` ones
are ours.
"""

from __future__ import annotations

import argparse
import logging
import os


def add_flags(p: argparse.ArgumentParser, d) -> None:
    """Add the kv_aware group to ``p`` with the defaults of the RouterConfig ``d``."""
    g = p.add_argument_group("kv_aware (precise routing on the engines' KV-cache events)")
    g.add_argument("--tokenizer-path", default=d.tokenizer_path,
                   help="kv_aware: tokenizer directory or tokenizer.json, to route on token ids (chat requests "
                        "with its chat template); without it only token-id prompts are routed on events")
    g.add_argument("--tokenizer-cache-enable-l0", action="store_true", default=d.tokenizer_cache_enable_l0,
                   help="kv_aware: remember the token ids of whole texts (exact match), as sglang-router's L0 "
                        "tokenizer cache")
    g.add_argument("--tokenizer-cache-l0-max-entries", type=int, default=d.tokenizer_cache_l0_max_entries,
                   help="kv_aware: texts the L0 tokenizer cache keeps (the oldest goes first)")
    g.add_argument("--kv-events-endpoint", action="append", default=[], metavar="WORKER_URL=tcp://HOST:PORT",
                   help="kv_aware: a worker's KV-event publisher (repeatable); others are found in their "
                        "/get_server_info kv_events_config")
    g.add_argument("--kv-prefill-weight", type=float, default=d.kv_prefill_weight,
                   help="kv_aware: cost per uncached prompt token on a target")
    g.add_argument("--kv-load-weight", type=float, default=d.kv_load_weight,
                   help="kv_aware: cost per in-flight (prompt + decode) token on a target (docs/router.md)")
    g.add_argument("--kv-overflow-weight", type=float, default=d.kv_overflow_weight,
                   help="kv_aware: cost per token of a request's KV (its whole prompt + decode budget) that does "
                        "not fit in a target's KV pool (from /v1/loads) beside the target's load and the cached "
                        "prefixes of this router's in-flight requests there (a shared prefix once), times "
                        "--kv-prefill-weight (0: off; docs/router.md)")
    g.add_argument("--kv-queue-weight", type=float, default=d.kv_queue_weight,
                   help="kv_aware: cost per uncached prompt token still waiting for prefill on a target (this "
                        "router's requests before their first answer bytes; the engine's /v1/loads "
                        "num_waiting_uncached_tokens), times --kv-prefill-weight (0: off; docs/router.md)")
    g.add_argument("--kv-balance-abs-threshold", type=float, default=d.kv_balance_abs_threshold,
                   help="kv_aware: the idle rule moves a request off its lowest-cost target to an idle one only "
                        "when its estimated wait there is longer by more than this many tokens ("
                        "sglang-router's cache_aware balance test, on waits; docs/router.md)")
    g.add_argument("--kv-balance-rel-threshold", type=float, default=d.kv_balance_rel_threshold,
                   help="kv_aware: ... and more than this many times as long (0: the idle rule is off)")
    g.add_argument("--kv-balance-band", type=float, default=d.kv_balance_band,
                   help="kv_aware: the queued-prefill and load terms count only what a target holds over (1 + this) "
                        "x the least loaded target's (default 0.5; 0: off, the plain cost; docs/router.md, the balance band)")
    g.add_argument("--kv-backlog-discount", type=float, default=d.kv_backlog_discount,
                   help="kv_aware: when every target has queued prefill, divide --kv-queue-weight by (1 + this x "
                        "the smallest queued prefill of any target / the mean uncached tokens of a queued request), "
                        "so that a deep, fleet-wide backlog does not move requests off their cache (0: off; "
                        "docs/router.md, the backlog discount)")
    g.add_argument("--router-queue-threshold", type=float, default=d.router_queue_threshold, metavar="F",
                   help="kv_aware: hold requests in the router, first come first served (at most 30 s each), while "
                        "every available worker's queued prefill (this router's requests not yet prefilled, or the "
                        "engine's waiting tokens from /v1/loads) exceeds F x its prefill tokens per step "
                        "(chunked_prefill_size, else max_num_batched_tokens or max_prefill_tokens from "
                        "/get_server_info, else 8192; per DP rank); each is then routed by the cost. NVIDIA "
                        "Dynamo's flag; unset: off (docs/router.md, the router queue)")
    g.add_argument("--kv-speculative-ttl-secs", type=float, default=d.kv_speculative_ttl_secs,
                   help="kv_aware: a routed prompt counts as cached on its target this long, until its events "
                        "arrive (0: off)")
    g.add_argument("--kv-index-max-blocks", type=int, default=d.kv_index_max_blocks,
                   help="kv_aware: (target, block) entries the event index keeps, all workers together")
    g.add_argument("--kv-loads-interval-secs", type=float, default=d.kv_loads_interval_secs,
                   help="kv_aware: poll each worker's GET /v1/loads (SGLang's; for a worker without it, vLLM's "
                        "gauges on GET /metrics) this often and use its token load while fresh (3 intervals); "
                        "0: router-side counts only")
    g.add_argument("--dp-aware", action="store_true",
                   help="kv_aware: each DP rank of a worker is a target; the request names the chosen rank "
                        "(routed_dp_rank in the body, X-data-parallel-rank header)")
    g.add_argument("--no-route-header", action="store_true",
                   help="every policy: do not add x-fleetserve-route (target, rank, branch, predicted cached "
                        "tokens) to answers")


def validate(cfg) -> None:
    """Raise ``ValueError`` naming the flag on a bad kv_aware setting."""
    from .sources import parse_endpoint_flags

    if cfg.kv_prefill_weight < 0 or cfg.kv_load_weight < 0:
        raise ValueError("--kv-prefill-weight and --kv-load-weight must be >= 0")
    if cfg.kv_overflow_weight < 0:
        raise ValueError("--kv-overflow-weight must be >= 0")
    if cfg.kv_queue_weight < 0:
        raise ValueError("--kv-queue-weight must be >= 0")
    if cfg.kv_balance_abs_threshold < 0:
        raise ValueError("--kv-balance-abs-threshold must be >= 0")
    if cfg.kv_balance_rel_threshold != 0 and cfg.kv_balance_rel_threshold < 1:
        raise ValueError("--kv-balance-rel-threshold must be 0 (off) or >= 1")
    if not cfg.kv_balance_band >= 0:
        raise ValueError("--kv-balance-band must be >= 0")
    if not cfg.kv_backlog_discount >= 0:
        raise ValueError("--kv-backlog-discount must be >= 0")
    q = cfg.router_queue_threshold
    if q is not None and not (0 <= q < float("inf")):
        raise ValueError(f"--router-queue-threshold must be a number >= 0 (a fraction of each worker's prefill "
                         f"tokens per step), got {q}")
    if cfg.kv_speculative_ttl_secs < 0:
        raise ValueError("--kv-speculative-ttl-secs must be >= 0")
    if cfg.kv_loads_interval_secs < 0:
        raise ValueError("--kv-loads-interval-secs must be >= 0")
    if cfg.kv_index_max_blocks < 1:
        raise ValueError("--kv-index-max-blocks must be >= 1")
    if cfg.tokenizer_cache_l0_max_entries < 1:
        raise ValueError("--tokenizer-cache-l0-max-entries must be >= 1")
    parse_endpoint_flags(cfg.kv_events_endpoint)
    if cfg.tokenizer_path is not None:
        path = os.path.expanduser(cfg.tokenizer_path)
        tok = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(tok):
            raise ValueError(f"--tokenizer-path {cfg.tokenizer_path}: no tokenizer.json there")
        if tok.lower().endswith(".gguf"):  # the engine reads one; the router (no transformers) cannot
            raise ValueError(f"--tokenizer-path {cfg.tokenizer_path}: a .gguf file; give a directory with the "
                             "model's tokenizer.json (fleetserve launch --policy kv_aware passes the built-in "
                             "model's itself; python -c 'from fleetserve.models.tokenizer import tokenizer_dir; "
                             "print(tokenizer_dir(\"MODEL.gguf\"))' converts a GGUF's once and prints where)")


def make_kv_aware(cfg):
    """The :class:`~.policy.KvAwarePolicy` of a RouterConfig (``None``: defaults)."""
    from .policy import KvAwarePolicy
    from .tokenize import RouterTokenizer

    if cfg is None:
        return KvAwarePolicy()
    l0 = cfg.tokenizer_cache_l0_max_entries if cfg.tokenizer_cache_enable_l0 else 0
    try:
        tok = RouterTokenizer(cfg.tokenizer_path, l0_max_entries=l0) if cfg.tokenizer_path else None
    except ValueError as e:  # e.g. a file that is no tokenizer.json
        raise ValueError(f"--tokenizer-path {cfg.tokenizer_path}: {e}") from None
    if cfg.kv_overflow_weight and not cfg.kv_loads_interval_secs:  # the pool sizes come from /v1/loads
        logging.getLogger("fleetserve.router").warning(
            "--kv-overflow-weight %g has no effect with --kv-loads-interval-secs 0: the pool sizes it needs come "
            "from the workers' GET /v1/loads", cfg.kv_overflow_weight)
    if cfg.router_queue_threshold is not None and not cfg.kv_loads_interval_secs:
        logging.getLogger("fleetserve.router").warning(
            "--router-queue-threshold with --kv-loads-interval-secs 0: a non-streamed request counts as queued "
            "prefill until its whole answer arrives (the engines' /v1/loads tell when it was admitted), so the "
            "router queue holds requests while the workers only decode")
    if tok is not None and tok.template_error:  # said once here, not once per chat request
        logging.getLogger("fleetserve.router").warning(
            "--tokenizer-path %s: %s; chat requests are routed on their text (branch=fallback reason=text)",
            cfg.tokenizer_path, tok.template_error)
    return KvAwarePolicy(cfg.kv_prefill_weight, cfg.kv_load_weight, cfg.kv_speculative_ttl_secs,
                         cfg.kv_index_max_blocks, cfg.dp_aware, tok, route_header=not cfg.no_route_header,
                         overflow_weight=cfg.kv_overflow_weight, queue_weight=cfg.kv_queue_weight,
                         balance_abs_threshold=cfg.kv_balance_abs_threshold,
                         balance_rel_threshold=cfg.kv_balance_rel_threshold,
                         balance_band=cfg.kv_balance_band, backlog_discount=cfg.kv_backlog_discount,
                         router_queue_threshold=cfg.router_queue_threshold)
