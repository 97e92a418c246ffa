"""Router settings and their command-line flags.

Flag names and defaults follow ``python -m sglang_router.launch_router``
(sglang-router 0.3.2, as printed by its ``--help``), so that one command line
works with either router.  Differences, all documented in docs/router.md:

* ``--prometheus-port`` has no default: ``/metrics`` is always served on the
  main port, and a second listener opens only when the flag is given.
* ``--worker-startup-check-interval`` defaults to 1 s (sglang-router: 30 s).
* ``--cache-miss-fallback`` is ours: ``least_loaded`` (default) or
  ``smallest_tree`` (the older sglang-router behaviour on a cache miss).
* ``--bounded-load-factor`` is ours: 0 (default, sglang-router's thresholds)
  or ``c >= 1`` for cache-aware routing under a bounded-load cap (see
  :class:`fleetserve.router.policies.CacheAwarePolicy`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from .kv_events import flags as kv_flags
from .workers import normalize_url

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "kv_aware")
CACHE_MISS_FALLBACKS = ("least_loaded", "smallest_tree")


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
    cb_failure_threshold: int = 10
    cb_success_threshold: int = 3
    cb_timeout_duration_secs: float = 60.0
    cb_window_duration_secs: float = 120.0
    disable_circuit_breaker: bool = False
    prometheus_host: str = "127.0.0.1"
    prometheus_port: int | None = None
    log_level: str = "info"
    # kv_aware (flags in kv_events/flags.py)
    tokenizer_path: str | None = None
    kv_events_endpoint: list[str] = field(default_factory=list)
    kv_prefill_weight: float = 1.0
    kv_load_weight: float = 1.0
    kv_speculative_ttl_secs: float = 2.0
    kv_index_max_blocks: int = 1 << 20
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
        kv_flags.validate(self)

    @property
    def max_attempts(self) -> int:
        """Attempts per request: ``--retry-max-retries`` (sglang counts attempts), 1 with ``--disable-retries``."""
        return 1 if self.disable_retries else self.retry_max_retries


def build_parser() -> argparse.ArgumentParser:
    """The ``fleetserve router`` argument parser."""
    d = RouterConfig()
    p = argparse.ArgumentParser(
        prog="fleetserve router",
        description="Cache-aware HTTP load balancer for LLM workers (flags follow sglang_router.launch_router).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("workers")
    g.add_argument("--host", default=d.host,
                   help="address to listen on; the admin routes (/add_worker, /remove_worker, /flush_cache) have "
                        "no auth, so give 0.0.0.0 only on a trusted network")
    g.add_argument("--port", type=int, default=d.port, help="port to listen on")
    g.add_argument("--worker-urls", nargs="*", default=[], help="worker base URLs (space separated)")
    g.add_argument("--worker-startup-timeout-secs", type=float, default=d.worker_startup_timeout_secs,
                   help="how long to wait for every worker's health check at start-up")
    g.add_argument("--worker-startup-check-interval", type=float, default=d.worker_startup_check_interval,
                   help="seconds between start-up health probes")
    g = p.add_argument_group("routing policy")
    g.add_argument("--policy", choices=POLICIES, default=d.policy)
    g.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                   help="cache_aware: route to the matching worker if matched/len(text) exceeds this")
    g.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                   help="cache_aware: imbalanced if max_load - min_load exceeds this (and the relative test holds)")
    g.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
                   help="cache_aware: imbalanced if max_load > min_load * this (and the absolute test holds)")
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
    g.add_argument("--health-check-interval-secs", type=float, default=d.health_check_interval_secs)
    g.add_argument("--health-check-timeout-secs", type=float, default=d.health_check_timeout_secs)
    g.add_argument("--health-check-endpoint", default=d.health_check_endpoint)
    g.add_argument("--health-failure-threshold", type=int, default=d.health_failure_threshold,
                   help="consecutive failed checks before a worker is marked unhealthy")
    g.add_argument("--health-success-threshold", type=int, default=d.health_success_threshold,
                   help="consecutive good checks before an unhealthy worker is used again")
    g.add_argument("--disable-health-check", action="store_true",
                   help="no start-up wait and no periodic checks")
    g = p.add_argument_group("retries")
    g.add_argument("--retry-max-retries", type=int, default=d.retry_max_retries,
                   help="attempts per request, the first one included")
    g.add_argument("--retry-initial-backoff-ms", type=float, default=d.retry_initial_backoff_ms)
    g.add_argument("--retry-max-backoff-ms", type=float, default=d.retry_max_backoff_ms)
    g.add_argument("--retry-backoff-multiplier", type=float, default=d.retry_backoff_multiplier)
    g.add_argument("--retry-jitter-factor", type=float, default=d.retry_jitter_factor)
    g.add_argument("--disable-retries", action="store_true")
    g = p.add_argument_group("circuit breaker")
    g.add_argument("--cb-failure-threshold", type=int, default=d.cb_failure_threshold,
                   help="consecutive failures (within the window) that open a worker's circuit")
    g.add_argument("--cb-success-threshold", type=int, default=d.cb_success_threshold,
                   help="successes in half-open state that close it again")
    g.add_argument("--cb-timeout-duration-secs", type=float, default=d.cb_timeout_duration_secs,
                   help="time an open circuit waits before letting a trial request through")
    g.add_argument("--cb-window-duration-secs", type=float, default=d.cb_window_duration_secs,
                   help="failures older than this no longer count")
    g.add_argument("--disable-circuit-breaker", action="store_true")
    g = p.add_argument_group("metrics and logs")
    g.add_argument("--prometheus-host", default=d.prometheus_host,
                   help="address of the --prometheus-port listener (independent of --host)")
    g.add_argument("--prometheus-port", type=int, default=None,
                   help="extra listener for /metrics (it is always on the main port too)")
    g.add_argument("--log-level", choices=("debug", "info", "warn", "warning", "error"), default=d.log_level)
    kv_flags.add_flags(p, d)
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
