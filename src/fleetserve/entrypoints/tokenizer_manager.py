"""The HTTP process's side of the engine: tokenize, validate, talk to the scheduler(s).

Flow of one request::

    HTTP handler --prepare()--> TokenizedGenerateReq --ZMQ PUSH--> scheduler process
    HTTP handler <--GenerationStream (per-request asyncio.Queue)-- recv loop <--ZMQ PULL-- BatchTokenOut

* Messages are :mod:`fleetserve.engine.io_struct` objects framed by
  :mod:`fleetserve.engine.io_frames` (a small header, then the pickle) over
  pyzmq's asyncio sockets. The tokenizer manager *binds* both sockets (SGLang's layout);
  the scheduler process connects to them.
* One background task (:meth:`TokenizerManager._recv_loop`) receives every
  message and fans the per-request :class:`~fleetserve.engine.io_struct.ReqOutput`
  out to that request's queue; :class:`SchedulerStats` replies wake
  :meth:`get_stats` callers.
* A :class:`GenerationStream` turns a request's token messages into text with
  :class:`~fleetserve.entrypoints.detokenizer.RequestDetokenizer` (UTF-8 safe, stop
  strings held back). Stop strings are found only there (the scheduler knows EOS,
  stop token ids and lengths); when one ends the output, the stream finishes the
  request for its client and aborts it on the scheduler, which frees its KV.
* ``n > 1`` is sent as ``n`` requests sharing the prompt (the radix cache turns the
  shared prompt into one prefill); seeded requests use ``seed + i`` for sample ``i``.
* Requests arrive checked (:mod:`fleetserve.entrypoints.validation`); what only
  this side can refuse (a chat template that rejects the messages, a request id
  already running) raises :class:`~fleetserve.entrypoints.errors.APIError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from fleetserve.entrypoints.detokenizer import RequestDetokenizer
from fleetserve.entrypoints.errors import APIError
from fleetserve.engine.io_frames import decode, encode
from fleetserve.engine.io_struct import (
    AbortReq,
    BatchTokenOut,
    FlushCacheOut,
    FlushCacheReq,
    GetStatsReq,
    ReqOutput,
    SchedulerStats,
    TokenizedGenerateReq,
)
from fleetserve.entrypoints.metrics import EngineMetrics
from fleetserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def chat_template_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list | None = None,
                      add_generation_prompt: bool = True, continue_final_message: bool = False,
                      extra: dict[str, Any] | None = None) -> list[int]:
    """The prompt ids of a chat request: ``messages`` rendered with ``tokenizer``'s chat template
    (a transformers tokenizer), then encoded without special tokens (no extra BOS).

    ``continue_final_message`` leaves the final message open (no end-of-turn, no generation
    prompt, whatever ``add_generation_prompt`` says); ``extra`` (``chat_template_kwargs``) goes
    to the template as variables; ``tools`` when given. The simulated worker renders with this
    too (:mod:`fleetserve.bench.sim_tokenizer`), so its prompt counts are the engine's.

    Raises:
        APIError(400, ``messages``): the tokenizer has no chat template, or the messages do not fit it.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template; use /v1/completions", 400, "messages")
    kwargs = dict(extra or {})
    if tools:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except APIError:
        raise
    except Exception as e:  # jinja TemplateError and friends: the messages don't fit the template
        raise APIError(f"messages do not fit the model's chat template: {e}", 400, "messages") from e
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass
class ModelInfo:
    """What the HTTP process must know about the served model.

    Attributes:
        model_path: path the model was loaded from.
        served_model_name: the name clients use in ``model``.
        vocab_size: the model's vocabulary (embedding rows); valid ids are ``[0, vocab_size)``.
        context_length: maximum prompt + output tokens.
        eos_token_ids: ids that end generation.
    """

    model_path: str
    served_model_name: str
    vocab_size: int
    context_length: int
    eos_token_ids: list[int] = field(default_factory=list)


@dataclass
class TokenOutput:
    """One step of a request's output as the HTTP handlers see it.

    Attributes:
        index: which sample (``0..n-1``) of its HTTP request this belongs to.
        text: new text (UTF-8 complete, stop strings held back / removed).
        token_ids: the tokens consumed for this step.
        token_offsets: per token, offset of its text in the whole output (characters).
        output_logprobs / output_top_logprobs: per token, as in ``ReqOutput`` (when asked).
        input_logprobs / input_top_logprobs: prompt logprobs (first message only).
        finished: last step; then ``finish_reason`` is OpenAI's (``stop``/``length``/``abort``)
            and ``matched_stop`` the stop token id or string (or None).
        prompt_tokens / completion_tokens / cached_tokens: counts so far.
    """

    index: int
    text: str
    token_ids: list[int]
    token_offsets: list[int]
    finished: bool
    finish_reason: str | None
    matched_stop: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    abort_message: str | None = None


