"""The inference path: parse, route, forward with retries, stream through.

``POST /generate``, ``/v1/completions`` and ``/v1/chat/completions`` are routed
by the policy and proxied; the client's body bytes are forwarded unchanged, and
``"stream": true`` responses are passed through chunk by chunk.

Errors are OpenAI-style JSON: 400 malformed JSON or a body that is not an
object, 503 no available worker, 502 / 504 every attempt failed (or timed out)
without a worker response.  (413 for a body over ``--max-payload-size`` is
answered by the server before a handler runs.)

Retries: a connection error, a timeout or a 5xx answer other than 503 is
retried on another worker (when there is one) after an exponential backoff
with jitter, up to ``--retry-max-retries`` attempts -- only while nothing has
been sent to the client.  A stream is held back until its first piece of body
arrives, so a worker that fails before its first event is retried too; once a
streamed response has started, a failure migrates the request to another worker
(:mod:`.migration`, ``--max-migrations``), and past that ends the stream with an
error event.
When a second worker also answers a request with a 5xx status, the request is
taken to be at fault: that answer goes to the client, no further retry, and
neither worker's failure is counted (see :func:`_forward`).
A 429 or 503 answer is back-pressure: retried at once on a worker not asked
yet, else passed to the client unchanged, and never a circuit-breaker failure.
Any other 4xx answer passes through unchanged and counts as a worker success.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import orjson

from . import migration
from .auth import CREDENTIAL_HEADERS, swap_credential_lines
from .http.client import UpstreamError, UpstreamResponse, UpstreamTimeoutError
from .http.server import Request, Response, error_body, json_error
from .retry import backoff_delay_s
from .route_header import HEADER, route_of
from .routing_text import routing_text
from .via import forwarded_via, loop_answer
from .workers import Worker

log = logging.getLogger("fleetserve.router")

if TYPE_CHECKING:
    from .app import Router

INFERENCE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
_JSON = "application/json"
# response headers not passed back to the client: hop-by-hop ones, and the ones the server writes itself
_NOT_FORWARDED = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-type",
                            "proxy-connection", "te", "trailer", "upgrade"})




# vLLM's header naming the DP rank to serve a request (SGLang reads it too, in any case); the engine
# checks it (400 for a rank out of range).  Passed on with the inference routes, as the credentials are.
DP_RANK_HEADER = "x-data-parallel-rank"
# the client's request headers an inference request passes on to the worker (the rest stay here)
_PASSED_ON = (*CREDENTIAL_HEADERS, DP_RANK_HEADER)


def credential_headers(request: Request) -> dict[str, str]:
    """The client's credential headers, to send to the worker (name -> value, names as received, lower case)."""
    h = request.headers
    return {k: h[k] for k in CREDENTIAL_HEADERS if k in h}


def _passed_on_lines(request: Request, via: str) -> bytes:
    """The request-header lines an inference request carries to the worker: the client's credentials
    and its ``X-data-parallel-rank``, as ``name: value\\r\\n`` (names lower case), then ``via`` (this
    router's entry, after the client's: :mod:`.via`).  Under ``kv_aware --dp-aware`` the client's rank
    wins over the router's (``KvAwarePolicy.decorate``)."""
    h = request.headers
    lines = b"".join(k.encode("latin-1") + b": " + h[k].encode("latin-1") + b"\r\n" for k in _PASSED_ON if k in h)
    return lines + b"via: " + forwarded_via(h.get("via"), via).encode("latin-1") + b"\r\n"


def forwarded_response_headers(pairs) -> list[tuple[str, str]]:
    """A worker's response headers to pass to the client (e.g. ``WWW-Authenticate``), repeats kept."""
    return [(k, v) for k, v in pairs if k.lower() not in _NOT_FORWARDED]


def _forwarded_headers(resp: UpstreamResponse) -> list[tuple[str, str]]:
    """The worker's response headers to pass to the client (e.g. a worker id header), as pairs, repeats kept."""
    return forwarded_response_headers(resp.header_pairs)


class _Retry:
    """This attempt failed by the worker's fault; ``response`` is what the client gets if no retry is left."""

    __slots__ = ("response",)

    def __init__(self, response: Response) -> None:
        self.response = response


class _Failed(_Retry):
    """The worker answered a 5xx status (not busy).  Its failure is recorded by :func:`_forward` only once
    the request is shown not to be at fault: see :func:`_settle_status_faults`."""

    __slots__ = ()


