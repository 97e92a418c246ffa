"""Does a worker tokenize as the router does?  Judged from the prompt tokens it reports.

``kv_aware`` matches the router's token ids (``--tokenizer-path``) against the block hashes
of the engines' KV events.  A worker with another tokenizer (a ``fleetserve sim-worker`` with
its default ``word`` tokenizer, an engine serving another model) hashes other ids, so its
event index never matches and the router would predict 0 cached tokens with full trust.

Every 200 answer to a request the router tokenized itself carries the engine's own count of
the prompt: ``usage.prompt_tokens`` (OpenAI API: vLLM, SGLang, ours) or
``meta_info.prompt_tokens`` (SGLang's ``/generate``); in a stream, the last one (the usage
chunk, when the client asked for it with ``stream_options.include_usage``, or the last
``meta_info``).  It is found in the raw bytes as :mod:`..prediction` finds ``cached_tokens``
(the key ``"prompt_tokens"`` with its closing quote cannot match ``"prompt_tokens_details"``
nor anything inside a JSON string).

A worker *disagrees* once :data:`MIN_DISAGREEMENTS` answers gave another count than the
router's and those outnumber the answers that agreed.  Then every DP rank of it is routed
as ``fallback`` (the approximate tree, which needs no shared ids) with reason ``tokenizer``
(the route header's ``reason=tokenizer``), one warning is logged for it, and
``fleetserve_router_kv_tokenizer_mismatch{worker}`` is 1.  Answers keep being counted, so a
worker that agrees more often later (e.g. it was restarted with the right tokenizer) is
trusted again.  Removing the worker forgets its counts.

Not seen: a tokenizer that gives the same number of ids but other ids (same length, other
vocabulary).  Names are not compared: ``/get_model_info``'s ``tokenizer_path`` (SGLang, ours)
is a path on the worker's machine, which says nothing about the router's copy.
"""

from __future__ import annotations

import logging
import re

log = logging.getLogger("fleetserve.router")

MIN_DISAGREEMENTS = 2  # answers with another prompt count before a worker is judged
TOKENIZER = "tokenizer"  # the reason shown in the route header
_KEY = b'"prompt_tokens"'
_VALUE = re.compile(rb"[ \t\r\n]*:[ \t\r\n]*(\d+)")


def reported_prompt_tokens(data: bytes) -> int | None:
    """The last ``"prompt_tokens": N`` of a JSON body or SSE stream tail; None if absent or not an integer."""
    i = data.rfind(_KEY)
    if i < 0:
        return None
    m = _VALUE.match(data, i + len(_KEY))
    return int(m.group(1)) if m else None


class TokenizerCheck:
    """Per worker: answers whose prompt count agreed / disagreed with the router's (see the module docstring)."""

    def __init__(self) -> None:
        self.agreed: dict[str, int] = {}
        self.disagreed: dict[str, int] = {}
        self.last: dict[str, tuple[int, int]] = {}  # url -> (router's count, worker's) of the last disagreement
        self.bad: set[str] = set()  # the urls mismatched() is true of, kept as the counts change (the policy asks per target)
        self._warned: set[str] = set()

    def mismatched(self, url: str) -> bool:
        return url in self.bad

    def _judge(self, url: str) -> bool:
        bad = self.disagreed.get(url, 0)
        if bad >= MIN_DISAGREEMENTS and bad > self.agreed.get(url, 0):
            self.bad.add(url)
            return True
        self.bad.discard(url)
        return False

    def observe(self, url: str, router_count: int, data: bytes | None) -> None:
        """One 200 answer from ``url`` to a prompt the router counted ``router_count`` tokens in."""
        reported = reported_prompt_tokens(data) if data else None
        if reported is None:
            return
        if reported == router_count:
            self.agreed[url] = self.agreed.get(url, 0) + 1
            if not self._judge(url):
                self._warned.discard(url)  # trusted again: warn again should it disagree later
            return
        self.disagreed[url] = self.disagreed.get(url, 0) + 1
        self.last[url] = (router_count, reported)
        if self._judge(url) and url not in self._warned:
            self._warned.add(url)
            log.warning("kv_aware: %s counts other prompt tokens than the router's tokenizer (last: router %d, "
                        "worker %d; %d of %d answers disagree): its tokenizer differs, so its KV events cannot "
                        "match; routed by the approximate tree (branch=fallback reason=tokenizer)", url,
                        router_count, reported, self.disagreed[url], self.disagreed[url] + self.agreed.get(url, 0))

    def forget(self, url: str) -> None:
        for d in (self.agreed, self.disagreed, self.last):
            d.pop(url, None)
        self.bad.discard(url)
        self._warned.discard(url)

    def urls(self) -> list[str]:
        return sorted(set(self.agreed) | set(self.disagreed))
