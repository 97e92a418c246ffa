"""The engine's HTTP API: a FastAPI app over a :class:`TokenizerManager`.

Routes (OpenAI-compatible and SGLang-native):

==========================  =====================================================
``POST /v1/completions``     prompt as text, texts, token ids or lists of ids; echo; logprobs; SSE
``POST /v1/chat/completions`` chat template of the model; text content parts; logprobs; SSE
``GET  /v1/models``          the served model
``POST /generate``           SGLang: ``text`` / ``input_ids``, single or batch, ``sampling_params``
``GET  /health``             the scheduler process is alive
``GET  /health_generate``    runs a one-token generation
``GET  /get_model_info``     model path, context length, vocabulary size
``GET  /get_server_info``    server arguments plus the schedulers' live stats
``POST /flush_cache``        empty the radix cache
``POST /abort_request``      abort by request id
``GET  /metrics``            Prometheus text format
==========================  =====================================================

Bodies are read and parsed here (not by FastAPI) so that every bad input gets an
OpenAI-style JSON error: malformed JSON and wrong types 400, unknown model 404,
a body over ``max_request_bytes`` 413, a wrong or missing API key 401.
A client that disconnects aborts its requests on the scheduler (streaming: the
response generator is cancelled; non-streaming: a watcher polls for the disconnect).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleetserve.entrypoints import openai_protocol as P
from fleetserve.entrypoints.errors import APIError, loc_to_param, status_phrase
from fleetserve.entrypoints.metrics import CONTENT_TYPE
from fleetserve.engine.sampling_params import SamplingParams, SamplingParamsError
from fleetserve.entrypoints.tokenizer_manager import GenerationStream, TokenizerManager, TokenOutput

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
# Paths answered without an API key (probes and scrapers).
OPEN_PATHS = {"/health", "/metrics"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ENGINE_DIED = "the scheduler process exited"


def raise_if_engine_died(outs: list[TokenOutput]) -> None:
    """A non-streaming request cut short by a dead scheduler is a 503, not a 200 with "abort"."""
    if any(o.finish_reason == "abort" and o.abort_message == ENGINE_DIED for o in outs):
        raise APIError(f"{ENGINE_DIED} while generating this request", 503)


# ------------------------------------------------------------------- body parsing


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON; 413 past ``limit`` bytes, 400 when empty or malformed."""
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise APIError(f"request body of {cl} bytes is over the limit of {limit} bytes", 413, None, "request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(f"request body is over the limit of {limit} bytes", 413, None, "request_too_large")
    if not body:
        raise APIError("request body is empty; send a JSON object", 400)
    try:
        return json.loads(bytes(body))
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"malformed JSON body: {e}", 400, None, "invalid_json") from e


def parse_model(cls: type[BaseModel], data: Any) -> Any:
    """Validate ``data`` into ``cls``; a 400 naming the first bad field otherwise."""
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", 400)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        first = errs[0]
        param = loc_to_param(first.get("loc", ()))
        top = first.get("loc", ("",))[0] if first.get("loc") else None
        same = [x for x in errs if x.get("loc") and x["loc"][0] == top]
        if len(same) > 1:  # a union: say what was expected instead of the first branch's complaint
            wanted = sorted({x["msg"].replace("Input should be ", "") for x in same})
            msg = f"invalid value for '{top}': expected {' or '.join(wanted)}"
            param = str(top)
        else:
            msg = f"invalid value for '{param}': {first['msg']}" if param else first["msg"]
        raise APIError(msg, 400, param) from None


# ------------------------------------------------------------------ small helpers


def sse(obj: Any) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def merge_streams(streams: Sequence[GenerationStream]) -> AsyncIterator[tuple[int, TokenOutput]]:
    """Interleave several streams' outputs as they come; yields ``(position in streams, output)``."""
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
        for s in streams:
            s.abort()