class _Busy(_Retry):
    """The worker answered 429 or 503: busy, not broken.  ``response`` is its answer, unchanged."""

    __slots__ = ()


# a worker's "busy, come back later" answers: back-pressure, not failure (see docs/router.md, "Busy workers")
BUSY_STATUSES = frozenset({429, 503})


def _upstream_error(e: UpstreamError, message: str) -> dict:
    """The OpenAI-style error body of a failed exchange: code ``upstream_timeout`` (a timeout) or ``upstream_error``."""
    if isinstance(e, UpstreamTimeoutError):
        return error_body(message, "gateway_timeout", code="upstream_timeout")
    return error_body(message, "bad_gateway", code="upstream_error")


async def handle_inference(router: Router, request: Request) -> Response | None:
    """Parse, route and proxy one inference request (the server already enforced the size limit)."""
    if "via" in request.headers:  # came round a loop back to this router? (via.py)
        looped = loop_answer(request.headers, router.via, request.path)
        if looped is not None:
            return looped
    if not request.body:  # the engine's words for it (entrypoints/http/body.py)
        router.stats.bad_requests += 1
        return json_error(400, "request body is empty; send a JSON object")
    try:
        body = orjson.loads(request.body)
    except orjson.JSONDecodeError as e:
        router.stats.bad_requests += 1
        return json_error(400, f"malformed JSON body: {e}", code="invalid_json")  # the engine's code too
    if type(body) is not dict:
        router.stats.bad_requests += 1
        return json_error(400, "the request body must be a JSON object")
    path = request.path
    admission = router.admission
    if admission is not None and not admission.try_admit():  # --max-concurrent-requests (admission.py)
        refused = await admission.admit()  # wait in the queue, or 429 / 408
        if refused is not None:
            return refused
    router.handling += 1
    text = routing_text(path, body)
    prepare = getattr(router.policy, "prepare", None)  # kv_aware: token ids, tokenized off the loop
    try:
        if prepare is not None:
            text = await prepare(path, body, text, request.headers)
        sessions = router.sessions
        session = sessions.key(request.headers, body) if sessions is not None else None
        return await _forward(router, request, path, text, body.get("stream") is True, session, body)
    finally:
        router.handling -= 1
        if prepare is not None:
            router.policy.release(text)
        if admission is not None:
            admission.release()


