"""Per-request cost of the route header and of reading the engine's cached-token report.

Compares :func:`fleetserve.router.prediction.reported_cached_tokens` (a byte search from
the end) with a full ``orjson.loads`` of the same body, on an OpenAI completion body
with a 1.5 KB answer and on the last two chunks of a stream, and times the
``x-fleetserve-route`` value of a ``cache_aware`` decision.

    PYTHONPATH=src python benchmarks/route_prediction_cost.py
"""

from __future__ import annotations

import json
import timeit

import orjson

from fleetserve.router.prediction import reported_cached_tokens
from fleetserve.router.route_header import route_of
from fleetserve.router.routing_text import ids_text


class _W:
    url = "http://10.0.0.1:30001"


class _P:
    name = "cache_aware"
    last = ("hit", 700)


def main() -> None:
    text = "word " * 300
    body = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                       "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 700, "completion_tokens": 300, "total_tokens": 1000,
                                 "prompt_tokens_details": {"cached_tokens": 512}}}).encode()
    tail = (b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":700,"completion_tokens":300,'
            b'"prompt_tokens_details":{"cached_tokens":512}}}\n\n' + b"data: [DONE]\n\n")
    routing = ids_text(list(range(1000, 1700)))
    n = 200_000
    rows = [
        ("calibration: a bare call, len(body)", lambda: len(body)),
        ("reported_cached_tokens, %d B body" % len(body), lambda: reported_cached_tokens(body)),
        ("orjson.loads + usage lookup, same body",
         lambda: orjson.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]),
        ("reported_cached_tokens, stream tail (%d B)" % len(tail), lambda: reported_cached_tokens(tail)),
        ("route_of (header value + prediction)", lambda: route_of(_P, _W, routing)),
    ]
    assert reported_cached_tokens(body) == 512 == reported_cached_tokens(tail)
    for name, fn in rows:
        best = min(timeit.repeat(fn, number=n, repeat=5)) / n
        print(f"{name:50s} {best * 1e9:8.0f} ns")


if __name__ == "__main__":
    main()