class GenerationStream:
    """The output of one scheduler request (one sample), as text steps.

    Iterate with ``async for out in stream`` to get :class:`TokenOutput` items; the
    last has ``finished=True``. Call :meth:`abort` when the consumer goes away.
    """

    def __init__(self, manager: "TokenizerManager", req: TokenizedGenerateReq, index: int):
        self.manager = manager
        self.req = req
        self.rid = req.rid
        self.index = index
        self.queue: asyncio.Queue[ReqOutput] = asyncio.Queue()
        self.detok = RequestDetokenizer(manager.tokenizer, req.sampling, per_token=req.return_logprob)
        self.finished = False
        self.created = time.perf_counter()
        self.last_time: float | None = None
        self.completion_tokens = 0

    def __aiter__(self) -> AsyncIterator[TokenOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenOutput]:
        try:
            while not self.finished:
                out = await self.queue.get()
                yield self._step(out)
        finally:
            if not self.finished:  # consumer left early (client disconnect, error)
                self.abort()

    def _step(self, out: ReqOutput) -> TokenOutput:
        now = time.perf_counter()
        m = self.manager.metrics
        n_new = len(out.new_token_ids)
        if n_new:
            if self.last_time is None:
                m.observe_first_token(now - self.created)
                m.observe_tokens(n_new - 1, 0.0)
            else:
                m.observe_tokens(n_new, now - self.last_time)
            self.last_time = now
        step = self.detok.feed(out)
        self.completion_tokens = step.completion_tokens
        finish_reason = matched = abort_msg = None
        if step.finished:
            finish_reason, matched, abort_msg = _openai_finish_reason(step.finish_reason, self.detok.matched)
        res = TokenOutput(
            index=self.index,
            text=step.text,
            token_ids=step.token_ids,
            token_offsets=step.token_offsets,
            finished=step.finished,
            finish_reason=finish_reason,
            matched_stop=matched,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=out.cached_tokens,
            output_logprobs=step.output_logprobs,
            output_top_logprobs=step.output_top_logprobs,
            input_logprobs=out.input_logprobs,
            input_top_logprobs=out.input_top_logprobs,
            abort_message=abort_msg,
        )
        if step.finished:
            self.finished = True
            if step.abort_scheduler:  # a stop string ended it: the scheduler stops and frees the KV now
                self.manager.send_abort(self.rid)
            self.manager.forget(self.rid)
            m.observe_finished(out.prompt_tokens, self.completion_tokens, out.cached_tokens, now - self.created)
        return res

    def abort(self) -> None:
        """Stop generating for this request and free its KV (no-op once finished)."""
        if not self.finished:
            self.finished = True
            self.manager.send_abort(self.rid)
            self.manager.forget(self.rid)


def _openai_finish_reason(fr: dict[str, Any] | None, matched_text: str | None) -> tuple[str | None, Any, str | None]:
    """Scheduler finish reason -> (OpenAI finish_reason, matched stop, abort message)."""
    if fr is None:
        return "stop", matched_text, None
    kind = fr.get("type")
    if kind == "length":
        return "length", None, None
    if kind == "abort":
        return "abort", None, str(fr.get("message") or "aborted")
    return "stop", fr.get("matched", matched_text), None