async def _forward(router: Router, request: Request, path: str, text, stream: bool,
                   session: str | None = None, parsed: dict | None = None) -> Response | None:
    """Choose a worker and send; on a worker fault, back off and choose again among the ones not tried yet.

    A 5xx status (not busy) is the worker's failure (its circuit breaker counts it) unless a second
    worker answers the same request with a 5xx status too: then the request is taken to be at fault
    (a body that crashes every engine alike), neither failure is counted, it is not retried further,
    and the client gets the second answer (``fleetserve_router_request_faults_total``).  So a few bad
    requests cannot open every worker's circuit.  A broken or timed-out connection is always the
    worker's failure.

    ``text``: the routing key (the prompt text, or kv_aware's prepared token ids).
    ``session``: the session key (``--sticky-sessions``): its worker goes first when it can take the
    request (see :mod:`.sessions`), and the session follows the worker each attempt goes to.
    ``parsed``: the client's body, parsed (a stream that fails after it started migrates from it).
    """
    cfg = router.cfg
    stats = router.stats
    policy = router.policy
    headers = _passed_on_lines(request, router.via)
    mig = migration.start(router, path, parsed, text, headers, session) if stream and parsed is not None else None
    raw = request.body  # what goes upstream (a migratable stream asks for the usage in every chunk)
    if mig is not None:
        raw = mig.upstream_body(raw) or raw
    tree = getattr(policy, "tree", None)  # cache_aware, kv_aware: a refused request's entry is taken back
    tried: list[Worker] = []
    failure: Response | None = None
    attempt = 0
    suspect: Worker | None = None  # the worker whose 5xx answer is not yet counted as its failure
    suspect_status = 0
    try:
        while True:
            attempt += 1
            t0 = time.perf_counter()
            workers = router.registry.available()
            if tried and len(workers) > 1:
                fresh = [w for w in workers if w not in tried]
                if fresh:
                    workers = fresh
            worker = None
            if tree is not None:
                policy.last_claim = None
            if session is not None and not tried:
                worker = router.sessions.select(session, workers, text, policy)
            by_session = worker is not None
            if by_session and hasattr(policy, "pin"):
                policy.pin(worker, text)  # kv_aware: the rank (--dp-aware), the load and the route header
            if worker is None:
                worker = policy.select(workers, text, retry=bool(tried))
            if session is not None and worker is not None:
                router.sessions.remember(session, worker.url)
            stats.observe_decision(time.perf_counter() - t0)
            if worker is None:
                stats.no_worker += 1
                if failure is None:
                    return json_error(503, "no healthy worker available", "service_unavailable",
                                      code="no_healthy_worker")
                return failure
            decorate = getattr(policy, "decorate", None)  # kv_aware: the DP rank to use, the route header
            if decorate is not None:
                body, hdrs, shown = decorate(text, raw, headers)
                predicted = getattr(text, "cached", None)
            else:  # every other policy: the route header (route_header.py)
                body, hdrs = raw, headers
                value, predicted = route_of(policy, worker, text, by_session)
                shown = () if cfg.no_route_header else ((HEADER, value),)
            claim = policy.last_claim if tree is not None else None
            result = await _attempt(router, request, worker, path, hdrs, stream, body, shown, predicted, mig, text,
                                    claim)
            kind = type(result)
            if kind is not _Retry and kind is not _Busy and kind is not _Failed:
                return result
            if kind is _Failed:
                status = result.response.status
                if suspect is not None and suspect is not worker:  # two workers alike: the request's fault
                    suspect = None
                    stats.request_faults += 1
                    log.warning("a request got status %d from %s after status %d from another worker: taken as "
                                "the request's fault (not counted against either worker, not retried)", status,
                                worker.url, suspect_status)
                    return result.response
                if suspect is not None:  # the same worker again (nothing else to try): that one counts now
                    suspect.record_failure(f"status {suspect_status}")
                suspect, suspect_status = worker, status
            tried.append(worker)
            failure = result.response
            if attempt >= router.max_attempts:
                return failure
            if kind is _Busy:
                # busy: another worker that has not been asked yet takes it at once; none -> the answer as is
                if not any(w not in tried for w in router.registry.available()):
                    return failure
                stats.retries += 1
                continue
            stats.retries += 1
            await asyncio.sleep(backoff_delay_s(attempt, cfg.retry_initial_backoff_ms, cfg.retry_max_backoff_ms,
                                                cfg.retry_backoff_multiplier, cfg.retry_jitter_factor))
    finally:  # no second worker answered 5xx: the first one's answer was its own failure
        if suspect is not None:
            suspect.record_failure(f"status {suspect_status}")


async def _attempt(router: Router, request: Request, worker: Worker, path: str, headers: bytes, stream: bool,
                   body: bytes | None = None, shown=(), predicted: int | None = None,
                   mig: migration.Migration | None = None, key=None, claim=None):
    """One upstream attempt: the client's response, None once streamed, or a :class:`_Retry`.

    ``predicted``: the policy's predicted cached tokens, compared with the engine's report
    in a 200 answer (:mod:`.prediction`); None: no guess to judge.  ``key``: the routing key,
    given to the policy's ``answered`` with a 200 answer (kv_aware: the tokenizer check).
    ``claim``: the policy's tree entry for this decision (``policy.last_claim``), taken back when
    the worker refuses the request (4xx or busy: it never reached that worker's cache).

    ``worker.load`` is held from before the send until this returns, whatever happens
    (answer, error, timeout, or cancellation when the client goes away).
    """
    worker.load += 1
    worker.requests += 1
    resp = None
    if worker.api_key is not None:
        headers = swap_credential_lines(headers, worker.api_key)
    try:
        try:
            resp = await router.pool.post(worker.url, path, request.body if body is None else body, headers)
            status = resp.status
            if claim is not None and (400 <= status < 500 or status in BUSY_STATUSES):
                router.policy.tree.retract(*claim)
            if status in BUSY_STATUSES:
                # not a failure: the circuit breaker is left as it is, so the worker gets traffic again
                # the moment it has room; the answer (status, body, Retry-After) is kept for the client
                data = await resp.read()
                return _Busy(Response(status, data, resp.headers.get("content-type", _JSON),
                                      [*_forwarded_headers(resp), *shown]))
            if status >= 500:  # whose fault, the worker's or the request's, _forward settles
                data = await resp.read()
                return _Failed(Response(status, data, resp.headers.get("content-type", _JSON),
                                        [*_forwarded_headers(resp), *shown]))
            if not stream or resp.content_type != "text/event-stream":
                data = await resp.read()
                worker.record_success()
                if predicted is not None and status == 200:
                    router.predictions.observe(worker.url, predicted, data)
                    _answered(router.policy, key, worker.url, data)
                return Response(status, data, resp.headers.get("content-type", _JSON),
                                [*_forwarded_headers(resp), *shown])
            # a stream: nothing goes to the client before the first piece of body has arrived,
            # so a worker that fails before its first event is still retried elsewhere
            first = await resp.next_chunk()
        except UpstreamError as e:
            worker.record_failure(f"{type(e).__name__}: {e}")
            err = _upstream_error(e, f"upstream request to {worker.url} failed: {type(e).__name__}: {e}")
            return _Retry(Response(504 if isinstance(e, UpstreamTimeoutError) else 502, orjson.dumps(err)))
        # streaming: from here on bytes reach the client, so no retry (a migration instead, with mig)
        prefilled = getattr(router.policy, "prefilled", None)
        if prefilled is not None:  # kv_aware: the first chunk comes with the first token, the prefill is over
            prefilled(key)
        tail = await _stream(request, worker, resp, first, shown, mig)
        if predicted is not None and tail is not None and resp.status == 200:
            router.predictions.observe(worker.url, predicted, tail)
            _answered(router.policy, key, worker.url, tail)
        return None
    finally:
        if mig is None or not mig.left_first:  # a migration gave it back when the stream moved on
            worker.load -= 1
        if resp is not None:
            resp.release()


