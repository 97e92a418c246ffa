"""sglang-router 0.3.2 flags that fleetserve router does not implement: each one is refused.

``python -m sglang_router.launch_router --help`` (0.3.2) lists these flags
beside the ones :mod:`.config` implements.  Rather than ignore them in
silence, the parser knows every one of them and exits with code 2 and one
line, ``--flag is not supported by fleetserve router``, when one is given.

:func:`add_unsupported` skips any flag the parser already defines, so a flag
implemented later (in :mod:`.config` or by another module) simply stops being
refused.  docs/router.md has the full table.
"""

from __future__ import annotations

import argparse

# sglang-router 0.3.2 flags with no counterpart here, grouped as in its --help
UNSUPPORTED_FLAGS = (
    # routing policies and modes we do not have
    "--prefill-policy", "--decode-policy", "--bucket-adjust-interval-secs", "--max-idle-secs",
    "--assignment-mode", "--enable-igw",
    # PD disaggregation
    "--mini-lb", "--pd-disaggregation", "--prefill", "--decode",
    # Kubernetes service discovery
    "--service-discovery", "--selector", "--service-discovery-port", "--service-discovery-namespace",
    "--prefill-selector", "--decode-selector",
    # logging, metrics, request handling
    "--log-dir", "--prometheus-duration-buckets", "--request-id-headers", "--cors-allowed-origins",
    # tokenizer, parsers, MCP (the router tokenizes only for kv_aware and parses no model output)
    "--model-path", "--chat-template", "--tokenizer-cache-enable-l1", "--tokenizer-cache-l1-max-memory",
    "--reasoning-parser", "--tool-call-parser", "--mcp-config-path",
    # backends and conversation history storage
    "--backend", "--history-backend", "--oracle-wallet-path", "--oracle-tns-alias", "--oracle-connect-descriptor",
    "--oracle-username", "--oracle-password", "--oracle-pool-min", "--oracle-pool-max",
    "--oracle-pool-timeout-secs", "--postgres-db-url", "--postgres-pool-max", "--redis-url", "--redis-pool-max",
    "--redis-retention-days",
    # TLS (only plain http:// workers and listeners here)
    "--client-cert-path", "--client-key-path", "--ca-cert-paths", "--tls-cert-path", "--tls-key-path",
    # tracing
    "--enable-trace", "--otlp-traces-endpoint",
    # control-plane auth beyond one --api-key
    "--control-plane-api-keys", "--control-plane-audit-enabled", "--jwt-issuer", "--jwt-audience",
    "--jwt-jwks-uri", "--jwt-role-mapping",
)


class _Refuse(argparse.Action):
    """Exit with one line naming the flag as soon as argparse meets it."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not supported by fleetserve router")


def add_unsupported(parser: argparse.ArgumentParser) -> list[str]:
    """Make ``parser`` refuse every :data:`UNSUPPORTED_FLAGS` flag it does not define; return those added."""
    known = parser._option_string_actions  # argparse's own map of option string -> action
    group = parser.add_argument_group("sglang-router flags not supported here (each one is refused)")
    added = []
    for flag in UNSUPPORTED_FLAGS:
        if flag in known:
            continue
        group.add_argument(flag, nargs="*", action=_Refuse, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        added.append(flag)
    return added