class TokenizerManager:
    """Owns the tokenizer and the ZMQ sockets to the scheduler process(es).

    Args:
        tokenizer: a transformers tokenizer (``encode``, ``decode``, ``apply_chat_template``).
        model_info: see :class:`ModelInfo`.
        send_endpoint: ZMQ address of the PUSH socket (schedulers' input), e.g. ``ipc:///tmp/x``.
        recv_endpoint: ZMQ address of the PULL socket (schedulers' outputs).
        metrics: metrics sink (a fresh :class:`EngineMetrics` by default).
        bind: bind both sockets (the schedulers connect); False: connect to theirs.
        num_schedulers: how many scheduler processes answer a :class:`GetStatsReq`
            (DP replicas each answer once).
    """

    def __init__(
        self,
        tokenizer: Any,
        model_info: ModelInfo,
        send_endpoint: str,
        recv_endpoint: str,
        metrics: EngineMetrics | None = None,
        num_schedulers: int = 1,
        bind: bool = True,
    ):
        self.tokenizer = tokenizer
        self.info = model_info
        self.metrics = metrics or EngineMetrics(model_info.served_model_name)
        self.num_schedulers = num_schedulers
        self.send_endpoint = send_endpoint
        self.recv_endpoint = recv_endpoint
        self.ctx = zmq.asyncio.Context()
        # Sending uses a plain (synchronous) socket: a NOBLOCK send then raises at once when no
        # scheduler is connected (an asyncio socket would park the error on a future nobody awaits).
        self.sync_ctx = zmq.Context()
        self.send_sock = self.sync_ctx.socket(zmq.PUSH)
        self.send_sock.setsockopt(zmq.LINGER, 0)
        self.send_sock.setsockopt(zmq.SNDHWM, 0)  # no cap: a burst of requests must queue, not fail
        (self.send_sock.bind if bind else self.send_sock.connect)(send_endpoint)
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.setsockopt(zmq.LINGER, 0)
        self.recv_sock.setsockopt(zmq.RCVHWM, 0)
        (self.recv_sock.bind if bind else self.recv_sock.connect)(recv_endpoint)
        self.streams: dict[str, GenerationStream] = {}
        self.latest_stats: dict[int, SchedulerStats] = {}
        self._stats_event = asyncio.Event()
        self._stats_seq = 0
        self._flush_replies: list[bool] = []
        self._flush_event = asyncio.Event()
        self._recv_task: asyncio.Task | None = None
        self._send_lock = asyncio.Lock()
        self.started = time.time()

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the receive loop (call from inside the running event loop)."""
        if self._recv_task is None:
            self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            try:
                await self._recv_task
            except (asyncio.CancelledError, Exception):
                pass
            self._recv_task = None
        self.send_sock.close(0)
        self.recv_sock.close(0)
        self.ctx.term()
        self.sync_ctx.term()

    async def _recv_loop(self) -> None:
        while True:
            try:
                msg = decode(await self.recv_sock.recv_multipart())
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad message must not kill the loop
                logger.exception("bad message from scheduler")
                continue
            if isinstance(msg, BatchTokenOut):
                for out in msg.outputs:
                    s = self.streams.get(out.rid)
                    if s is not None:
                        s.queue.put_nowait(out)
            elif isinstance(msg, FlushCacheOut):
                self._flush_replies.append(bool(msg.success))
                self._flush_event.set()
            elif isinstance(msg, SchedulerStats):
                self.latest_stats[msg.dp_rank] = msg
                self._stats_seq += 1
                self._stats_event.set()
            else:
                logger.warning("unexpected message from scheduler: %r", type(msg).__name__)

    def _send(self, obj: Any) -> None:
        """Queue one message for the scheduler(s); raises ``zmq.Again`` when none is connected."""
        self.send_sock.send_multipart(encode(obj), flags=zmq.NOBLOCK)

    def send_abort(self, rid: str) -> None:
        try:
            self._send(AbortReq(rid))
        except zmq.ZMQError:
            logger.exception("could not send abort for %s", rid)

    def forget(self, rid: str) -> None:
        self.streams.pop(rid, None)

    def fail_all(self, message: str) -> None:
        """End every running request with an abort (the scheduler process died)."""
        for rid, s in list(self.streams.items()):
            s.queue.put_nowait(ReqOutput(rid, [], True, {"type": "abort", "message": message},
                                         len(s.req.input_ids), s.completion_tokens, 0))

    def abort_request(self, rid: str) -> bool:
        """Abort by request id (``/abort_request``); True when it was running here.

        The scheduler frees the request and answers with its abort output, which
        ends the request's stream like any last output, so its client gets the
        tokens so far and ``finish_reason`` abort instead of waiting forever.
        """
        self.send_abort(rid)
        return rid in self.streams

    async def flush_cache(self, timeout: float = 5.0) -> bool:
        """Ask every scheduler to empty its radix cache; True when all did.

        A scheduler refuses (False) while it has queued or running requests.
        """
        self._flush_replies = []
        try:
            self._send(FlushCacheReq())
        except zmq.ZMQError:
            return False
        deadline = time.monotonic() + timeout
        while len(self._flush_replies) < self.num_schedulers:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._flush_event.clear()
            try:
                await asyncio.wait_for(self._flush_event.wait(), left)
            except asyncio.TimeoutError:
                return False
        return all(self._flush_replies)

    async def get_stats(self, timeout: float = 2.0) -> list[SchedulerStats]:
        """Ask every scheduler for fresh stats; return the newest per DP rank (may be stale on timeout)."""
        seen_before = self._stats_seq
        try:
            self._send(GetStatsReq())
        except zmq.ZMQError:  # no scheduler connected: the last stats we have
            return [self.latest_stats[k] for k in sorted(self.latest_stats)]
        deadline = time.monotonic() + timeout
        while self._stats_seq - seen_before < self.num_schedulers:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._stats_event.clear()
            try:
                await asyncio.wait_for(self._stats_event.wait(), left)
            except asyncio.TimeoutError:
                break
        return [self.latest_stats[k] for k in sorted(self.latest_stats)]

    async def wait_connected(self, timeout: float = 30.0) -> None:
        """Return once every scheduler has answered a stats request over both sockets.

        The schedulers' "ready" handshake only says the model is loaded; their ZMQ
        connections to this process may still be settling. Serving before a round
        trip succeeded would answer the first requests with 503.
        Raises RuntimeError after ``timeout`` seconds.
        """
        self.start()
        deadline = time.monotonic() + timeout
        while True:
            before = self._stats_seq
            await self.get_stats(timeout=0.5)
            if self._stats_seq - before >= self.num_schedulers:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"schedulers did not answer over ZMQ within {timeout:.0f} s")
            await asyncio.sleep(0.02)

    # -------------------------------------------------------------- tokenizing
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            extra: dict[str, Any] | None = None) -> list[int]:
        """Render messages with the model's chat template and tokenize (no extra BOS); see :func:`chat_template_ids`."""
        return chat_template_ids(self.tokenizer, messages, tools, add_generation_prompt, continue_final_message, extra)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs; may hold U+FFFD for a partial character)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """UTF-8 bytes of one token (byte-level BPE: the exact bytes; otherwise its text's)."""
        conv = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        tok = conv(token_id) if conv else None
        if isinstance(tok, str):
            decoder = byte_decoder()
            if all(ch in decoder for ch in tok):
                return [decoder[ch] for ch in tok]
        return list(self.token_text(token_id).encode("utf-8"))

    # ---------------------------------------------------------------- submitting
    def submit(self, input_ids: list[int], sampling: SamplingParams, *, return_logprob: bool = False,
               top_logprobs_num: int = 0, logprob_start_len: int = -1, stream: bool = False,
               rid: str | None = None, routed_dp_rank: int | None = None) -> list[GenerationStream]:
        """Send ``sampling.n`` requests for one prompt; return their streams (index order).

        ``routed_dp_rank`` (checked by the caller, see
        :func:`fleetserve.entrypoints.validation.resolve_routed_dp_rank`) sends every
        sample to that DP rank; None lets the DP controller choose.
        """
        n = sampling.n
        base = rid or uuid.uuid4().hex
        streams = []
        for i in range(n):
            sp = dataclasses.replace(sampling, n=1, stop=list(sampling.stop), stop_token_ids=list(sampling.stop_token_ids))
            if n > 1 and sp.seed is not None:
                sp.seed = sp.seed + i
            req = TokenizedGenerateReq(
                rid=base if n == 1 else f"{base}-{i}",
                input_ids=list(input_ids),
                sampling=sp,
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num,
                logprob_start_len=logprob_start_len,
                # Always stream from the scheduler: stop strings are checked here as tokens arrive.
                stream=True,
                routed_dp_rank=routed_dp_rank,
            )
            if req.rid in self.streams:
                raise APIError(f"request id {req.rid!r} is already running", 400, "rid")
            s = GenerationStream(self, req, i)
            self.streams[req.rid] = s
            streams.append(s)
        try:
            for s in streams:
                self._send(s.req)
        except Exception:
            for s in streams:
                s.abort()
            raise
        return streams


_BYTE_DECODER: dict[str, int] | None = None


def byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: printable stand-in character -> byte (the inverse of its byte map)."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        chars = keep[:]
        extra = 0
        for b in range(256):
            if b not in keep:
                keep.append(b)
                chars.append(256 + extra)
                extra += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(keep, chars)}
    return _BYTE_DECODER
