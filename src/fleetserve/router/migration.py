"""Request migration: a stream whose worker fails after it started goes on on another worker.

Once bytes of a streamed answer reached the client, a retry would repeat them.  Instead,
when the worker fails (connection reset or closed, timeout, an error event, the worker
removed), the router sends the *same request with the answer so far appended* to another
available worker and splices that worker's events into the client's stream, so the client
sees one answer (``--max-migrations``, default 1; 0 turns this off).

What the continuation request is (built from the client's parsed body; the rest unchanged,
so sampling parameters are the same):

============================  ===========================================================
endpoint                      continuation
============================  ===========================================================
``/generate``, ``input_ids``  ``input_ids`` + the output ids so far (SGLang's events carry
                              the cumulative ``output_ids``)
``/generate``, ``text``       ``text`` + the text so far
``/v1/completions``           ``prompt`` + the text so far
``/v1/chat/completions``      ``messages`` + ``{"role": "assistant", "content": text so far}``,
                              ``continue_final_message: true``, ``add_generation_prompt:
                              false`` (vLLM's chat fields; ``fleetserve serve`` has them)
============================  ===========================================================

and ``max_tokens`` / ``max_completion_tokens`` / ``sampling_params.max_new_tokens`` less the
completion tokens so far (when absent: 16 for completions and 128 for ``/generate``, the
OpenAI and SGLang defaults; chat's absent limit stays absent).

The completion tokens so far are exact for ``/generate`` (``meta_info.completion_tokens``).  For
``/v1/completions`` and ``/v1/chat/completions`` the router asks the worker for the usage in every
chunk (``stream_options: {include_usage: true, continuous_usage_stats: true}``, vLLM's field, which
SGLang and ``fleetserve serve`` take too) and takes the count from it.  What the client did not ask
for is taken out again before the events reach it: ``usage`` in the chunks that carry choices unless
the client set ``continuous_usage_stats``, and the usage-only chunk at the end unless it set
``include_usage``.  A chunk can hold several tokens (``--stream-interval`` above 1) or a token with
no text (half of a UTF-8 character), so counting chunks would be wrong; only when a worker ignores
the field are the tokens counted as one per chunk that carried text.  A ``stream_options`` the worker
would refuse is sent as the client wrote it (the client gets the worker's 400).

How the later worker's events are rewritten: ``id`` and ``created`` (``meta_info.id`` for
``/generate``) become the first worker's; ``/generate``'s cumulative ``text`` and
``output_ids`` get the answer so far in front; chat's second ``role`` delta is dropped; usage
(``/generate``'s ``meta_info`` too) counts the original prompt's tokens (when the first worker
never said, the continuation's prompt tokens less the tokens so far) and all completion
tokens.  One ``[DONE]`` ends the stream.  A failure after the last token (the limit reached,
or a finish reason already sent) needs no worker: the router ends the stream itself.

``--max-migrations`` counts continuations that streamed; one that fails before its first
event is retried on another worker at once (up to ``--retry-max-retries`` attempts) without
using a migration.  The policy chooses the continuing worker as for a retry (the failed
one excluded); under ``kv_aware --dp-aware`` it also chooses that worker's DP rank, which the
continuation carries as any routed request does (``routed_dp_rank`` first in the body, the
``X-data-parallel-rank`` header): never the failed worker's rank, and never none.  A rank the
client set itself stays in the body and wins, as on the first attempt.

What the router counts where: at the migration the failed worker's in-flight count
(``inflight_requests{worker}``, the policies' load) drops, and under ``kv_aware`` the request's
token load and queued prefill there come off (``KvAwarePolicy.migrating``); the continuation is
then charged to the worker it goes to as a request of ``prompt + answer so far`` tokens (its
queued prefill: those less the predicted ``cached_tokens`` there) with ``max_tokens`` less the
answer so far to decode, the prefill cleared at the continuation's first event, the rest when the
answer ends.

What the router records of the continuing worker, once its continuation streams (its first
event): a ``--sticky-sessions`` session moves to it (the session's next request goes where
the conversation's KV now is, as after any other choice the session follows); its route, the
``x-fleetserve-route`` value it would have had, goes to the log at INFO
(``migration: stream moved from A to B (migration n); route: ...``), since the header itself
went out with the first worker's answer and cannot change (nor may the stream's format); and,
when the answer ends well, the policy's predicted cached tokens on it are judged against its
report (``cache_prediction_*{worker}`` of the new worker, :mod:`.prediction`).

A worker removed while it streams (``/remove_worker``, ``DELETE /workers/{url}``, the end of a
drain) is noticed at its next event.  When the stream can go on elsewhere (:meth:`Migration.leaves`)
it moves, and the removed worker's connection is closed at once, so its engine aborts the request
rather than generating the answer a second time; the removal is logged at INFO and is not counted as
the worker's failure (no ``failures``, no circuit breaker change).  A stream that cannot move
finishes on the removed worker, as non-streamed requests do.

Not migrated (today's error event instead): several prompts or ``n > 1``, ``/generate`` with
``return_logprob``, completions with ``echo`` or a token-id prompt, chat that already sets
``continue_final_message``, and an answer that streamed tool calls or reasoning deltas.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

import orjson

from .auth import swap_credential_lines
from .body_fields import put_first
from .http.client import UpstreamError
from .route_header import route_of

if TYPE_CHECKING:
    from .app import Router
    from .http.server import Request
from .workers import Worker

log = logging.getLogger("fleetserve.router")

GENERATE, COMPLETIONS, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
NATIVE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default sampling_params.max_new_tokens
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default max_tokens for /v1/completions
DONE = b"data: [DONE]\n\n"
_EVENT_END = re.compile(rb"\r?\n\r?\n")


class WorkerFailed(UpstreamError):
    """The worker failed inside a stream that still looked fine on the wire.

    ``event``: the worker's own error event (bytes, ends with a blank line), or b''.
    """

    def __init__(self, message: str, event: bytes = b"") -> None:
        super().__init__(message)
        self.event = event


class WorkerRemoved(WorkerFailed):
    """The worker was removed (``/remove_worker``, ``DELETE /workers/{url}``, a drain's end) while it streamed.

    The stream moves on like after a failure, but the removal is not the worker's fault: no
    failure is counted against it and its circuit breaker is left as it is.
    """

    def __init__(self, url: str) -> None:
        super().__init__(f"worker {url} removed")


def note_removed(worker: Worker) -> None:
    """Log (info) that a stream leaves ``worker`` because it was removed, in place of a failure warning."""
    log.info("worker %s was removed mid-stream: the stream moves to another worker and its request on %s is "
             "aborted (connection closed); not counted as a failure", worker.url, worker.url)


def split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """SSE events complete in ``buf`` (each with its blank line) and the unfinished rest."""
    out = []
    pos = 0
    for m in _EVENT_END.finditer(buf):
        out.append(buf[pos:m.end()])
        pos = m.end()
    return out, buf[pos:]


def event_data(event: bytes) -> bytes | None:
    """The ``data`` field of one event (its ``data:`` lines joined by newlines), None without one."""
    parts = [line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(parts) if parts else None


def _is_error(obj) -> bool:
    return type(obj) is dict and "error" in obj and "choices" not in obj and "text" not in obj


def _positive_int(v) -> bool:
    return type(v) is int and v > 0


def migratable(path: str, body: dict) -> bool:
    """Whether a streamed answer to ``body`` on ``path`` can be continued elsewhere (see the module doc)."""
    if path == GENERATE:
        sp = body.get("sampling_params")
        if sp is not None and (type(sp) is not dict or sp.get("n", 1) not in (1, None)):
            return False
        if body.get("return_logprob") is True:
            return False
        text, ids = body.get("text"), body.get("input_ids")
        if type(text) is str and ids is None:
            return True
        return text is None and type(ids) is list and bool(ids) and all(type(t) is int for t in ids)
    if body.get("n", 1) not in (1, None):
        return False
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if type(prompt) is list and len(prompt) == 1:
            prompt = prompt[0]
        return type(prompt) is str and body.get("echo") is not True
    if path == CHAT:
        msgs = body.get("messages")
        return type(msgs) is list and bool(msgs) and body.get("continue_final_message") is not True
    return False


def start(router: Router, path: str, body: dict, route_text, headers: bytes,
          session: str | None = None) -> Migration | None:
    """The tracker of one streamed request, or None when migration is off or the request can't migrate.

    ``session``: its ``--sticky-sessions`` key, moved to the continuing worker (None: no session)."""
    limit = router.cfg.max_migrations
    if limit <= 0 or not migratable(path, body):
        return None
    return Migration(router, path, body, route_text, headers, limit, session)


class Migration:
    """Follows one streamed answer as the client sees it, and continues it on another worker.

    :meth:`feed` takes the worker's body bytes and gives back the complete events to send
    (rewritten after a migration); :meth:`resume` does the migration after a failure.
    """

    def __init__(self, router: Router, path: str, body: dict, route_text, headers: bytes, limit: int,
                 session: str | None = None) -> None:
        self.router, self.path, self.body, self.route_text = router, path, body, route_text
        self.headers, self.limit, self.session = headers, limit, session
        self.routes: list[tuple[str, str]] = []  # (worker url, route value) of each continuation that streamed
        self.migrations = 0
        self.buf = b""
        self.text = ""  # the answer's text so far
        self.ids: list[int] | None = [] if path == GENERATE else None  # /generate's output ids so far
        self.tokens = 0  # completion tokens so far
        self.prompt_tokens: int | None = None  # the original prompt's, once a worker said
        self.first_id = self.created = None
        self.finish = None  # the finish reason sent to the client, if any
        self.usage_sent = self.done = self.role_sent = False
        self.usable = True  # False once tool calls or reasoning were streamed
        so = body.get("stream_options")
        valid = so is None or (type(so) is dict and all(
            so.get(k) is None or type(so.get(k)) is bool for k in ("include_usage", "continuous_usage_stats")))
        so = so if type(so) is dict else {}
        self.want_usage = so.get("include_usage") is True
        # the usage in every chunk: asked of the worker (exact token counts), taken out where the client did not ask.
        # A stream_options the worker would refuse is left as it is, so the client gets the worker's 400
        self.want_chunk_usage = self.want_usage and so.get("continuous_usage_stats") is True
        self.stream_options = None if path == GENERATE or self.want_chunk_usage or not valid else {
            **so, "include_usage": True, "continuous_usage_stats": True}
        # the answer when the current worker took over (its events are relative to this)
        self.rewriting = False
        self.base_text = ""
        self.base_ids: list[int] | None = None
        self.base_tokens = 0
        self.charged_tokens = 0  # of self.tokens, those already added to the policy's key (kv_aware)
        self.left_first = False  # the first worker's in-flight count was given back at the migration
        self.stays = False  # its worker was removed but the stream could not move: it finishes there
        self.tried: list[Worker] = []  # the workers this answer was on or offered to (by resume)

    def upstream_body(self, raw: bytes) -> bytes | None:
        """The body to send the first worker in place of the client's ``raw`` bytes (None: ``raw`` as is):
        its ``stream_options`` ask for the usage in every chunk, so the answer's token count is exact.

        Without a ``stream_options`` of the client's the field is put first into ``raw``, which is otherwise
        sent byte for byte (a number JSON parsers would round, such as an integer past 64 bits, stays as
        the client wrote it); with one, the body is written anew from the parsed one."""
        so = self.stream_options
        if so is None:
            return None
        if "stream_options" not in self.body:
            return put_first(raw, b"stream_options", orjson.dumps(so))
        return orjson.dumps({**self.body, "stream_options": so})

    def _unasked(self, obj) -> bool | None:
        """For a chunk that carries usage the router asked for: True to drop it (the usage-only chunk the
        client did not ask for), False to send it without its ``usage``; None: send it as it is."""
        if self.stream_options is None or type(obj) is not dict or "usage" not in obj:
            return None
        if not obj.get("choices"):  # the usage-only chunk at the end
            return True if not self.want_usage else None
        return False

    # ------------------------------------------------------------------ events
    def feed(self, chunk: bytes) -> tuple[bytes, bytes | None]:
        """(bytes to send to the client, the worker's error event or None) for one piece of body.

        Only complete events are given back; an unfinished one waits in ``buf``.  Events after
        an error event are dropped (the worker is done for).
        """
        events, self.buf = split_events(self.buf + chunk)
        out = []
        for ev in events:
            data = event_data(ev)
            if data is None:
                out.append(ev)  # a comment or another field: passed as is
                continue
            if data.strip() == b"[DONE]":
                if not self.done:
                    self.done = True
                    out.append(ev if not self.rewriting else DONE)
                continue
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                out.append(ev)
                continue
            if _is_error(obj):
                return b"".join(out), ev
            if self.rewriting:
                obj = self._rewrite(obj)
                if obj is None:
                    continue
                ev = b"data: " + orjson.dumps(obj) + b"\n\n"
            self._observe(obj)
            unasked = self._unasked(obj)
            if unasked:
                continue
            if unasked is False:
                del obj["usage"]
                ev = b"data: " + orjson.dumps(obj) + b"\n\n"
            out.append(ev)
        return b"".join(out), None

    def _observe(self, obj) -> None:
        """Update the answer so far from one event as the client sees it."""
        if type(obj) is not dict:
            return
        if self.path == GENERATE:
            text = obj.get("text")
            if type(text) is str:
                self.text = text
            ids = obj.get("output_ids")
            self.ids = ids if type(ids) is list else None
            meta = obj.get("meta_info")
            if type(meta) is dict:
                if self.first_id is None:
                    self.first_id = meta.get("id")
                if type(meta.get("prompt_tokens")) is int and self.prompt_tokens is None:
                    self.prompt_tokens = meta["prompt_tokens"]
                if type(meta.get("completion_tokens")) is int:
                    self.tokens = meta["completion_tokens"]
                if meta.get("finish_reason") is not None:
                    self.finish = meta["finish_reason"]
            return
        if self.first_id is None:
            self.first_id = obj.get("id")
            self.created = obj.get("created")
        choices = obj.get("choices")
        for c in choices if type(choices) is list else ():
            if type(c) is not dict or c.get("index", 0) != 0:
                continue
            if self.path == CHAT:
                delta = c.get("delta")
                if type(delta) is dict:
                    if delta.get("role"):
                        self.role_sent = True
                    content = delta.get("content")
                    if type(content) is str and content:
                        self.text += content
                        self.tokens += 1
                    if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
                        self.usable = False
            else:
                text = c.get("text")
                if type(text) is str and text:
                    self.text += text
                    self.tokens += 1
            if c.get("finish_reason") is not None:
                self.finish = c["finish_reason"]
        usage = obj.get("usage")
        if type(usage) is dict:
            if type(usage.get("completion_tokens")) is int:
                self.tokens = usage["completion_tokens"]
            if type(usage.get("prompt_tokens")) is int and self.prompt_tokens is None:
                self.prompt_tokens = usage["prompt_tokens"]
            if not choices:
                self.usage_sent = True

    def _usage(self, usage: dict) -> dict:
        """A later worker's usage, made to cover the whole answer: the original prompt's tokens, the whole
        answer's, and of its cached tokens (counted over the continuation's longer prompt, the original
        plus the answer so far) at most the original prompt's (a user trial saw 307 cached of 101)."""
        out = dict(usage)
        completion = (usage.get("completion_tokens") or 0) + self.base_tokens
        prompt = self.prompt_tokens
        if prompt is None:
            prompt = max(0, (usage.get("prompt_tokens") or 0) - self.base_tokens)
        out.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        details = usage.get("prompt_tokens_details")
        if type(details) is dict and type(details.get("cached_tokens")) is int:
            out["prompt_tokens_details"] = {**details, "cached_tokens": min(details["cached_tokens"], prompt)}
        return out

    def _rewrite(self, obj):
        """A later worker's event as the client must see it, or None to drop it."""
        if type(obj) is not dict:
            return obj
        if self.path == GENERATE:
            if type(obj.get("text")) is str:
                obj["text"] = self.base_text + obj["text"]
            if self.base_ids is not None and type(obj.get("output_ids")) is list:
                obj["output_ids"] = self.base_ids + obj["output_ids"]
            meta = obj.get("meta_info")
            if type(meta) is dict:
                if self.first_id is not None:
                    meta["id"] = self.first_id
                if type(meta.get("completion_tokens")) is int:
                    meta["completion_tokens"] += self.base_tokens
                if type(meta.get("cached_tokens")) is int and self.prompt_tokens is not None:
                    meta["cached_tokens"] = min(meta["cached_tokens"], self.prompt_tokens)
                fin = meta.get("finish_reason")
                if type(fin) is dict and fin.get("type") == "length" and type(fin.get("length")) is int:
                    fin["length"] += self.base_tokens  # the continuation's budget was what was left of the answer's
                if self.prompt_tokens is not None:
                    meta["prompt_tokens"] = self.prompt_tokens
            return obj
        if self.first_id is not None:
            obj["id"] = self.first_id
        if self.created is not None and "created" in obj:
            obj["created"] = self.created
        choices = obj.get("choices")
        if self.path == CHAT and type(choices) is list:
            for c in choices:
                delta = c.get("delta") if type(c) is dict else None
                if type(delta) is dict and self.role_sent:
                    delta.pop("role", None)
                    if delta.get("content") == "":
                        del delta["content"]
            keep = [c for c in choices if type(c) is not dict or c.get("delta") or c.get("finish_reason") is not None
                    or c.get("logprobs")]
            if choices and not keep and (self.stream_options is not None or not obj.get("usage")):
                return None  # the new worker's opening role chunk: the client has had one
        usage = obj.get("usage")
        if type(usage) is dict:
            obj["usage"] = self._usage(usage)
        return obj

    # ------------------------------------------------------------------ continuing
    def leaves(self, worker: Worker) -> bool:
        """Whether the stream must leave ``worker`` now because the worker was removed.

        It leaves when it can go on elsewhere: a migration left, a continuation (or an ending) to
        send, and an available worker not tried yet.  Otherwise it stays and finishes on the
        removed worker, as a non-streamed request does; that is decided once.
        """
        if not worker.removed or self.stays:
            return False
        if (self.migrations < self.limit and self.plan() is not None
                and any(w not in self.tried for w in self.router.registry.available())):
            return True
        self.stays = True
        log.info("worker %s was removed mid-stream: the stream cannot move to another worker, it finishes there",
                 worker.url)
        return False

    def _limit(self) -> tuple[str | None, int | None]:
        """(the body key of the token limit, its value) -- sampling_params' for /generate."""
        b = self.body
        if self.path == GENERATE:
            sp = b.get("sampling_params") or {}
            return "max_new_tokens", sp.get("max_new_tokens", NATIVE_DEFAULT_MAX_NEW_TOKENS)
        if self.path == COMPLETIONS:
            v = b.get("max_tokens")
            return "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS if v is None else v
        if b.get("max_completion_tokens") is not None:
            return "max_completion_tokens", b["max_completion_tokens"]
        return "max_tokens", b.get("max_tokens")

    def plan(self) -> tuple[str, bytes] | None:
        """What to do after a failure: ``("end", bytes)`` (the answer is complete; these bytes end
        the stream), ``("body", bytes)`` (the continuation request), or None (it can't go on)."""
        if not self.usable:
            return None
        key, limit = self._limit()
        if self.finish is not None or (type(limit) is int and limit - self.tokens <= 0):
            return "end", self._ending()
        new = dict(self.body)
        if self.stream_options is not None:
            new["stream_options"] = self.stream_options
        if type(limit) is int:
            if self.path == GENERATE:
                new["sampling_params"] = {**(self.body.get("sampling_params") or {}), key: limit - self.tokens}
            else:
                new[key] = limit - self.tokens
        if self.tokens or self.text:
            if self.path == GENERATE:
                if "input_ids" in self.body:
                    if self.ids is None:
                        return None  # the worker did not say which ids it produced
                    new["input_ids"] = self.body["input_ids"] + self.ids
                else:
                    new["text"] = self.body["text"] + self.text
            elif self.path == COMPLETIONS:
                prompt = self.body["prompt"]
                new["prompt"] = (prompt[0] if type(prompt) is list else prompt) + self.text
            else:
                new["messages"] = [*self.body["messages"], {"role": "assistant", "content": self.text}]
                new["continue_final_message"] = True
                new["add_generation_prompt"] = False
        return "body", orjson.dumps(new)

    def _ending(self) -> bytes:
        """The end of a complete answer the worker failed to end: a finish, usage, ``[DONE]``."""
        if self.done:
            return b""  # the worker failed after its [DONE]: the client has the whole answer
        out = []
        if self.finish is None:
            if self.path == GENERATE:
                meta = {"id": self.first_id, "prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                        "finish_reason": {"type": "length", "length": self.tokens}}
                ev = {"text": self.text, "output_ids": self.ids or [], "meta_info": meta}
            elif self.path == CHAT:
                ev = {"id": self.first_id, "object": "chat.completion.chunk", "created": self.created,
                      "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
            else:
                ev = {"id": self.first_id, "object": "text_completion", "created": self.created,
                      "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
            out.append(b"data: " + orjson.dumps(ev) + b"\n\n")
        if self.path != GENERATE and self.want_usage and not self.usage_sent and self.prompt_tokens is not None:
            p, c = self.prompt_tokens, self.tokens
            ev = {"id": self.first_id, "object": "chat.completion.chunk" if self.path == CHAT else "text_completion",
                  "created": self.created, "choices": [],
                  "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}
            out.append(b"data: " + orjson.dumps(ev) + b"\n\n")
        if not self.done:
            out.append(DONE)
        return b"".join(out)

    async def resume(self, request: Request, failed: Worker) -> bool:
        """Continue the answer after ``failed`` failed mid-stream; True when the stream was completed.

        Tries other available workers (the policy chooses, as for a retry) until one finishes the
        answer or ``--max-migrations`` continuations have started streaming.  A continuation that
        fails before its first event (refused, an error status) is retried on another worker not
        tried yet, up to ``--retry-max-retries`` attempts per migration, without counting as one.
        False: the caller ends the stream with an error event.  Raises ConnectionResetError when
        the client went away.
        """
        router = self.router
        tried = self.tried
        tried.append(failed)
        self.buf = b""  # an unfinished event of the failed worker is dropped, never sent
        if not self.left_first:  # it serves this request no more: its in-flight count drops now, not at the end
            self.left_first = True
            failed.load -= 1
        attempts = 0
        while True:
            plan = self.plan()
            if plan is None:
                return False
            kind, data = plan
            if kind == "end":
                await request.write(data)
                return True
            if self.migrations >= self.limit or attempts >= router.max_attempts:
                return False
            migrating = getattr(router.policy, "migrating", None)
            if migrating is not None:  # kv_aware: the old target's charge off now, the continuation's size
                migrating(self.route_text, self.tokens - self.charged_tokens)
                self.charged_tokens = self.tokens
            workers = [w for w in router.registry.available() if w not in tried]
            worker = router.policy.select(workers, self.route_text, retry=True) if workers else None
            if worker is None:
                return False
            tried.append(worker)
            body, headers = data, self.headers
            decorate = getattr(router.policy, "decorate", None)
            if decorate is not None:  # kv_aware --dp-aware: the rank the policy chose on the new worker
                body, headers, _ = decorate(self.route_text, data, self.headers)
                route = self.route_text.route_header() if hasattr(self.route_text, "route_header") else None
                predicted = getattr(self.route_text, "cached", None)
            else:
                route, predicted = route_of(router.policy, worker, self.route_text)
            self.rewriting = True
            self.base_text, self.base_tokens = self.text, self.tokens
            self.base_ids = list(self.ids) if self.ids is not None else None
            outcome = await self._continue_on(request, worker, body, headers, failed if not self.routes
                                              else self.routes[-1][0], route, predicted)
            if outcome == "done":
                return True
            self.buf = b""
            if outcome == "failed_before":
                attempts += 1
            else:  # it streamed, then failed: one migration used, the next one starts afresh
                attempts = 0

    def _moved(self, source, worker: Worker, route: str | None) -> None:
        """The continuation on ``worker`` streams: the session follows it, its route is logged."""
        router = self.router
        self.routes.append((worker.url, route))
        if self.session is not None and router.sessions is not None:
            router.sessions.remember(self.session, worker.url)
        src = getattr(source, "url", source)
        log.info("migration: stream moved from %s to %s (migration %d); route: %s", src, worker.url,
                 self.migrations, route if route is not None else "-")

    async def _continue_on(self, request: Request, worker: Worker, body: bytes, headers: bytes, source=None,
                           route: str | None = None, predicted: int | None = None) -> str:
        """Stream ``worker``'s answer to the continuation (``body``, extra ``headers``) into the client's stream.

        ``source``: the worker it moves from; ``route``: the route value of ``worker`` (logged);
        ``predicted``: the policy's predicted cached tokens there (judged when the answer ends well).
        Returns ``"done"`` (the answer ended well), ``"failed_before"`` (it failed before its first
        event) or ``"failed"`` (after; counted in ``migrations``).
        """
        router = self.router
        worker.load += 1
        worker.requests += 1
        resp = None
        started = False
        if worker.api_key is not None:
            headers = swap_credential_lines(headers, worker.api_key)
        prev = last = b""  # the last two chunks: the new worker's cached_tokens report is in them
        try:
            try:
                resp = await router.pool.post(worker.url, self.path, body, headers)
                if resp.status != 200 or resp.content_type != "text/event-stream":
                    await resp.read()
                    if resp.status >= 500 and resp.status != 503:
                        worker.record_failure(f"status {resp.status} to a migrated stream")
                    return "failed_before"
                while True:
                    chunk = await resp.next_chunk()
                    if not chunk:
                        break
                    if not started:
                        started = True
                        self.migrations += 1
                        router.stats.migrations += 1
                        self._moved(source, worker, route)
                        prefilled = getattr(router.policy, "prefilled", None)
                        if prefilled is not None:  # kv_aware: the continuation's prefill is over
                            prefilled(self.route_text)
                    prev, last = last, chunk
                    out, err = self.feed(chunk)
                    if out:
                        await request.write(out)
                    if err is not None:
                        worker.record_failure("an error event in a migrated stream")
                        return "failed"
                    if self.leaves(worker):  # the finally below closes the connection: the worker aborts it
                        note_removed(worker)
                        return "failed"
            except UpstreamError as e:
                worker.record_failure(f"migrated stream: {type(e).__name__}: {e}")
                return "failed" if started else "failed_before"
            if self.buf:
                await request.write(self.buf)
                self.buf = b""
            worker.record_success()
            if predicted is not None and started:
                router.predictions.observe(worker.url, predicted, prev + last)
            return "done"
        finally:
            worker.load -= 1
            if resp is not None:
                resp.release()
