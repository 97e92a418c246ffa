"""Why a request went where it went: the ``x-fleetserve-route`` header, for every policy.

Value (one line, ``; ``-separated ``name=value`` fields)::

    target=URL; dp_rank=R|-; branch=B; cached_tokens=N|-; prompt_tokens=M|-[; reason=R]

* ``branch``: ``kv_aware``: the target's trust (``exact`` / ``degraded`` / ``fallback``);
  ``cache_aware``: ``hit`` / ``miss`` / ``balanced``; ``session`` when
  ``--sticky-sessions`` chose the worker; else the policy's name.
* ``cached_tokens``: the router's predicted cached prompt tokens on the target
  (``-``: the policy makes no guess).  Policies routing on text count matched
  characters at :data:`CHARS_PER_TOKEN` per token; on a token-id text form
  (``routing_text.ids_text``) a character is a token.  Either way it is at most
  ``prompt_tokens - 1``: vLLM, SGLang and our engine always compute the last
  prompt token.
* ``prompt_tokens``: the prompt's tokens as the router counts them (estimated
  from text the same way).
* ``reason`` (``kv_aware`` only, and only when one applies): why the branch is
  ``fallback`` whatever the KV-event stream's trust: ``tokenizer`` (the worker counts
  other prompt tokens than the router, ``kv_events/tokenizer_check.py``) or ``text``
  (the request has no token ids to match against events).

:class:`~.prediction.PredictionStats` compares ``cached_tokens`` with what the
engine reports.
"""

from __future__ import annotations

import math

CHARS_PER_TOKEN = 4  # text routed without token ids: about 4 characters per token
HEADER = "x-fleetserve-route"
_IDS = "\x1d"  # routing_text's marker of a token-id text form


def format_route(target: str, rank: int | None, branch: str, cached: int | None, prompt_tokens: int | None,
                 reason: str | None = None) -> str:
    """The header value (see the module docstring)."""
    return (f"target={target}; dp_rank={'-' if rank is None else rank}; branch={branch}; "
            f"cached_tokens={'-' if cached is None else cached}; "
            f"prompt_tokens={'-' if prompt_tokens is None else prompt_tokens}"
            + ("" if reason is None else f"; reason={reason}"))


def text_prompt_tokens(text: str) -> int:
    """Prompt tokens of a routing text: its ids for a token-id form, else ``ceil(chars / 4)``."""
    if text.startswith(_IDS):
        return len(text) - 1
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def text_cached_tokens(text: str, matched_chars: int) -> int:
    """Predicted cached tokens for ``matched_chars`` of ``text`` held by the target (capped at prompt - 1)."""
    if text.startswith(_IDS):
        cached = matched_chars - 1
    else:
        cached = matched_chars // CHARS_PER_TOKEN
    return max(0, min(cached, text_prompt_tokens(text) - 1))


def route_of(policy, worker, text, by_session: bool = False) -> tuple[str, int | None]:
    """``(header value, predicted cached tokens or None)`` of a decision by a policy without its own ``decorate``.

    ``cache_aware`` leaves ``policy.last = (branch, matched characters on the chosen worker before
    its insert)``; policies without ``last`` make no guess.  A worker chosen by ``--sticky-sessions``
    (``by_session``) is shown as branch ``session``, without a guess.
    """
    text = text if isinstance(text, str) else ""
    prompt = text_prompt_tokens(text) if text else None
    if by_session:
        return format_route(worker.url, None, "session", None, prompt), None
    last = getattr(policy, "last", None)
    if last is None or not text:
        return format_route(worker.url, None, last[0] if last else policy.name, None, prompt), None
    branch, chars = last
    cached = text_cached_tokens(text, chars)
    return format_route(worker.url, None, branch, cached, prompt), cached
