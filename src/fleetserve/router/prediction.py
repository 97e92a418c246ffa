"""How good is the router's guess: predicted vs. engine-reported cached prompt tokens, per worker.

Every cache policy (``cache_aware``, ``kv_aware``) predicts how many of a
request's prompt tokens the chosen worker has cached (the ``cached_tokens``
field of ``x-fleetserve-route``, :mod:`.route_header`).  The engine reports
what it really reused: ``usage.prompt_tokens_details.cached_tokens`` (OpenAI
API: vLLM, SGLang, ours) or ``meta_info.cached_tokens`` (SGLang's
``/generate``); in a stream, the last such field (the final usage chunk, or
the last ``meta_info``).

The report is found without parsing the body: :func:`reported_cached_tokens`
looks for the last ``"cached_tokens"`` key in the raw bytes.  The key cannot
match inside a JSON string (its quotes would be escaped there), the usage
object sits at the end of OpenAI and SGLang bodies so ``rfind`` stops early,
and a 1-2 KB body costs well under a microsecond
(``benchmarks/route_prediction_cost.py``).  A body with several prompts
(a batch, ``n > 1`` on ``/generate``) is judged by its last report.

Exported per worker in ``/metrics`` (:func:`families`, prefix ``fleetserve_router_``):

* ``cache_prediction_abs_error_tokens{worker}``: histogram of
  ``|predicted - reported|`` in tokens, one observation per answered request
  that carried both (buckets :data:`ERROR_BUCKETS`); ``_sum / _count`` is the
  mean absolute error.
* ``cache_predicted_tokens_total{worker}``, ``cache_reported_tokens_total{worker}``:
  the sums of both over the same requests (their difference is the bias:
  positive when the router over-estimates).
* ``cache_unreported_total{worker}``: answers from a policy that predicted,
  but without a ``cached_tokens`` report (an error answer, an engine that does
  not report, a stream without usage).
"""

from __future__ import annotations

import bisect
import re

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

ERROR_BUCKETS = (0, 1, 16, 64, 256, 1024, 4096, 16384)  # tokens; 0 = exactly right
_KEY = b'"cached_tokens"'
_VALUE = re.compile(rb"[ \t\r\n]*:[ \t\r\n]*(\d+)")


def reported_cached_tokens(data: bytes) -> int | None:
    """The last ``"cached_tokens": N`` of a JSON body or SSE stream tail; None if absent or not an integer."""
    i = data.rfind(_KEY)
    if i < 0:
        return None
    m = _VALUE.match(data, i + len(_KEY))
    return int(m.group(1)) if m else None


class PredictionStats:
    """One worker's counts (plain ints, bumped on the event loop; read at scrape time)."""

    __slots__ = ("buckets", "error_sum", "predicted", "reported", "unreported")

    def __init__(self) -> None:
        self.buckets = [0] * (len(ERROR_BUCKETS) + 1)
        self.error_sum = 0
        self.predicted = 0
        self.reported = 0
        self.unreported = 0

    @property
    def count(self) -> int:
        return sum(self.buckets)

    def observe(self, predicted: int, reported: int | None) -> None:
        if reported is None:
            self.unreported += 1
            return
        err = abs(predicted - reported)
        self.buckets[bisect.bisect_left(ERROR_BUCKETS, err)] += 1
        self.error_sum += err
        self.predicted += predicted
        self.reported += reported


class Predictions:
    """Worker url -> :class:`PredictionStats`."""

    def __init__(self) -> None:
        self.by_worker: dict[str, PredictionStats] = {}

    def observe(self, url: str, predicted: int, data: bytes | None) -> None:
        """Compare ``predicted`` with the report in ``data`` (the body, or a stream's last chunks)."""
        st = self.by_worker.get(url)
        if st is None:
            st = self.by_worker[url] = PredictionStats()
        st.observe(predicted, reported_cached_tokens(data) if data else None)

    def forget(self, url: str) -> None:
        self.by_worker.pop(url, None)


def families(preds: Predictions):
    """The Prometheus families of the module docstring."""
    p = "fleetserve_router_cache_"
    hist = HistogramMetricFamily(p + "prediction_abs_error_tokens",
                                 "|predicted - engine-reported| cached prompt tokens per answered request",
                                 labels=["worker"])
    pred = CounterMetricFamily(p + "predicted_tokens", "Predicted cached prompt tokens (requests with a report)",
                               labels=["worker"])
    rep = CounterMetricFamily(p + "reported_tokens", "Engine-reported cached prompt tokens (same requests)",
                              labels=["worker"])
    unrep = CounterMetricFamily(p + "unreported", "Predicted answers without a cached_tokens report",
                                labels=["worker"])
    for url, st in list(preds.by_worker.items()):
        acc, buckets = 0, []
        for bound, c in zip(ERROR_BUCKETS, st.buckets):
            acc += c
            buckets.append((str(float(bound)), acc))
        acc += st.buckets[-1]
        buckets.append(("+Inf", acc))
        hist.add_metric([url], buckets, sum_value=st.error_sum)
        pred.add_metric([url], st.predicted)
        rep.add_metric([url], st.reported)
        unrep.add_metric([url], st.unreported)
    yield from (hist, pred, rep, unrep)