async def until_disconnect(request: Request, work: Awaitable[Any], streams: Sequence[GenerationStream]) -> Any:
    """Run ``work``; if the client goes away first, abort ``streams`` and answer 499."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                for s in streams:
                    s.abort()
                raise APIError("client closed the request", 499)
    finally:
        if not task.done():
            task.cancel()
        for s in streams:
            s.abort()


def usage_of(prompt_counts: list[int], cached_counts: list[int], completion: int) -> P.UsageInfo:
    prompt = sum(prompt_counts)
    return P.UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=P.PromptTokensDetails(cached_tokens=sum(cached_counts)),
    )


def stream_usage(last: dict[int, Any], n: int) -> P.UsageInfo:
    """Usage for a stream's final chunk from each choice's last output (choice ``i`` is
    sample ``i % n`` of prompt ``i // n``): prompts and cached tokens counted once per
    prompt, completion tokens summed over every choice."""
    completion = sum(o.completion_tokens for o in last.values())
    firsts = [last[i] for i in sorted(last) if i % n == 0]
    return usage_of([o.prompt_tokens for o in firsts], [o.cached_tokens for o in firsts], completion)


def sampling_fields(req: P._SamplingFields) -> dict[str, Any]:
    """OpenAI request fields -> SamplingParams names (None means "use the default")."""
    stop = req.stop
    if isinstance(stop, str):
        stop = [stop]
    return {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "stop": stop,
        "stop_token_ids": req.stop_token_ids,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "n": req.n,
    }


def sglang_finish_reason(out: TokenOutput) -> dict[str, Any] | None:
    if not out.finished:
        return None
    if out.finish_reason == "length":
        return {"type": "length", "length": out.completion_tokens}
    if out.finish_reason == "abort":
        return {"type": "abort", "message": out.abort_message}
    return {"type": "stop", "matched": out.matched_stop}


class APIKeyMiddleware:
    """Pure ASGI middleware: 401 unless ``Authorization: Bearer <api_key>`` (``OPEN_PATHS`` exempt).

    Written as plain ASGI (not ``BaseHTTPMiddleware``) so that request bodies and
    client disconnects reach the routes untouched.
    """

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = ""
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                header = v.decode("latin-1")
                break
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token.strip() == self.api_key:
            await self.app(scope, receive, send)
            return
        what = "missing" if not header else "wrong"
        resp = APIError(f"{what} API key: send 'Authorization: Bearer <key>'", 401, None, "invalid_api_key").response()
        await resp(scope, receive, send)


# ------------------------------------------------------------------------- the app


def create_app(
    tm: TokenizerManager,
    server_args: dict[str, Any] | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    is_alive: Callable[[], bool] | None = None,
) -> FastAPI:
    """Build the FastAPI app.

    Args:
        tm: the tokenizer manager (its receive loop is started on app start-up).
        server_args: reported by ``/get_server_info``.
        api_key: when set, every route but ``/health`` and ``/metrics`` needs
            ``Authorization: Bearer <api_key>`` (else 401).
        max_request_bytes: larger bodies get 413.
        is_alive: reports whether the scheduler process(es) still run (``/health``).
    """
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        tm.start()  # the receive loop runs on uvicorn's event loop
        watchdog = asyncio.get_running_loop().create_task(watch_schedulers()) if is_alive is not None else None
        yield
        if watchdog is not None:
            watchdog.cancel()

    async def watch_schedulers() -> None:
        """If a scheduler process dies, end the requests waiting on it instead of hanging."""
        while True:
            await asyncio.sleep(1.0)
            if not is_alive():
                tm.fail_all(ENGINE_DIED)

    app = FastAPI(title="fleetserve engine", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    info = tm.info
    model_name = info.served_model_name
    server_args = dict(server_args or {})

    # ------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = exc.detail if isinstance(exc.detail, str) else status_phrase(exc.status_code)
        return APIError(msg, exc.status_code).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        param = loc_to_param(errs[0].get("loc", ())) if errs else None
        return APIError(errs[0]["msg"] if errs else "invalid request", 400, param).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(f"internal error: {type(exc).__name__}: {exc}", 500).response()

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    def check_model(name: str | None) -> None:
        if name is not None and name not in (model_name, info.model_path):
            raise APIError(f"the model '{name}' does not exist; this server serves '{model_name}'", 404, "model",
                           "model_not_found")

    def submit(input_ids, sp, **kw) -> list[GenerationStream]:
        if is_alive is not None and not is_alive():
            raise APIError("the engine is not running (its scheduler process exited)", 503)
        try:
            return tm.submit(input_ids, sp, **kw)
        except APIError:
            raise
        except Exception as e:  # zmq.Again: no scheduler connected
            raise APIError(f"the engine is not accepting requests: {e}", 503) from e

    # ------------------------------------------------------------ simple routes
    @app.get("/health")
    async def health() -> Response:
        if is_alive is not None and not is_alive():
            return APIError("the scheduler process is not running", 503).response()
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        streams = submit([0], sp)
        try:
            async def run():
                async for _ in streams[0]:
                    pass
            await asyncio.wait_for(run(), 30.0)
        except asyncio.TimeoutError:
            return APIError("one-token generation did not finish in 30 s", 503).response()
        finally:
            streams[0].abort()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = P.ModelCard(id=model_name, root=info.model_path, max_model_len=info.context_length, created=int(tm.started))
        return JSONResponse(P.ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{name:path}")
    async def model_card(name: str) -> JSONResponse:
        check_model(name)
        card = P.ModelCard(id=model_name, root=info.model_path, max_model_len=info.context_length, created=int(tm.started))
        return JSONResponse(card.model_dump())

    @app.get("/get_model_info")
    async def get_model_info() -> JSONResponse:
        return JSONResponse({
            "model_path": info.model_path,
            "tokenizer_path": server_args.get("tokenizer_path") or info.model_path,
            "served_model_name": model_name,
            "is_generation": True,
            "context_length": info.context_length,
            "vocab_size": info.vocab_size,
        })

    @app.get("/get_server_info")
    async def get_server_info() -> JSONResponse:
        stats = await tm.get_stats()
        totals = tm.metrics.set_stats(stats)
        safe_args = {k: v for k, v in server_args.items() if k != "api_key"}
        return JSONResponse({
            **safe_args,
            "served_model_name": model_name,
            "context_length": info.context_length,
            "vocab_size": info.vocab_size,
            "uptime_s": time.time() - tm.started,
            "stats": totals,
            "scheduler_stats": [s.__dict__ for s in stats],
            "active_requests": len(tm.streams),
        })

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> JSONResponse:
        ok = await tm.flush_cache()
        if not ok:
            return JSONResponse({"success": False, "message": "not flushed: requests are running (or no answer)"},
                                status_code=409)
        return JSONResponse({"success": True, "message": "radix cache flushed"})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> JSONResponse:
        req = parse_model(P.AbortRequest, await read_json(request, max_request_bytes))
        rids = [r for r in list(tm.streams) if r == req.rid or r.startswith(req.rid + "-")]
        for r in rids:
            tm.abort_request(r)
        if not rids:
            tm.send_abort(req.rid)
        return JSONResponse({"success": bool(rids), "aborted": rids})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            tm.metrics.set_stats(await tm.get_stats(timeout=1.0))
        except Exception:  # stale gauges beat no metrics
            logger.exception("could not refresh scheduler stats")
        return Response(tm.metrics.render(), media_type=CONTENT_TYPE)

    # ----------------------------------------------------------- completions
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: P.CompletionRequest = parse_model(P.CompletionRequest, await read_json(request, max_request_bytes))
        check_model(req.model)
        if req.suffix is not None:
            raise APIError("'suffix' is not supported by this server", 400, "suffix", "unsupported_parameter")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("'best_of' is not supported (only best_of == n)", 400, "best_of", "unsupported_parameter")
        if req.logit_bias:
            raise APIError("'logit_bias' is not supported by this server", 400, "logit_bias", "unsupported_parameter")
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError("logprobs must be in [0, 20]", 400, "logprobs")
        prompts = completion_prompts(req.prompt)
        sp_list = []
        for p in prompts:
            sp_list.append(tm.build_sampling(
                {**sampling_fields(req), "max_new_tokens": req.max_tokens}, len(p), "max_tokens",
                default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS))
        want_lp = req.logprobs is not None
        streams: list[GenerationStream] = []
        try:
            for p, sp in zip(prompts, sp_list):
                streams += submit(p, sp, return_logprob=want_lp, top_logprobs_num=req.logprobs or 0,
                                  logprob_start_len=0 if (want_lp and req.echo) else -1)
        except BaseException:
            for s in streams:
                s.abort()
            raise
        rid = P.random_id("cmpl")
        n = req.n
        prompt_texts = [tm.tokenizer.decode(p, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                        if req.echo else "" for p in prompts]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                completion_sse(rid, streams, n, prompts, prompt_texts, req, include_usage),
                media_type="text/event-stream")
        return JSONResponse((await until_disconnect(
            request, collect_completion(rid, streams, n, prompts, prompt_texts, req), streams)).model_dump())

    def completion_prompts(prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError("prompt must not be empty", 400, "prompt")
            return [tm.encode(prompt)]
        if not prompt:
            raise APIError("prompt must not be empty", 400, "prompt")
        if isinstance(prompt[0], str):
            out = []
            for i, p in enumerate(prompt):
                if not p:
                    raise APIError(f"prompt[{i}] must not be empty", 400, "prompt")
                out.append(tm.encode(p))
            return out
        if isinstance(prompt[0], list):
            return [tm.check_input_ids(p, "prompt") for p in prompt]
        return [tm.check_input_ids(prompt, "prompt")]

    def completion_logprobs(tok_outs: list[TokenOutput], prompt: list[int] | None, echo_text_len: int,
                            top_n: int) -> P.CompletionLogprobs:
        lp = P.CompletionLogprobs()
        offset_base = 0
        if prompt is not None and tok_outs and tok_outs[0].input_logprobs is not None:
            pos = 0
            tops = tok_outs[0].input_top_logprobs or []
            for j, (val, tid) in enumerate(tok_outs[0].input_logprobs):
                t = tm.token_text(tid)
                lp.tokens.append(t)
                lp.token_logprobs.append(val)
                top = tops[j] if j < len(tops) else None
                lp.top_logprobs.append({tm.token_text(i): v for v, i in top[:top_n]} if (top and top_n) else None)
                lp.text_offset.append(pos)
                pos += len(t)
            offset_base = echo_text_len
        for o in tok_outs:
            for j, (val, tid) in enumerate(o.output_logprobs or []):
                lp.tokens.append(tm.token_text(tid))
                lp.token_logprobs.append(val)
                tops = o.output_top_logprobs[j] if o.output_top_logprobs and j < len(o.output_top_logprobs) else None
                lp.top_logprobs.append({tm.token_text(i): v for v, i in tops[:top_n]} if (tops and top_n) else
                                       ({} if top_n else None))
                off = o.token_offsets[j] if j < len(o.token_offsets) else 0
                lp.text_offset.append(offset_base + off)
        return lp

    async def collect_completion(rid, streams, n, prompts, prompt_texts, req) -> P.CompletionResponse:
        per: dict[int, list[TokenOutput]] = {i: [] for i in range(len(streams))}
        async for i, out in merge_streams(streams):
            per[i].append(out)
        raise_if_engine_died([o for v in per.values() for o in v])
        choices = []
        completion = 0
        prompt_counts, cached_counts = [], []
        for i in range(len(streams)):
            outs = per[i]
            last = outs[-1] if outs else None
            pidx = i // n
            text = "".join(o.text for o in outs)
            if req.echo:
                text = prompt_texts[pidx] + text
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(outs, prompts[pidx] if req.echo else None, len(prompt_texts[pidx]),
                                         req.logprobs)
            choices.append(P.CompletionChoice(index=i, text=text, logprobs=lp,
                                              finish_reason=last.finish_reason if last else "abort",
                                              matched_stop=last.matched_stop if last else None))
            completion += last.completion_tokens if last else 0
            if i % n == 0:
                prompt_counts.append(last.prompt_tokens if last else len(prompts[pidx]))
                cached_counts.append(last.cached_tokens if last else 0)
        return P.CompletionResponse(id=rid, model=model_name, choices=choices,
                                    usage=usage_of(prompt_counts, cached_counts, completion))

    async def completion_sse(rid, streams, n, prompts, prompt_texts, req, include_usage) -> AsyncIterator[str]:
        created = int(time.time())
        last: dict[int, TokenOutput] = {}
        sent_echo: set[int] = set()
        try:
            async for i, out in merge_streams(streams):
                pidx = i // n
                text = out.text
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs([out], prompts[pidx] if (req.echo and i not in sent_echo) else None,
                                             len(prompt_texts[pidx]), req.logprobs)
                if req.echo and i not in sent_echo:
                    text = prompt_texts[pidx] + text
                    sent_echo.add(i)
                last[i] = out
                if not text and not out.finished and not (lp and lp.tokens):
                    continue
                chunk = P.CompletionChunk(id=rid, created=created, model=model_name, choices=[
                    P.CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=out.finish_reason,
                                       matched_stop=out.matched_stop if out.finished else None)])
                yield sse(chunk)
            if include_usage:
                yield sse(P.CompletionChunk(id=rid, created=created, model=model_name, choices=[],
                                            usage=stream_usage(last, n)))
            yield SSE_DONE
        finally:
            for s in streams:
                s.abort()

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: P.ChatCompletionRequest = parse_model(P.ChatCompletionRequest, await read_json(request, max_request_bytes))
        check_model(req.model)
        if not req.messages:
            raise APIError("messages must not be empty", 400, "messages")
        if req.logit_bias:
            raise APIError("'logit_bias' is not supported by this server", 400, "logit_bias", "unsupported_parameter")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError("top_logprobs must be in [0, 20]", 400, "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true", 400, "top_logprobs")
        messages = []
        for k, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise APIError(f"content part type {part.type!r} is not supported (text only)", 400,
                                       f"messages.{k}.content.{j}.type")
                    parts.append(part.text)
                content = "\n".join(parts)
            # OpenAI's "developer" role is the newer name of "system"; chat templates know the latter
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            for extra in ("name", "tool_call_id", "tool_calls"):
                if getattr(m, extra) is not None:
                    msg[extra] = getattr(m, extra)
            messages.append(msg)
        if all(not m["content"] for m in messages):
            raise APIError("messages have no content", 400, "messages")
        ids = tm.apply_chat_template(messages, req.tools, req.add_generation_prompt, req.continue_final_message,
                                     req.chat_template_kwargs)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        sp = tm.build_sampling({**sampling_fields(req), "max_new_tokens": max_tokens}, len(ids), param)
        streams = submit(ids, sp, return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0)
        rid = P.random_id("chatcmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(chat_sse(rid, streams, req, include_usage), media_type="text/event-stream")
        return JSONResponse((await until_disconnect(request, collect_chat(rid, streams, req), streams)).model_dump())

    def chat_logprobs(outs: list[TokenOutput], top_n: int) -> P.ChatLogprobs:
        content = []
        for o in outs:
            for j, (val, tid) in enumerate(o.output_logprobs or []):
                tops = o.output_top_logprobs[j] if o.output_top_logprobs and j < len(o.output_top_logprobs) else []
                content.append(P.ChatTokenLogprob(
                    token=tm.token_text(tid), logprob=val, bytes=tm.token_bytes(tid),
                    top_logprobs=[P.TopLogprob(token=tm.token_text(i), logprob=v, bytes=tm.token_bytes(i))
                                  for v, i in (tops or [])[:top_n]]))
        return P.ChatLogprobs(content=content)

    async def collect_chat(rid, streams, req) -> P.ChatCompletionResponse:
        per: dict[int, list[TokenOutput]] = {i: [] for i in range(len(streams))}
        async for i, out in merge_streams(streams):
            per[i].append(out)
        raise_if_engine_died([o for v in per.values() for o in v])
        choices, completion = [], 0
        first_last = None
        for i in range(len(streams)):
            outs = per[i]
            last = outs[-1] if outs else None
            if i == 0:
                first_last = last
            choices.append(P.ChatChoice(
                index=i, message=P.ChatMessageOut(content="".join(o.text for o in outs)),
                logprobs=chat_logprobs(outs, req.top_logprobs or 0) if req.logprobs else None,
                finish_reason=last.finish_reason if last else "abort",
                matched_stop=last.matched_stop if last else None))
            completion += last.completion_tokens if last else 0
        prompt = first_last.prompt_tokens if first_last else 0
        cached = first_last.cached_tokens if first_last else 0
        return P.ChatCompletionResponse(id=rid, model=model_name, choices=choices,
                                        usage=usage_of([prompt], [cached], completion))

    async def chat_sse(rid, streams, req, include_usage) -> AsyncIterator[str]:
        created = int(time.time())
        last: dict[int, TokenOutput] = {}
        try:
            for i in range(len(streams)):
                yield sse(P.ChatCompletionChunk(id=rid, created=created, model=model_name, choices=[
                    P.ChatChunkChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))]))
            async for i, out in merge_streams(streams):
                last[i] = out
                lp = chat_logprobs([out], req.top_logprobs or 0) if req.logprobs else None
                if out.text or (lp and lp.content):
                    yield sse(P.ChatCompletionChunk(id=rid, created=created, model=model_name, choices=[
                        P.ChatChunkChoice(index=i, delta=P.DeltaMessage(content=out.text), logprobs=lp)]))
                if out.finished:
                    yield sse(P.ChatCompletionChunk(id=rid, created=created, model=model_name, choices=[
                        P.ChatChunkChoice(index=i, delta=P.DeltaMessage(), finish_reason=out.finish_reason)]))
            if include_usage:
                yield sse(P.ChatCompletionChunk(id=rid, created=created, model=model_name, choices=[],
                                                usage=stream_usage(last, req.n)))
            yield SSE_DONE
        finally:
            for s in streams:
                s.abort()

    # -------------------------------------------------------------- /generate
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        req: P.GenerateRequest = parse_model(P.GenerateRequest, await read_json(request, max_request_bytes))
        if (req.text is None) == (req.input_ids is None):
            raise APIError("send exactly one of 'text' and 'input_ids'", 400, "text")
        batch = isinstance(req.text, list) or (isinstance(req.input_ids, list) and req.input_ids
                                                and isinstance(req.input_ids[0], list))
        if req.text is not None:
            texts = req.text if isinstance(req.text, list) else [req.text]
            if not texts:
                raise APIError("text must not be empty", 400, "text")
            prompts = []
            for t in texts:
                if not t:
                    raise APIError("text must not be empty", 400, "text")
                prompts.append(tm.encode(t))
        else:
            raw = req.input_ids if batch else [req.input_ids]
            if not raw:
                raise APIError("input_ids must not be empty", 400, "input_ids")
            prompts = [tm.check_input_ids(p, "input_ids") for p in raw]
        sps_raw = req.sampling_params
        if isinstance(sps_raw, list):
            if len(sps_raw) != len(prompts):
                raise APIError("sampling_params list must have one entry per prompt", 400, "sampling_params")
        else:
            sps_raw = [sps_raw or {}] * len(prompts)
        rids = req.rid if isinstance(req.rid, list) else ([req.rid] if req.rid else [None] * len(prompts))
        if len(rids) != len(prompts):
            raise APIError("rid list must have one entry per prompt", 400, "rid")
        sps = []
        for p, d in zip(prompts, sps_raw):
            d = dict(d)
            try:
                base = SamplingParams.from_dict({k: v for k, v in d.items() if k != "max_new_tokens"})
            except SamplingParamsError as e:
                raise APIError(str(e), 400, f"sampling_params.{e.param}") from e
            except TypeError as e:
                raise APIError(str(e), 400, "sampling_params") from e
            fields = {k: getattr(base, k) for k in base.__dataclass_fields__ if k in d}
            fields["max_new_tokens"] = d.get("max_new_tokens", 128)
            try:
                sps.append(tm.build_sampling(fields, len(p), "max_new_tokens"))
            except APIError as e:
                if e.param and not e.param.startswith("sampling_params") and e.param not in ("prompt",):
                    e.param = f"sampling_params.{e.param}"
                raise
        streams: list[GenerationStream] = []
        try:
            for p, sp, r in zip(prompts, sps, rids):
                streams += submit(p, sp, return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num,
                                  logprob_start_len=req.logprob_start_len, rid=r)
        except BaseException:
            for s in streams:
                s.abort()
            raise
        t0 = time.perf_counter()
        if req.stream:
            return StreamingResponse(generate_sse(streams, req, batch, t0), media_type="text/event-stream")
        results = await until_disconnect(request, collect_generate(streams, req, t0), streams)
        return JSONResponse(results if batch or len(results) > 1 else results[0])

    def generate_result(s: GenerationStream, outs: list[TokenOutput], req: P.GenerateRequest, t0: float,
                        text: str, ids: list[int]) -> dict[str, Any]:
        last = outs[-1] if outs else None
        meta: dict[str, Any] = {
            "id": s.rid,
            "prompt_tokens": last.prompt_tokens if last else len(s.req.input_ids),
            "completion_tokens": last.completion_tokens if last else 0,
            "cached_tokens": last.cached_tokens if last else 0,
            "finish_reason": sglang_finish_reason(last) if last else None,
            "e2e_latency": time.perf_counter() - t0,
        }
        if req.return_logprob:
            first = outs[0] if outs else None
            meta["input_token_logprobs"] = [list(x) for x in (first.input_logprobs or [])] if first else []
            meta["output_token_logprobs"] = [list(x) for o in outs for x in (o.output_logprobs or [])]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = [[list(y) for y in x] for o in outs for x in (o.output_top_logprobs or [])]
        return {"text": text, "output_ids": ids, "meta_info": meta}

    async def collect_generate(streams, req, t0) -> list[dict[str, Any]]:
        per: dict[int, list[TokenOutput]] = {i: [] for i in range(len(streams))}
        async for i, out in merge_streams(streams):
            per[i].append(out)
        raise_if_engine_died([o for v in per.values() for o in v])
        return [generate_result(s, per[i], req, t0, "".join(o.text for o in per[i]),
                                [t for o in per[i] for t in o.token_ids]) for i, s in enumerate(streams)]

    async def generate_sse(streams, req, batch, t0) -> AsyncIterator[str]:
        per: dict[int, list[TokenOutput]] = {i: [] for i in range(len(streams))}
        try:
            async for i, out in merge_streams(streams):
                per[i].append(out)
                res = generate_result(streams[i], per[i], req, t0, "".join(o.text for o in per[i]),
                                      [t for o in per[i] for t in o.token_ids])
                if batch or len(streams) > 1:
                    res["index"] = i
                yield sse(res)
            yield SSE_DONE
        finally:
            for s in streams:
                s.abort()

    return app
