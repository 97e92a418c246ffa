"""The registry of workers and their per-request load.

``Worker.load`` is the number of requests in flight through this router to
that worker: the proxy increments it right before the upstream send and
decrements it exactly once in a ``finally`` when the response ends, fails,
times out or the client goes away.  Health checks never touch it.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import urlsplit

from .circuit_breaker import OPEN, CircuitBreaker

logger = logging.getLogger("fleetserve.router")


_HOSTNAME = re.compile(r"^[a-z0-9]([a-z0-9_.-]*[a-z0-9])?$")  # after lower-casing; IPv6 is checked by urlsplit


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port``.

    Scheme and host are lower-cased, so one worker has one name.  Raises
    ``ValueError`` for an empty URL, a scheme other than ``http``, no host, a
    path, query, fragment or user part, a host that is not a host name or IP
    address, a port that is not an integer in 1..65535, or a bare name without
    scheme and port (``notaurl``).
    """
    url = url.strip()
    if not url:
        raise ValueError("empty worker URL")
    bare = "://" not in url
    if bare:
        url = "http://" + url
    url = url.rstrip("/")
    u = urlsplit(url)
    if u.scheme.lower() != "http":
        raise ValueError(f"{url!r}: only plain http:// workers are supported")
    if not u.hostname:
        raise ValueError(f"{url!r}: no host")
    if u.path or u.query or u.fragment or "@" in u.netloc:
        # requests go to host:port + the API path, so anything else would be ignored by the
        # proxy but not by health checks, and would let one worker register under two names
        raise ValueError(f"{url!r}: give only http://host:port (no path, query, fragment or user)")
    try:
        port = u.port
    except ValueError:
        raise ValueError(f"{url!r}: the port must be an integer in 1..65535") from None
    if port == 0:
        raise ValueError(f"{url!r}: the port must be an integer in 1..65535")
    if ":" not in u.hostname and not _HOSTNAME.match(u.hostname):
        raise ValueError(f"{url!r}: {u.hostname!r} is not a host name or IP address")
    if bare and port is None:
        # "notaurl" is far more likely a mistake than a worker on port 80 of a host named so
        raise ValueError(f"{url[len('http://'):]!r} is not a worker URL: give http://host:port or host:port")
    host = u.hostname if ":" not in u.hostname else f"[{u.hostname}]"  # lower case; IPv6 in brackets
    return f"http://{host}" + ("" if port is None else f":{port}")


class Worker:
    """One upstream server.  ``url`` is its base URL and its tenant name in the radix tree."""

    __slots__ = ("url", "load", "healthy", "breaker", "health_failures", "health_successes",
                 "requests", "failures", "failed_in_row", "removed", "draining", "api_key")

    def __init__(self, url: str, breaker: CircuitBreaker | None = None, api_key: str | None = None) -> None:
        self.url = url
        self.api_key = api_key  # its own key (POST /workers "api_key"), sent instead of --api-key (auth.py)
        self.load = 0
        self.healthy = True
        self.breaker = breaker or CircuitBreaker()
        self.health_failures = 0
        self.health_successes = 0
        self.requests = 0
        self.failures = 0
        self.failed_in_row = 0  # proxied attempts failed by this worker's fault since its last success
        self.removed = False
        self.draining = False  # POST /drain_worker: no new requests (drain.py)

    def record_failure(self, reason: str) -> None:
        """Count one request that failed by this worker's fault (a 5xx other than 503, a broken or
        timed-out connection, an error event mid-stream) and log it as one warning line naming the
        worker and ``reason``; a line more when this failure opens the circuit breaker."""
        self.failures += 1
        self.failed_in_row += 1
        was_open = self.breaker.state is OPEN
        self.breaker.record_failure()
        logger.warning("worker %s failed a request: %s (failures so far: %d)", self.url, reason, self.failures)
        if self.breaker.state is OPEN and not was_open:
            logger.warning("worker %s: circuit breaker open; no requests to it for %.0f s", self.url,
                           self.breaker.timeout_s)

    def record_success(self) -> None:
        """A proxied attempt ended without a worker fault: the circuit breaker counts it, and the
        failures in a row shown by ``/list_workers`` and ``/workers`` start again from zero."""
        self.failed_in_row = 0
        self.breaker.record_success()

    def available(self) -> bool:
        """Healthy, not removed, and its circuit lets a request through."""
        return self.healthy and not self.removed and not self.draining and self.breaker.allows()

    def __repr__(self) -> str:
        return f"Worker({self.url!r}, load={self.load}, healthy={self.healthy})"


class WorkerRegistry:
    """Workers in registration order.  Mutated only on the event loop thread."""

    def __init__(self) -> None:
        self._by_url: dict[str, Worker] = {}
        self.workers: list[Worker] = []  # read-only view for the hot path; replaced on change
        # removed workers whose requests were still in flight, by url: re-adding the url takes that
        # object back, so those requests stay in its load (and release it when they end)
        self._departed: dict[str, Worker] = {}

    def __len__(self) -> int:
        return len(self.workers)

    def get(self, url: str) -> Worker | None:
        return self._by_url.get(normalize_url(url))

    def add(self, worker: Worker) -> bool:
        """Register ``worker``; False if its URL is already present.

        When the URL was removed while requests to it were still in flight and those have not all
        ended, the removed :class:`Worker` object is registered again instead, with ``worker``'s
        settings (circuit breaker, API key, fresh counters) and its own ``load``: the requests in
        flight count in the load the policies see and take themselves off it as they end.  (A new
        object would start at load 0 while they still run there.)
        """
        if worker.url in self._by_url:
            return False
        old = self._departed.pop(worker.url, None)
        if old is not None and old.load > 0:
            load = old.load
            for name in Worker.__slots__:
                setattr(old, name, getattr(worker, name))
            old.load = load
            worker = old
        self._by_url[worker.url] = worker
        self.workers = [*self.workers, worker]
        return True

    def remove(self, url: str) -> Worker | None:
        """Unregister the worker at ``url``; None if unknown.  Its requests in flight keep the object
        (``removed`` set): a stream that can migrate leaves it at its next event, the others finish."""
        worker = self._by_url.pop(normalize_url(url), None)
        if worker is not None:
            worker.removed = True
            self.workers = [w for w in self.workers if w is not worker]
            for u in [u for u, w in self._departed.items() if w.load <= 0]:
                del self._departed[u]  # their requests all ended: nothing to carry over any more
            if worker.load > 0:
                self._departed[worker.url] = worker
        return worker

    def available(self) -> list[Worker]:
        """Workers that may take a request now, in registration order."""
        return [w for w in self.workers if w.healthy and not w.draining and w.breaker.allows()]

    def urls(self) -> list[str]:
        return [w.url for w in self.workers]