def _answered(policy, key, url: str, data: bytes) -> None:
    answered = getattr(policy, "answered", None)
    if answered is not None:
        answered(key, url, data)


async def _stream(request: Request, worker: Worker, resp: UpstreamResponse, chunk: bytes, shown=(),
                  mig: migration.Migration | None = None) -> bytes | None:
    """Pass a streamed answer through chunk by chunk, as each arrives (``chunk``: the first piece, b'' if none;
    ``shown``: extra response headers, e.g. the route header; ``mig``: the migration tracker, which
    passes on whole events only, or None).  Returns the stream's last two chunks (where the final
    usage / meta_info is) when this worker ended it cleanly, else None (failed, migrated, client gone).

    With ``mig``, a stream whose worker was removed moves to another worker when it can
    (:meth:`.migration.Migration.leaves`), not counted as the worker's failure.  Once the stream
    leaves a worker (failed or removed), that worker's connection is closed before the answer goes on
    elsewhere."""
    try:
        extra = [*_forwarded_headers(resp), *shown]
        if "cache-control" not in resp.headers:
            extra.append(("Cache-Control", "no-cache"))
        request.start_stream(resp.status, resp.headers.get("content-type", "text/event-stream"), extra)
        tail = b"\n\n"  # the last two bytes sent: is an event open?
        prev = last = b""  # the last two chunks: the engine's final cached_tokens report is in them
        try:
            while chunk:
                if mig is None:
                    await request.write(chunk)
                    tail = (tail + chunk)[-2:]
                else:
                    out, bad = mig.feed(chunk)
                    if out:
                        await request.write(out)
                    if bad is not None:
                        raise migration.WorkerFailed("an error event", bad)
                    if mig.leaves(worker):
                        raise migration.WorkerRemoved(worker.url)
                prev, last = last, chunk
                chunk = await resp.next_chunk()
        except UpstreamError as e:
            # bytes already reached the client, so no retry: continue on another worker (mig), else
            # close off any half event and end with an error event (and no [DONE]) rather than a silent cut
            if isinstance(e, migration.WorkerRemoved):
                migration.note_removed(worker)  # not the worker's fault: no failure counted
            else:
                worker.record_failure(f"mid-stream: {type(e).__name__}: {e}")
            # this worker serves the request no more: close its connection now, not when the answer ends
            # elsewhere, so an engine aborts the request (it does when its client goes away)
            resp.release()
            if mig is not None and await mig.resume(request, worker):
                request.end_stream()
                return
            if getattr(e, "event", b""):
                await request.write(e.event)  # the worker's own error event
            else:
                err = _upstream_error(e, f"worker {worker.url} failed mid-stream: {type(e).__name__}: {e}")
                await request.write((b"" if tail == b"\n\n" else b"\n\n") + b"data: " + orjson.dumps(err)
                                    + b"\n\n")
            request.end_stream()
            return None
        if mig is not None and mig.buf:
            await request.write(mig.buf)  # an unfinished last event, passed on as it came
        worker.record_success()
        request.end_stream()
        return prev + last
    except ConnectionResetError:
        return None  # the client went away; _attempt's finally releases the worker
