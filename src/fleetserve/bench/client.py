"""The asynchronous load generator of ``fleetserve bench``.

Sends :class:`~fleetserve.bench.workloads.BenchRequest` s to an
OpenAI-compatible URL (``/v1/chat/completions`` or ``/v1/completions``) with
aiohttp, streaming, and records per request:

* **TTFT**: send -> first chunk that carries text;
* **ITL**: the gaps between later text-carrying chunks (one value per chunk,
  as SGLang's ``bench_serving`` counts them; with ``--stream-interval k`` on
  the server a chunk holds ``k`` tokens); **TPOT** = (latency - TTFT) /
  (completion tokens - 1) is reported too;
* **latency** (end to end), the usage counts (``prompt_tokens``,
  ``completion_tokens``, ``prompt_tokens_details.cached_tokens``; the stream
  asks for them with ``stream_options.include_usage``);
* the **worker** that served it: the ``X-Fleetserve-Worker`` response header
  or a ``worker_id`` field in the body (sim-workers send both; our router
  forwards the body). Workers that expose neither are attributed afterwards
  from their ``/metrics`` counters (see :mod:`fleetserve.bench.worker_stats`).

Arrivals: Poisson at ``request_rate`` requests/s (``inf``: all at once),
optionally capped at ``max_concurrency`` requests in flight. A request with
``after`` set (the next turn of a conversation) is sent only once that
request finished, and no earlier than its own arrival time. A request with
``history_from`` set is sent as that request's messages, its answer (the text
that came back) as an assistant turn, then its own messages
(:func:`with_history`); when that request failed it is not sent and fails with
``error = "previous turn <rid> failed"``.

``time_scale``: when the workers' service times are stretched by ``k``
(sim-worker ``--time-scale k``), pass ``k`` here: arrivals are stretched by
``k`` and every measured duration is divided by ``k``, so the figures read in
the model's time.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from fleetserve.bench.workloads import BenchRequest

WORKER_HEADER = "X-Fleetserve-Worker"


@dataclass
class RequestResult:
    """What one request measured. Times in seconds (divided by ``time_scale``)."""

    rid: str
    group: str
    success: bool = False
    error: str = ""
    status: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0
    worker: str | None = None
    route: str | None = None  # the router's x-fleetserve-route header, when it sent one
    text: str = ""
    #: times this request was sent again after a try that failed before any byte of a response
    #: came back (``run_requests(retries=...)``); counted, never hidden
    retries: int = 0
    #: the last try failed before the response's status line arrived (nothing reached the client)
    unanswered: bool = False

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("text")
        d.pop("unanswered")
        return d


def _payload(req: BenchRequest, api: str, model: str | None, stream: bool, ignore_eos: bool) -> dict:
    body: dict = {"max_tokens": req.output_len, "temperature": 0.0, "stream": stream}
    if model:
        body["model"] = model
    if api == "chat":
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True  # SGLang/vLLM extension: produce exactly max_tokens
    return body


def _chunk_text(chunk: dict, api: str) -> str:
    out = []
    for ch in chunk.get("choices") or []:
        if api == "chat":
            out.append((ch.get("delta") or {}).get("content") or "")
        else:
            out.append(ch.get("text") or "")
    return "".join(out)


def _take_usage(res: RequestResult, usage: dict | None) -> None:
    if not usage:
        return
    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    res.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    res.cached_tokens = int(details.get("cached_tokens") or 0)


def with_history(req: BenchRequest, history: list[dict[str, str]], answer: str) -> BenchRequest:
    """``req`` with ``history + [{"role": "assistant", "content": answer}] + req.messages`` as its
    messages (a copy; ``history_from`` cleared): the next turn of a conversation after the
    model answered ``history`` with ``answer``."""
    import dataclasses

    messages = [*history, {"role": "assistant", "content": answer}, *req.messages]
    return dataclasses.replace(req, messages=messages, history_from=None)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <api_key>"}``, or no header without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def send_one(session: aiohttp.ClientSession, url: str, req: BenchRequest, api: str = "chat",
                   model: str | None = None, stream: bool = True, ignore_eos: bool = True,
                   time_scale: float = 1.0) -> RequestResult:
    """Send one request to ``url`` (the full endpoint) and measure it. Never raises on HTTP errors."""
    res = RequestResult(rid=req.rid, group=req.group)
    body = _payload(req, api, model, stream, ignore_eos)
    t0 = time.perf_counter()
    res.start = t0
    last = t0
    pieces: list[str] = []
    answered = False
    try:
        async with session.post(url, json=body) as resp:
            answered = True
            res.status = resp.status
            res.worker = resp.headers.get(WORKER_HEADER)
            res.route = resp.headers.get("x-fleetserve-route")
            if resp.status != 200:
                res.error = (await resp.text())[:500]
                return res
            if not stream:
                data = await resp.json()
                now = time.perf_counter()
                res.ttft = res.latency = (now - t0) / time_scale
                ch = (data.get("choices") or [{}])[0]
                pieces.append((ch.get("message") or {}).get("content") or ch.get("text") or "")
                _take_usage(res, data.get("usage"))
                res.worker = res.worker or data.get("worker_id")
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        res.error = json.dumps(chunk["error"])[:500]
                        return res
                    text = _chunk_text(chunk, api)
                    now = time.perf_counter()
                    if text:
                        if not pieces:
                            res.ttft = (now - t0) / time_scale
                        else:
                            res.itl.append((now - last) / time_scale)
                        last = now
                        pieces.append(text)
                    if chunk.get("usage"):
                        _take_usage(res, chunk["usage"])
                    if chunk.get("worker_id"):
                        res.worker = res.worker or chunk["worker_id"]
                res.latency = (time.perf_counter() - t0) / time_scale
            res.text = "".join(pieces)
            res.success = bool(pieces) or res.completion_tokens > 0
            if not res.success:
                res.error = "empty response"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        res.unanswered = not answered and not isinstance(e, asyncio.TimeoutError)
    return res


async def send_with_retries(session: aiohttp.ClientSession, url: str, req: BenchRequest, retries: int = 0,
                            **kw) -> RequestResult:
    """:func:`send_one`, sent again (at most ``retries`` more times) while a try fails before any
    byte of a response arrived (e.g. aiohttp's "Can not write request body" when the server closed
    a kept-alive connection): nothing of that try reached the client, so a retry cannot double-count
    tokens. ``RequestResult.retries`` says how many retries it took; a request still failing after
    them is returned failed. Timeouts and failures after the status line are never retried."""
    res = await send_one(session, url, req, **kw)
    n = 0
    while not res.success and res.unanswered and n < retries:
        n += 1
        res = await send_one(session, url, req, **kw)
    res.retries = n
    return res


async def run_requests(base_url: str, requests: list[BenchRequest], api: str = "chat", model: str | None = None,
                       request_rate: float = math.inf, max_concurrency: int | None = None, seed: int = 0,
                       stream: bool = True, ignore_eos: bool = True, time_scale: float = 1.0,
                       progress: bool = True, timeout_s: float = 3600.0,
                       api_key: str | None = None,
                       url_for=None, retries: int = 0) -> tuple[list[RequestResult], float]:
    """Drive ``requests`` against ``base_url``; returns ``(results in input order, duration in s)``.

    ``retries``: resend a request whose try failed before any byte of a response came back, at
    most this many times (:func:`send_with_retries`; counted in ``RequestResult.retries``).

    ``api_key``: sent as ``Authorization: Bearer <api_key>`` on every request.
    ``url_for``: ``(index, request) -> base URL`` to send request ``index`` somewhere else than
    ``base_url`` (traffic split over router replicas, or straight to a worker); None: all to ``base_url``.

    The duration runs from the first send to the last response (divided by ``time_scale``).
    """
    if api not in ("chat", "completions"):
        raise ValueError("api must be chat or completions")
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    url = base_url.rstrip("/") + path
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in requests:
        arrivals.append(t)
        if request_rate != math.inf and request_rate > 0:
            t += rng.expovariate(request_rate) * time_scale
    done_events = {r.rid: asyncio.Event() for r in requests}
    by_rid: dict[str, RequestResult] = {}
    sent_messages: dict[str, list[dict[str, str]]] = {}  # what each request was sent as (for history_from)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult | None] = [None] * len(requests)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req")
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    tmo = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=tmo, skip_auto_headers=("User-Agent",),
                                     headers=auth_headers(api_key)) as session:
        start = time.perf_counter()

        async def one(i: int, req: BenchRequest) -> None:
            try:
                delay = start + arrivals[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if req.after is not None and req.after in done_events:
                    await done_events[req.after].wait()
                if req.history_from is not None:
                    await done_events[req.history_from].wait()
                    prev = by_rid.get(req.history_from)
                    if prev is None or not prev.success:
                        results[i] = by_rid[req.rid] = RequestResult(
                            rid=req.rid, group=req.group, error=f"previous turn {req.history_from} failed")
                        return
                    req = with_history(req, sent_messages[req.history_from], prev.text)
                sent_messages[req.rid] = req.messages
                to = url if url_for is None else url_for(i, req).rstrip("/") + path
                kw = dict(api=api, model=model, stream=stream, ignore_eos=ignore_eos, time_scale=time_scale)
                if sem is not None:
                    async with sem:
                        results[i] = await send_with_retries(session, to, req, retries, **kw)
                else:
                    results[i] = await send_with_retries(session, to, req, retries, **kw)
                by_rid[req.rid] = results[i]
            finally:
                done_events[req.rid].set()
                if bar is not None:
                    bar.update(1)

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        finished = [r for r in results if r is not None]
        end = max((r.start + r.latency * time_scale for r in finished if r.success), default=time.perf_counter())
        duration = (end - start) / time_scale
    if bar is not None:
        bar.close()
    for r in finished:
        r.start = (r.start - start) / time_scale
    return [r for r in results if r is not None], duration
