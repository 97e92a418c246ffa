"""Router settings and their command-line flags.

Flag names and defaults follow ``python -m sglang_router.launch_router``
(sglang-router 0.3.2, as printed by its ``--help``), so that one command line
works with either router.  Differences, all documented in docs/router.md:

* ``--prometheus-port`` has no default: ``/metrics`` is always served on the
  main port, and a second listener opens only when the flag is given.
* ``--worker-startup-check-interval`` defaults to 1 s (sglang-router: 30 s).
* ``--cache-miss-fallback`` is ours: ``least_loaded`` (default) or
  ``smallest_tree`` (the older sglang-router behaviour on a cache miss).
* ``--routing-key-from-user`` and ``--sticky-max-sessions`` are ours (smg's
  sticky map has no size bound and reads no ``user`` field).
* ``--bounded-load-factor`` is ours: 0 (default, sglang-router's thresholds)
  or ``c >= 1`` for cache-aware routing under a bounded-load cap (see
  :class:`fleetserve.router.policies.CacheAwarePolicy`).
* ``--max-concurrent-requests`` and its queue flags follow smg's token bucket
  (:mod:`.admission`), except that ``--rate-limit-tokens-per-second 0`` means
  no refill; ``--drain-timeout-secs`` is ours (:mod:`.drain`).
* sglang-router flags with no counterpart here are refused with one line
  (:mod:`.compat`), and every start-up error is one line naming the flag.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields

from .kv_events import flags as kv_flags
from .workers import normalize_url

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "kv_aware")
CACHE_MISS_FALLBACKS = ("least_loaded", "smallest_tree")
DEFAULT_QUEUE_SIZE = 100  # smg / sglang-router 0.3.2 --queue-size default
DEFAULT_QUEUE_TIMEOUT_SECS = 60.0  # smg / sglang-router 0.3.2 --queue-timeout-secs default


@dataclass
class RouterConfig:
    """Every router setting.  Times in seconds unless the name says ``_ms``; sizes in bytes/chars."""

    host: str = "127.0.0.1"  # sglang-router's default; 0.0.0.0 opens the admin routes to the network
    port: int = 30000
    worker_urls: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_secs: float = 60.0
    max_tree_size: int = 2**26  # characters, summed over workers
    cache_miss_fallback: str = "least_loaded"
    bounded_load_factor: float = 0.0
    bounded_load_slack: int = 4
    max_payload_size: int = 512 * 1024 * 1024  # bytes
    request_timeout_secs: float = 1800.0
    shutdown_grace_period_secs: float = 180.0
    worker_startup_timeout_secs: float = 1800.0
    worker_startup_check_interval: float = 1.0
    health_check_interval_secs: float = 60.0
    health_check_timeout_secs: float = 5.0
    health_check_endpoint: str = "/health"
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    disable_health_check: bool = False
    retry_max_retries: int = 5
    retry_initial_backoff_ms: float = 50.0
    retry_max_backoff_ms: float = 30000.0
    retry_backoff_multiplier: float = 1.5
    retry_jitter_factor: float = 0.2
    disable_retries: bool = False
    max_migrations: int = 1
    cb_failure_threshold: int = 10
    cb_success_threshold: int = 3
    cb_timeout_duration_secs: float = 60.0
    cb_window_duration_secs: float = 120.0
    disable_circuit_breaker: bool = False
    sticky_sessions: bool = False
    routing_key_headers: list[str] = field(default_factory=lambda: ["x-smg-routing-key"])  # smg's default
    routing_key_from_user: bool = False
    sticky_idle_secs: float = 14400.0  # smg's --max-idle-secs default (4 h)
    sticky_max_sessions: int = 100_000
    prometheus_host: str = "127.0.0.1"
    prometheus_port: int | None = None
    log_level: str = "info"
    # admission control (smg / sglang-router flags; see admission.py)
    max_concurrent_requests: int = -1  # -1: off
    queue_size: int | None = None  # None: the default, 100 (as smg)
    queue_timeout_secs: float | None = None  # None: the default, 60 s (as smg)
    rate_limit_tokens_per_second: float | None = None  # None: N tokens/s (as smg); 0: no refill
    api_key: str | None = None  # the router's own key (auth.py)
    drain_timeout_secs: float = 180.0  # POST /drain_worker: longest wait for in-flight requests (ours)

    @property
    def effective_queue_size(self) -> int:
        return DEFAULT_QUEUE_SIZE if self.queue_size is None else self.queue_size

    @property
    def effective_queue_timeout_secs(self) -> float:
        return DEFAULT_QUEUE_TIMEOUT_SECS if self.queue_timeout_secs is None else self.queue_timeout_secs
    # kv_aware (flags in kv_events/flags.py)
    tokenizer_path: str | None = None
    kv_events_endpoint: list[str] = field(default_factory=list)
    kv_prefill_weight: float = 1.0
    kv_load_weight: float = 0.1  # measured on sim-workers: docs/benchmarks.md "routing-kv"
    kv_overflow_weight: float = 0.0  # off: it did not help on the sims (docs/router.md, the cost)
    kv_queue_weight: float = 0.5  # a queued prefill token costs half an uncached one of the request (docs/router.md)
    kv_balance_abs_threshold: float = 160.0  # the idle rule: wait gap in tokens (docs/router.md; kv_events/policy.py)
    kv_balance_rel_threshold: float = 1.2  # the idle rule: wait ratio (0: off)
    kv_balance_band: float = 0.5  # balance terms count only the excess over (1 + band) x the lowest (0: off)
    kv_backlog_discount: float = 1.0  # queue weight / (1 + this x least queued / prompt) (0: off)
    router_queue_threshold: float | None = None  # Dynamo's flag: hold requests while every target is busy (off)
    kv_speculative_ttl_secs: float = 2.0
    kv_index_max_blocks: int = 1 << 20
    kv_loads_interval_secs: float = 1.0
    tokenizer_cache_enable_l0: bool = False  # sglang-router's flag and default
    tokenizer_cache_l0_max_entries: int = 10000  # sglang-router's flag and default
    dp_aware: bool = False
    no_route_header: bool = False

    def validate(self) -> None:
        """Raise ``ValueError`` on an out-of-range setting."""
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {POLICIES}")
        if self.cache_miss_fallback not in CACHE_MISS_FALLBACKS:
            raise ValueError(f"unknown cache miss fallback {self.cache_miss_fallback!r}")
        if self.bounded_load_factor != 0.0 and not self.bounded_load_factor >= 1.0:
            raise ValueError("--bounded-load-factor must be 0 (off) or >= 1")
        if self.bounded_load_slack < 0:
            raise ValueError("--bounded-load-slack must be >= 0")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("--cache-threshold must be in [0, 1]")
        if self.max_tree_size < 0 or self.max_payload_size <= 0:
            raise ValueError("--max-tree-size must be >= 0 and --max-payload-size > 0")
        if not 0.0 <= self.retry_jitter_factor <= 1.0:
            raise ValueError("--retry-jitter-factor must be in [0, 1]")
        for url in self.worker_urls:
            normalize_url(url)  # raises ValueError with the reason
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.prometheus_port is not None and not 0 <= self.prometheus_port <= 65535:
            raise ValueError(f"--prometheus-port must be in 0..65535, got {self.prometheus_port}")
        for name in ("request_timeout_secs", "health_check_interval_secs", "health_check_timeout_secs",
                     "worker_startup_timeout_secs", "worker_startup_check_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.retry_max_retries < 1:
            raise ValueError("--retry-max-retries must be >= 1 (it counts attempts)")
        if self.max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0 (0: off), got {self.max_migrations}")
        self._validate_sessions()
        self._validate_admission()

    def _validate_sessions(self) -> None:
        from .sessions import check_header_name

        if not self.routing_key_headers:
            raise ValueError("--routing-key-headers needs at least one header name")
        for name in self.routing_key_headers:
            check_header_name(name)  # raises ValueError naming the flag
        if not self.sticky_idle_secs >= 0:
            raise ValueError(f"--max-idle-secs must be >= 0 (0 = never), got {self.sticky_idle_secs}")
        if self.sticky_max_sessions < 1:
            raise ValueError(f"--sticky-max-sessions must be >= 1, got {self.sticky_max_sessions}")

    def _validate_admission(self) -> None:
        n = self.max_concurrent_requests
        if n != -1 and n < 1:
            raise ValueError(f"--max-concurrent-requests must be -1 (off) or >= 1, got {n}")
        if self.queue_size is not None and self.queue_size < 0:
            raise ValueError(f"--queue-size must be >= 0 (0: no queue, 429 at once), got {self.queue_size}")
        if self.queue_timeout_secs is not None and not self.queue_timeout_secs > 0:
            raise ValueError(f"--queue-timeout-secs must be > 0, got {self.queue_timeout_secs:g}")
        rate = self.rate_limit_tokens_per_second
        if rate is not None and not rate >= 0:
            raise ValueError(f"--rate-limit-tokens-per-second must be >= 0 (0: no refill), got {rate:g}")
        if n == -1:
            for flag, value in (("--queue-size", self.queue_size), ("--queue-timeout-secs", self.queue_timeout_secs),
                                ("--rate-limit-tokens-per-second", rate)):
                if value is not None:
                    raise ValueError(f"{flag} needs --max-concurrent-requests N (N >= 1): without a limit "
                                     f"nothing is queued or rate limited")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        if not self.drain_timeout_secs > 0:
            raise ValueError(f"--drain-timeout-secs must be > 0, got {self.drain_timeout_secs:g}")
        kv_flags.validate(self)

    @property
    def max_attempts(self) -> int:
        """Attempts per request: ``--retry-max-retries`` (sglang counts attempts), 1 with ``--disable-retries``."""
        return 1 if self.disable_retries else self.retry_max_retries


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the flag (exit code 2), without the usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def finite_float(text: str) -> float:
    """argparse type of every float flag of the router: ``nan`` / ``inf`` are refused (they would
    pass every ``>= 0`` check and then break a comparison or a timer)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``fleetserve router`` argument parser."""
    d = RouterConfig()
    p = _Parser(
        prog="fleetserve router",
        description="Cache-aware HTTP load balancer for LLM workers (flags follow sglang_router.launch_router).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("workers")
    g.add_argument("--host", default=d.host,
                   help="address to listen on; without --api-key the admin routes (/add_worker, /remove_worker, "
                        "/flush_cache) have no auth, so give 0.0.0.0 only with --api-key or on a trusted network")
    g.add_argument("--port", type=int, default=d.port, help="port to listen on")
    g.add_argument("--worker-urls", nargs="*", default=[], help="worker base URLs (space separated)")
    g.add_argument("--worker-startup-timeout-secs", type=float, default=d.worker_startup_timeout_secs,
                   help="how long to wait for every worker's health check at start-up")
    g.add_argument("--worker-startup-check-interval", type=float, default=d.worker_startup_check_interval,
                   help="seconds between start-up health probes")
    g = p.add_argument_group("routing policy")
    g.add_argument("--policy", choices=POLICIES, default=d.policy,
                   help="how a worker is chosen; cache_aware, round_robin, random, power_of_two as sglang-router's "
                        "(same default), kv_aware is ours (docs/router.md)")
    g.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                   help="cache_aware: route to the matching worker if matched/len(text) exceeds this")
    g.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                   help="cache_aware: leave the matching worker if its load - min_load exceeds this "
                        "(and the relative test holds)")
    g.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
                   help="cache_aware: leave the matching worker if its load > min_load * this "
                        "(and the absolute test holds)")
    g.add_argument("--eviction-interval-secs", type=float, default=d.eviction_interval_secs,
                   help="cache_aware: seconds between tree evictions")
    g.add_argument("--max-tree-size", type=int, default=d.max_tree_size,
                   help="cache_aware: characters kept in the tree, summed over all workers")
    g.add_argument("--cache-miss-fallback", choices=CACHE_MISS_FALLBACKS, default=d.cache_miss_fallback,
                   help="cache_aware: where a cache miss goes")
    g.add_argument("--bounded-load-factor", type=float, default=d.bounded_load_factor,
                   help="cache_aware: 0 = sglang-router's balance thresholds; c >= 1 = only workers whose load "
                        "stays within c x the average (+ the slack) are candidates (replaces the thresholds)")
    g.add_argument("--bounded-load-slack", type=int, default=d.bounded_load_slack,
                   help="cache_aware with --bounded-load-factor: requests allowed above the cap")
    g.add_argument("--max-payload-size", type=int, default=d.max_payload_size, help="largest request body, bytes")
    g.add_argument("--request-timeout-secs", type=float, default=d.request_timeout_secs,
                   help="upper bound on one upstream request")
    g.add_argument("--shutdown-grace-period-secs", type=float, default=d.shutdown_grace_period_secs,
                   help="on SIGTERM/SIGINT, stop accepting and wait this long for requests in flight")
    g = p.add_argument_group("health checks")
    g.add_argument("--health-check-interval-secs", type=float, default=d.health_check_interval_secs,
                   help="seconds between two rounds of periodic health checks (as sglang-router's, same default)")
    g.add_argument("--health-check-timeout-secs", type=float, default=d.health_check_timeout_secs,
                   help="a health check not answered 2xx within this many seconds fails (as sglang-router's, "
                        "same default)")
    g.add_argument("--health-check-endpoint", default=d.health_check_endpoint,
                   help="path each health check GETs on a worker (as sglang-router's, same default)")
    g.add_argument("--health-failure-threshold", type=int, default=d.health_failure_threshold,
                   help="consecutive failed checks before a worker is marked unhealthy")
    g.add_argument("--health-success-threshold", type=int, default=d.health_success_threshold,
                   help="consecutive good checks before an unhealthy worker is used again")
    g.add_argument("--disable-health-check", action="store_true",
                   help="no start-up wait and no periodic checks")
    g = p.add_argument_group("retries")
    g.add_argument("--retry-max-retries", type=int, default=d.retry_max_retries,
                   help="attempts per request, the first one included")
    g.add_argument("--retry-initial-backoff-ms", type=float, default=d.retry_initial_backoff_ms,
                   help="wait before the first retry, ms (as sglang-router's, same default)")
    g.add_argument("--retry-max-backoff-ms", type=float, default=d.retry_max_backoff_ms,
                   help="longest wait before a retry, ms (as sglang-router's, same default)")
    g.add_argument("--retry-backoff-multiplier", type=float, default=d.retry_backoff_multiplier,
                   help="each retry's wait is the previous one's times this (as sglang-router's, same default)")
    g.add_argument("--retry-jitter-factor", type=float, default=d.retry_jitter_factor,
                   help="each wait is scaled by a random 1 +- this (as sglang-router's, same default)")
    g.add_argument("--disable-retries", action="store_true",
                   help="one attempt per request, no retry on another worker (as sglang-router's)")
    g.add_argument("--max-migrations", "--migration-limit", dest="max_migrations", type=int,
                   default=d.max_migrations,
                   help="times a stream whose worker fails after it started is continued on another worker "
                        "(0: off; see docs/router.md, Request migration)")
    g = p.add_argument_group("circuit breaker")
    g.add_argument("--cb-failure-threshold", type=int, default=d.cb_failure_threshold,
                   help="consecutive failures (within the window) that open a worker's circuit")
    g.add_argument("--cb-success-threshold", type=int, default=d.cb_success_threshold,
                   help="successes in half-open state that close it again")
    g.add_argument("--cb-timeout-duration-secs", type=float, default=d.cb_timeout_duration_secs,
                   help="time an open circuit waits before letting a trial request through")
    g.add_argument("--cb-window-duration-secs", type=float, default=d.cb_window_duration_secs,
                   help="failures older than this no longer count")
    g.add_argument("--disable-circuit-breaker", action="store_true",
                   help="never open a worker's circuit: failures only count for the health checks "
                        "(as sglang-router's)")
    g = p.add_argument_group("session affinity (flag names as smg's)")
    g.add_argument("--sticky-sessions", "--routing-key-override", dest="sticky_sessions", action="store_true",
                   help="requests with a session key go to the worker their session used last, while it is "
                        "available and within the balance thresholds; else the policy decides")
    g.add_argument("--routing-key-headers", nargs="+", default=list(d.routing_key_headers), metavar="NAME",
                   help="headers holding the session key, in order; the first valid value wins")
    g.add_argument("--routing-key-from-user", action="store_true",
                   help="without a key header, use the request body's OpenAI 'user' field as the key")
    g.add_argument("--max-idle-secs", "--sticky-key-idle-secs", dest="sticky_idle_secs", type=float,
                   default=d.sticky_idle_secs, help="forget a session unused this long (0 = never)")
    g.add_argument("--sticky-max-sessions", type=int, default=d.sticky_max_sessions,
                   help="sessions remembered at most; the least recently used is dropped first")
    g = p.add_argument_group("metrics and logs")
    g.add_argument("--prometheus-host", default=d.prometheus_host,
                   help="address of the --prometheus-port listener (independent of --host)")
    g.add_argument("--prometheus-port", type=int, default=None,
                   help="extra listener for /metrics (it is always on the main port too)")
    g.add_argument("--log-level", choices=("debug", "info", "warn", "warning", "error"), default=d.log_level,
                   help="the router's log level (as sglang-router's, same default)")
    g = p.add_argument_group("rate limiting (smg / sglang-router semantics)")
    g.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
                   help="token bucket capacity for the inference routes; -1 = no admission control")
    g.add_argument("--queue-size", type=int, default=None,
                   help=f"requests that may wait for a token (FIFO; 0 = 429 at once) (default: {DEFAULT_QUEUE_SIZE})"
                        "%(default).0s")
    g.add_argument("--queue-timeout-secs", type=float, default=None,
                   help=f"a queued request waiting this long gets 408 (default: {DEFAULT_QUEUE_TIMEOUT_SECS:g})"
                        "%(default).0s")
    g.add_argument("--rate-limit-tokens-per-second", type=float, default=None,
                   help="token refill rate; unset = --max-concurrent-requests per second; 0 = no refill "
                        "(a pure concurrency limit)%(default).0s")
    g = p.add_argument_group("auth and drain")
    g.add_argument("--api-key", default=None,
                   help="the router's own key: inference and admin routes need 'Authorization: Bearer KEY' "
                        "(401 otherwise); /health, /liveness, /readiness, /health_generate, /metrics stay open. "
                        "Also the workers' key, as sglang-router's: the router's own requests to them (health "
                        "checks, /get_server_info, /v1/loads, /get_load, /flush_cache) send it")
    g.add_argument("--drain-timeout-secs", type=float, default=d.drain_timeout_secs,
                   help="POST /drain_worker: longest wait for the worker's in-flight requests before it is removed")
    from .compat import add_unsupported  # last: skips any flag defined above
    add_unsupported(p)
    kv_flags.add_flags(p, d)
    for action in p._actions:  # every float flag, ours and kv_aware's
        if action.type is float:
            action.type = finite_float
    return p


def parse_args(argv: list[str]) -> RouterConfig:
    """Parse ``argv`` into a validated :class:`RouterConfig`; argparse exits with code 2 on bad flags."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    cfg = RouterConfig(**{f.name: getattr(ns, f.name) for f in fields(RouterConfig)})
    try:
        cfg.validate()
    except ValueError as e:
        parser.error(str(e))
    return cfg
