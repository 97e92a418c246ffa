"""Router flags that only one policy (or a few) reads: a warning when one is given under another.

sglang-router and smg accept every policy's flags whatever ``--policy`` says and use only the
chosen policy's (their Python side passes all of them on; the other policies' settings are
dropped in silence). We accept them too, so that one command line keeps working with either
router and a change of ``--policy`` needs no other edit, but the router logs one warning line
per flag that has no effect at start-up (``fleetserve launch`` prints them before it starts
anything), e.g. ``--kv-prefill-weight has no effect under --policy round_robin (read only
under kv_aware)``.

Which policies read a flag (:data:`READ_BY`, by argparse ``dest``):

* the ``kv_aware`` group (``--kv-*``, ``--tokenizer-path``, ``--tokenizer-cache-*``,
  ``--dp-aware``, ``--router-queue-threshold``): ``kv_aware`` only;
* ``--cache-threshold``, ``--cache-miss-fallback``, ``--bounded-load-*``: ``cache_aware`` only;
* ``--eviction-interval-secs``, ``--max-tree-size``: the policies with a routing tree,
  ``cache_aware`` and ``kv_aware``;
* ``--balance-abs-threshold``, ``--balance-rel-threshold``: ``cache_aware``, and every policy
  with ``--sticky-sessions`` (a session leaves a worker over the balance thresholds).

Only flags given on the command line count (a default is no one's choice).
"""

from __future__ import annotations

import argparse

KV = ("kv_aware",)
TREE = ("cache_aware", "kv_aware")
CACHE = ("cache_aware",)

READ_BY: dict[str, tuple[str, ...]] = {
    **{d: KV for d in ("tokenizer_path", "tokenizer_cache_enable_l0", "tokenizer_cache_l0_max_entries",
                       "kv_events_endpoint", "kv_prefill_weight", "kv_load_weight", "kv_overflow_weight", "kv_queue_weight",
                       "kv_balance_abs_threshold", "kv_balance_rel_threshold", "kv_balance_band",
                       "kv_backlog_discount", "router_queue_threshold",
                       "kv_speculative_ttl_secs", "kv_index_max_blocks", "kv_loads_interval_secs", "dp_aware")},
    **{d: CACHE for d in ("cache_threshold", "cache_miss_fallback", "bounded_load_factor", "bounded_load_slack",
                          "balance_abs_threshold", "balance_rel_threshold")},
    **{d: TREE for d in ("eviction_interval_secs", "max_tree_size")},
}
STICKY_TOO = ("balance_abs_threshold", "balance_rel_threshold")  # read by --sticky-sessions under any policy


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, str]:
    """``{dest: flag}`` of the :data:`READ_BY` flags that ``argv`` gives (argparse's own matching,
    abbreviations and ``--flag=value`` included); ``argv`` must parse (it did once already)."""
    flags = {}
    for action in parser._actions:  # argparse keeps no record of what was given: parse again without defaults
        if action.dest in READ_BY:
            action.default = argparse.SUPPRESS
            flags[action.dest] = action.option_strings[0]
    ns = parser.parse_args(argv)
    return {dest: flag for dest, flag in flags.items() if hasattr(ns, dest)}


def inert_flag_warnings(cfg, given: dict[str, str]) -> list[str]:
    """One line per flag in ``given`` (:func:`given_flags`) that ``cfg``'s policy does not read."""
    out = []
    for dest, flag in given.items():
        readers = READ_BY[dest]
        if cfg.policy in readers or (dest in STICKY_TOO and cfg.sticky_sessions):
            continue
        where = " or ".join(readers) + (", or with --sticky-sessions" if dest in STICKY_TOO else "")
        out.append(f"{flag} has no effect under --policy {cfg.policy} (read only under {where})")
    return out


def policy_flag_warnings(argv: list[str], cfg) -> list[str]:
    """:func:`inert_flag_warnings` of the router command line ``argv`` parsed into ``cfg``."""
    from .config import build_parser

    return inert_flag_warnings(cfg, given_flags(build_parser(), argv))
