"""Submit, then collect or stream: the one answer loop of every generating route.

A route validates its request, builds one :class:`SamplingParams` per prompt and
calls :func:`submit_all`; then :func:`respond` either

* collects every stream to the end (aborting them if the client disconnects
  first, 503 if the engine died meanwhile) and hands the outputs to the route's
  ``build`` function, answering its result as JSON; or
* streams: the route's ``chunks`` function turns the merged outputs into
  events, each sent as one server-sent event, then ``data: [DONE]``.

Either way every stream is aborted when the answer ends early, so the
scheduler frees its KV cache.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.entrypoints.errors import APIError
from fleetserve.entrypoints.http.lifespan import ENGINE_DIED
from fleetserve.entrypoints.http.state import ServerState
from fleetserve.entrypoints.tokenizer_manager import GenerationStream, TokenOutput

SSE_DONE = "data: [DONE]\n\n"
DISCONNECT_POLL_S = 0.2

# (position in the streams, output) as merge_streams yields them
Merged = AsyncIterator[tuple[int, TokenOutput]]
# all outputs of each stream, in stream order
Collected = list[list[TokenOutput]]


def sse(obj: Any) -> str:
    """One server-sent event holding ``obj`` as JSON (a pydantic model or plain data)."""
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"


def abort_all(streams: Sequence[GenerationStream]) -> None:
    for s in streams:
        s.abort()


def submit_all(state: ServerState, prompts: Sequence[list[int]], sampling: Sequence[SamplingParams],
               rids: Sequence[str | None] | None = None, **options: Any) -> list[GenerationStream]:
    """Send each prompt with its sampling params; the streams in order (prompt by prompt, ``n`` each).

    ``options`` go to :meth:`TokenizerManager.submit` (``return_logprob``, ...).
    When one submission fails, the streams already sent are aborted.

    Raises:
        APIError: 503 when the scheduler process has exited or takes no requests
            (no scheduler connected); the manager's own APIError (a running rid) as is.
    """
    rids = rids if rids is not None else [None] * len(prompts)
    streams: list[GenerationStream] = []
    try:
        for ids, sp, rid in zip(prompts, sampling, rids):
            if not state.engine_running():
                raise APIError("the engine is not running (its scheduler process exited)", 503, None,
                               "engine_unavailable")
            try:
                streams += state.tm.submit(ids, sp, rid=rid, **options)
            except APIError:
                raise
            except Exception as e:  # zmq.Again: no scheduler connected
                raise APIError(f"the engine is not accepting requests: {e}", 503, None,
                               "engine_unavailable") from e
    except BaseException:
        abort_all(streams)
        raise
    return streams


async def merge_streams(streams: Sequence[GenerationStream]) -> Merged:
    """Interleave several streams' outputs as they come; yields ``(position in streams, output)``.

    A failure in any stream is raised here; on exit every stream is aborted.
    """
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: GenerationStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - hand any failure to the consumer
            await queue.put((i, e))
            raise
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        abort_all(streams)


async def until_disconnect(request: Request, work: Awaitable[Any], streams: Sequence[GenerationStream]) -> Any:
    """Run ``work``; if the client goes away first, abort ``streams`` and raise APIError 499."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                abort_all(streams)
                raise APIError("client closed the request", 499)
    finally:
        if not task.done():
            task.cancel()
        abort_all(streams)


def raise_if_engine_died(collected: Collected) -> None:
    """A request cut short by a dead scheduler is a 503, not a 200 with finish reason "abort"."""
    if any(o.finish_reason == "abort" and o.abort_message == ENGINE_DIED for outs in collected for o in outs):
        raise APIError(f"{ENGINE_DIED} while generating this request", 503, None, "engine_unavailable")


async def collect(streams: Sequence[GenerationStream]) -> Collected:
    """Every output of every stream, grouped by stream. Raises APIError 503 if the engine died."""
    per: Collected = [[] for _ in streams]
    async for i, out in merge_streams(streams):
        per[i].append(out)
    raise_if_engine_died(per)
    return per


class EngineDied(Exception):
    """Raised inside a stream's chunks when its scheduler process died: the stream ends with an error."""


async def _until_engine_died(merged: Merged) -> Merged:
    async for i, out in merged:
        if out.finish_reason == "abort" and out.abort_message == ENGINE_DIED:
            raise EngineDied
        yield i, out


def engine_died_event() -> dict[str, Any]:
    """The last event of a stream cut short by a dead scheduler (OpenAI's error shape, status 503)."""
    return APIError(f"{ENGINE_DIED} while generating this request", 503, None, "engine_unavailable").to_dict()


async def sse_events(streams: Sequence[GenerationStream], chunks: Callable[[Merged], AsyncIterator[Any]]
                     ) -> AsyncIterator[str]:
    """``chunks(merged outputs)`` as server-sent events, then ``[DONE]``; aborts the streams on exit.

    When the scheduler process dies mid-stream the last event is ``{"error": {...}}`` (code ``engine_unavailable``) and
    no ``[DONE]`` follows: a client must not take a cut-short answer for a finished one.
    """
    merged = merge_streams(streams)
    events = chunks(_until_engine_died(merged))
    try:
        try:
            async for event in events:
                yield sse(event)
        except EngineDied:
            yield sse(engine_died_event())
            return
        yield SSE_DONE
    finally:
        abort_all(streams)
        await events.aclose()  # a client that went away leaves both suspended: end them now
        await merged.aclose()


async def respond(request: Request, streams: Sequence[GenerationStream], *, stream: bool,
                  build: Callable[[Collected], Any], chunks: Callable[[Merged], AsyncIterator[Any]]) -> Response:
    """Answer a submitted request.

    Args:
        request: the HTTP request (watched for a disconnect while collecting).
        streams: from :func:`submit_all`.
        stream: send server-sent events (``text/event-stream``) instead of one JSON body.
        build: collected outputs -> the JSON body (a pydantic model or plain data).
        chunks: merged ``(stream position, output)`` pairs -> the events to send.

    Raises:
        APIError: 499 when the client disconnects while collecting; 503 when the engine died.
    """
    if stream:
        return StreamingResponse(sse_events(streams, chunks), media_type="text/event-stream")
    body = build(await until_disconnect(request, collect(streams), streams))
    return JSONResponse(body.model_dump() if isinstance(body, BaseModel) else body)
