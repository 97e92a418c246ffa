"""``fleetserve sim-worker``: simulated engine workers speaking the engine's HTTP API.

Each worker is an aiohttp server with ``/v1/completions``,
``/v1/chat/completions``, ``/generate`` (streaming or not), ``/health``,
``/v1/models``, ``/get_model_info``, ``/get_server_info``, ``/get_load``, ``/v1/loads``,
``/metrics`` and ``/flush_cache``. Behind it a :class:`~fleetserve.bench.sim_engine.SimEngine`
keeps the engine's real radix cache and answers after the modelled service
time. Usage reports ``prompt_tokens_details.cached_tokens`` like a real worker.

One process can host many workers: ``--num-workers N`` opens ports
``--port .. --port + N - 1``, all on one event loop.

With ``--kv-events-config`` each worker's radix cache publishes KV-cache events
as an engine does (docs/kv_events.md), worker ``i`` on the endpoints' ports + ``i``;
its ``/get_server_info`` reports that worker's own config (endpoints already
offset) with ``page_size`` and ``dp_size``, so a router finds the stream from
the worker URL alone. ``/get_load`` and ``/v1/loads`` answer in the engine's
(SGLang's) shapes, built by the same code (:mod:`fleetserve.entrypoints.load_view`).

``--loads-api vllm`` shows a router the load surface of a vLLM server instead: ``/get_load``
and ``/v1/loads`` answer FastAPI's 404 (``{"detail":"Not Found"}``), and ``/metrics`` adds,
per DP rank (label ``engine``), the series vLLM v1 exports (``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` and vLLM's token counters, as
:mod:`fleetserve.entrypoints.metrics_compat` names them) and ``vllm:cache_config_info``, whose
``num_gpu_blocks`` is the rank's pool in pages plus vLLM's null block, so that
``vllm:kv_cache_usage_perc`` (vLLM's ``1 - free / (num_gpu_blocks - 1)``) is exactly
``kv_used_tokens / kv_pool_size``. ``/get_server_info`` is the same in both.

``--dp-size D`` gives each worker ``D`` DP-attention ranks, each its own
:class:`SimEngine` with its own radix cache and KV pool (as SGLang's DP attention
keeps one per rank). A request names its rank as SGLang's router sends it
(``routed_dp_rank`` in the body) or vLLM's (header ``X-data-parallel-rank``);
without one the worker takes its ranks in turn (SGLang's default round-robin
DP balancer). Rank ``r`` of worker ``i`` publishes KV events on the endpoints'
ports + ``i * D + r``.

Bad input: the body and its sampling values go through the engine's own checks
(:func:`fleetserve.entrypoints.request_parse.parse_model` with the engine's pydantic request
models, then :mod:`fleetserve.entrypoints.validation`), so a bad value gets the engine's 400
(same message and ``param``); the values are checked, not applied (the output is synthetic).
A ``model`` other than ``--model-name`` gets the engine's 404 ``model_not_found``.

Worker identity: every response carries the header ``X-Fleetserve-Worker`` and
a top-level ``"worker_id"`` field (in the usage chunk when streaming), so the
bench can attribute hits to workers through any router.

Streamed OpenAI answers take ``stream_options`` as vLLM does: ``include_usage`` adds a last
usage-only chunk, and ``continuous_usage_stats`` with it puts the usage so far in every chunk
(the router asks for that to count a migrating stream's tokens exactly).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fleetserve.bench import timing_model
from fleetserve.bench.sim_args import build_parser, check_args
from fleetserve.bench.sim_engine import RequestTooLong, SimEngine, SimEngineError, SimRequest
from fleetserve.bench.sim_tokenizer import make_tokenizer
from fleetserve.engine.kv_events.config import parse_kv_events_config
from fleetserve.engine.kv_events.publisher import make_publisher
from fleetserve.entrypoints.errors import APIError, model_not_found
from fleetserve.entrypoints.load_view import (
    LoadsQueryError, legacy_load, loads_body, loads_prometheus, parse_loads_query, select_ranks,
)
from fleetserve.entrypoints.metrics import CONTENT_TYPE
from fleetserve.entrypoints.metrics_compat import VLLM
from fleetserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from fleetserve.entrypoints.ports import port_range_error
from fleetserve.entrypoints.request_parse import parse_model
from fleetserve.entrypoints.server_info import router_discovery_fields
from fleetserve.entrypoints.tool_messages import template_messages
from fleetserve.entrypoints.validation import (
    chat_messages, chat_sampling, check_chat_request, check_input_ids, completion_sampling, native_sampling,
)

WORKER_HEADER = "X-Fleetserve-Worker"
MAX_BODY_BYTES = 8 * 1024 * 1024  # the engine's default --max-request-bytes (entrypoints/http/state.py): 413 past it
LOADS_APIS = ("sglang", "vllm")  # --loads-api
# FastAPI's answer (vLLM's server) for a route it does not have: 404, this body, compact JSON
FASTAPI_NOT_FOUND = '{"detail":"Not Found"}'


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "internal_server_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}},
                             status=status)


def _api_error(e: APIError) -> web.Response:
    """The engine's error body for ``e`` (``fleetserve.entrypoints.errors.APIError``), same status."""
    return web.json_response(e.to_dict(), status=e.status)


@web.middleware
async def _json_http_errors(request: web.Request, handler):
    """aiohttp's own 404 / 405 (and other HTTP errors it raises) in the engine's JSON error shape, not plain text."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error" if e.status < 500 else \
            "internal_server_error"
        message = f"no route for {request.path}" if e.status == 404 else \
            f"{request.method} is not allowed on {request.path}" if e.status == 405 else e.reason
        return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": None}},
                                 status=e.status, headers={k: v for k, v in e.headers.items() if k == "Allow"})


def chat_prompt_ids(tok, request: ChatCompletionRequest) -> list[int]:
    """The prompt ids of a chat request, built as the engine builds them (entrypoints/http/chat.py):
    its checks and message shaping (:func:`check_chat_request`, :func:`chat_messages`,
    :func:`template_messages`), then ``tok.encode_chat`` with ``tools``, ``add_generation_prompt``,
    ``continue_final_message`` and ``chat_template_kwargs``. Raises the engine's :class:`APIError`."""
    check_chat_request(request)
    messages, tools = template_messages(chat_messages(request), request.tools, tok.chat_template)
    return tok.encode_chat(messages, tools, request.add_generation_prompt, request.continue_final_message,
                           request.chat_template_kwargs)


async def _fastapi_not_found(_req: web.Request) -> web.Response:
    """What a vLLM server answers on a route it lacks (``/v1/loads``, ``/get_load``), whatever the method."""
    return web.Response(body=FASTAPI_NOT_FOUND.encode(), status=404, headers={"Content-Type": "application/json"})


class _VllmRanks:
    """A ``prometheus_client`` collector of the series vLLM v1's Prometheus logger exports per engine
    (here: per DP rank, label ``engine``), from one scrape's figures of every rank.

    Args:
        model_name: the ``model_name`` label.
        ranks: ``(stats, page_size)`` of each rank in rank order (``stats.dp_rank`` set).
    """

    def __init__(self, model_name: str, ranks: list):
        self.model_name = model_name
        self.ranks = ranks

    def collect(self):
        for name, kind, doc, get in VLLM:  # the names and values ``fleetserve serve`` exports for vLLM
            fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc,
                                                                                  labels=["model_name", "engine"])
            for s, _page in self.ranks:
                fam.add_metric([self.model_name, str(s.dp_rank)], float(get(s)))
            yield fam
        # vLLM's info gauge: the cache config's fields as string labels, value 1; no model_name label.
        # num_gpu_blocks counts vLLM's null block (never handed out), hence the pool's pages + 1
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "cache_dtype", "enable_prefix_caching",
                                         "gpu_memory_utilization", "num_gpu_blocks", "engine"])
        for s, page in self.ranks:
            info.add_metric([str(page), "auto", "True", "0.9", str(s.kv_pool_size // page + 1), str(s.dp_rank)], 1.0)
        yield info


def _unavailable(e: SimEngineError) -> APIError:
    """The engine's answer when its scheduler is gone: 503 ``engine_unavailable``."""
    return APIError(str(e), 503, None, "engine_unavailable")


class SimWorker:
    """One simulated worker: an HTTP app around a :class:`SimEngine`."""

    def __init__(self, engine: SimEngine | list[SimEngine], tokenizer, model_name: str, stream_interval: int,
                 url: str, kv_events_config: str | None = None, loads_api: str = "sglang"):
        if loads_api not in LOADS_APIS:
            raise ValueError(f"loads_api must be one of {LOADS_APIS}, got {loads_api!r}")
        self.loads_api = loads_api
        self.engines = list(engine) if isinstance(engine, (list, tuple)) else [engine]
        self.engine = self.engines[0]  # rank 0: the worker's name, model and KV-event endpoint
        self._next_rank = 0
        self.kv_events_config = kv_events_config
        self.tok = tokenizer
        self.model_name = model_name
        self.stream_interval = stream_interval
        self.url = url
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_http_errors])
        r = self.app.router
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/v1/models", self.models)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/get_model_info", self.model_info)
        if loads_api == "vllm":  # a vLLM server has neither route
            r.add_route("*", "/get_load", _fastapi_not_found)
            r.add_route("*", "/v1/loads", _fastapi_not_found)
        else:
            r.add_get("/get_load", self.get_load)
            r.add_get("/v1/loads", self.get_loads)
        r.add_get("/metrics", self.metrics)
        r.add_route("*", "/flush_cache", self.flush_cache)

    # ----------------------------------------------------------- small routes
    async def health(self, _req: web.Request) -> web.Response:
        """200 ``OK``; 503 ``engine_unavailable`` (the engine's answer) once a rank's loop has failed."""
        dead = next((e for e in self.engines if e.error is not None), None)
        if dead is not None:
            return _api_error(_unavailable(SimEngineError(f"the simulated engine {dead.name!r} stopped: "
                                                          f"{dead.error}")))
        return web.Response(text="OK", headers={WORKER_HEADER: self.engine.name})

    async def models(self, _req: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "fleetserve-sim",
             "max_model_len": self.engine.model.max_total_tokens}]})

    async def model_info(self, _req: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_name, "tokenizer_path": self.tok.name,
                                  "is_generation": True})

    def _own_kv_events_config(self) -> str | None:
        """This worker's ``--kv-events-config`` JSON text with its own (offset) endpoints, or None."""
        pub = self.engine.event_sink
        if self.kv_events_config is None or pub is None:
            return None
        cfg = json.loads(self.kv_events_config)
        cfg["endpoint"] = pub.endpoint
        if pub.replay_endpoint is not None:
            cfg["replay_endpoint"] = pub.replay_endpoint
        return json.dumps(cfg)

    async def server_info(self, _req: web.Request) -> web.Response:
        discovery = router_discovery_fields({"page_size": self.engine.model.page_size,
                                             "chunked_prefill_size": self.engine.model.chunked_prefill_size,
                                             "dp_size": len(self.engines),
                                             "kv_events_config": self._own_kv_events_config()})
        stats = {k: sum(e.stats[k] for e in self.engines) for k in self.engine.stats}
        return web.json_response({"model_path": self.model_name, "worker_id": self.engine.name, "url": self.url,
                                  "tokenizer": self.tok.name, "stream_interval": self.stream_interval,
                                  "timing_model": self.engine.model.to_dict(), "stats": stats,
                                  "load": self.engine.load(), **discovery,
                                  "scheduler_stats": [s.__dict__ for s in self._rank_stats()]})

    def _rank_stats(self) -> list:
        """Each rank's SchedulerStats, ``dp_rank`` set."""
        import dataclasses

        return [dataclasses.replace(e.scheduler_stats(), dp_rank=r) for r, e in enumerate(self.engines)]

    def _pick(self, req: web.Request, body: dict) -> SimEngine:
        """The rank's engine, chosen as the engine's DP controller does (docs/load-and-metrics.md): the
        ``X-data-parallel-rank`` header (vLLM's) wins over ``routed_dp_rank`` (SGLang's; its older name
        ``data_parallel_rank``); without either the ranks take turns.

        Raises ``ValueError`` (the engine's 400 messages) for a header that is not an integer or a rank
        outside ``[0, dp_size)``."""
        n = len(self.engines)
        raw = req.headers.get("X-data-parallel-rank")
        if raw is not None:
            try:
                raw = int(raw)
            except ValueError:
                raise ValueError(f"Invalid X-Data-Parallel-Rank header: must be an integer, got {raw!r}") from None
        else:
            raw = body.get("routed_dp_rank", body.get("data_parallel_rank"))
        if raw is None:
            r = self._next_rank
            self._next_rank = (r + 1) % n
            return self.engines[r]
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError(f"routed_dp_rank must be an integer, got {raw!r}")
        if not 0 <= raw < n:
            raise ValueError(f"routed_dp_rank={raw} out of range [0, {n})")
        return self.engines[raw]

    async def get_load(self, _req: web.Request) -> web.Response:
        """SGLang's older per-rank list, as ``fleetserve serve`` answers it (one rank)."""
        return web.json_response(legacy_load(self._rank_stats(), time.perf_counter()))

    async def get_loads(self, req: web.Request) -> web.Response:
        """SGLang's ``/v1/loads`` (query ``dp_rank``, ``include``, ``format``), as ``fleetserve serve`` answers it."""
        try:
            fmt, dp_rank = parse_loads_query(req.query)
        except LoadsQueryError as e:
            return _error(400, str(e), e.param)
        try:
            stats = select_ranks(self._rank_stats(), len(self.engines), dp_rank)
        except ValueError as e:
            return _error(400, str(e), "dp_rank")
        if fmt == "prometheus":
            return web.Response(body=loads_prometheus(stats), headers={"Content-Type": CONTENT_TYPE})
        return web.json_response(loads_body(stats, len(self.engines)))

    async def metrics(self, _req: web.Request) -> web.Response:
        w = self.engine.name
        s = {k: sum(e.stats[k] for e in self.engines) for k in self.engine.stats}
        ld = {k: sum(e.load()[k] for e in self.engines) for k in self.engine.load()}
        lines = []
        for key, kind in (("num_requests", "counter"), ("prompt_tokens", "counter"), ("cached_tokens", "counter"),
                          ("generation_tokens", "counter")):
            lines += [f"# TYPE fleetserve:{key}_total {kind}", f'fleetserve:{key}_total{{worker="{w}"}} {s[key]}']
        for key in ("num_running_reqs", "num_waiting_reqs", "cache_tokens"):
            lines += [f"# TYPE fleetserve:{key} gauge", f'fleetserve:{key}{{worker="{w}"}} {ld[key]}']
        sinks = [e.event_sink for e in self.engines if e.event_sink is not None]
        if sinks:  # KV-event batches (--kv-events-config), as the engine's /metrics names them
            for key in ("published", "dropped"):
                n = sum(getattr(ev, key) for ev in sinks)
                lines += [f"# TYPE fleetserve:kv_events_{key}_total counter",
                          f'fleetserve:kv_events_{key}_total{{worker="{w}"}} {n}']
        text = "\n".join(lines) + "\n"
        if self.loads_api == "vllm":
            text += self._vllm_metrics()
        return web.Response(text=text, content_type="text/plain")

    def _vllm_metrics(self) -> str:
        """The vLLM series of every rank (:class:`_VllmRanks`), rendered by ``prometheus_client``."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_VllmRanks(self.model_name, [(s, e.model.page_size)
                                                       for s, e in zip(self._rank_stats(), self.engines)]))
        return generate_latest(registry).decode()

    async def flush_cache(self, _req: web.Request) -> web.Response:
        if any(e.waiting or e.running for e in self.engines):
            return _error(400, "cannot flush the cache while requests are queued or running")
        if all([e.flush_cache() for e in self.engines]):
            return web.Response(text="Cache flushed.\n")
        return _error(400, "cannot flush the cache while requests are queued or running")

    # ----------------------------------------------------------- generation
    async def _body(self, req: web.Request) -> dict:
        try:
            body = await req.json()
        except web.HTTPRequestEntityTooLarge:  # the engine's 413 (entrypoints/http/body.py)
            raise APIError(f"request body is over the limit of {MAX_BODY_BYTES} bytes", 413, None,
                           "request_too_large") from None
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise ValueError("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ValueError("request body must be a JSON object")
        return body

    def _new_request(self, input_ids: list[int], max_new: int, engine: SimEngine | None = None,
                     sample: int = 0) -> SimRequest:
        """One sequence to generate; ``sample`` ``i`` > 0 (choice ``i`` of ``n``) gets its own output."""
        cap = (engine or self.engine).capacity
        if len(input_ids) + max_new > cap:  # before synthesizing a huge output
            raise RequestTooLong(f"prompt ({len(input_ids)} tokens) + max_tokens ({max_new}) exceeds the KV "
                                 f"capacity ({cap} tokens)")
        out_ids, pieces = self.tok.synth_output(input_ids if sample == 0 else [*input_ids, sample], max_new)
        return SimRequest(rid=uuid.uuid4().hex, input_ids=input_ids, max_new_tokens=max_new, output_ids=out_ids,
                          output_pieces=pieces, stream_interval=self.stream_interval)

    def _check_model(self, name: str | None) -> None:
        """No name or ``--model-name``; else the engine's 404 ``model_not_found`` (APIError)."""
        if name is not None and name != self.model_name:
            raise model_not_found(name, self.model_name)

    async def completions(self, req: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(req)
            request = parse_model(CompletionRequest, body)  # the engine's body checks: its errors
            self._check_model(request.model)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = self.tok.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in prompt):
                ids = check_input_ids(prompt, self.tok.vocab_size, "prompt")  # the engine's 400 for a bad id
            else:
                raise ValueError("prompt must be a non-empty string or a list of token ids")
            # the engine's own checks of the sampling values (entrypoints/validation.py)
            sp = completion_sampling(request, prompt_len=len(ids), vocab_size=self.tok.vocab_size,
                                     context_length=None)
            max_new = 16 if sp.max_new_tokens is None else sp.max_new_tokens
        except APIError as e:
            return _api_error(e)
        except ValueError as e:
            return _error(400, str(e))
        return await self._serve_openai(req, body, ids, max_new, chat=False, n=sp.n)

    async def chat(self, req: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(req)
            request = parse_model(ChatCompletionRequest, body)  # the engine's body checks: its errors
            self._check_model(request.model)
            ids = chat_prompt_ids(self.tok, request)
            sp = chat_sampling(request, prompt_len=len(ids), vocab_size=self.tok.vocab_size, context_length=None)
            max_new = 128 if sp.max_new_tokens is None else sp.max_new_tokens
        except APIError as e:
            return _api_error(e)
        except ValueError as e:
            return _error(400, str(e))
        return await self._serve_openai(req, body, ids, max_new, chat=True, n=sp.n)

    async def generate(self, req: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(req)
            if body.get("text") is not None and body.get("input_ids") is not None:  # the engine's answer too
                raise APIError("send exactly one of 'text' and 'input_ids'", 400, "text")
            if isinstance(body.get("text"), str):
                ids = self.tok.encode(body["text"])
            elif isinstance(body.get("input_ids"), list) and body["input_ids"] and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in body["input_ids"]):
                ids = check_input_ids(body["input_ids"], self.tok.vocab_size, "input_ids")
            else:
                raise ValueError("give text (a string) or input_ids (a non-empty list of ints)")
            sp = body.get("sampling_params") or {}
            if not isinstance(sp, dict):
                raise ValueError("sampling_params must be an object")
            checked = native_sampling(sp, prompt_len=len(ids), vocab_size=self.tok.vocab_size, context_length=None)
            max_new = 128 if checked.max_new_tokens is None else checked.max_new_tokens  # 0: SGLang allows it
        except APIError as e:
            return _api_error(e)
        except ValueError as e:
            return _error(400, str(e))
        n = checked.n
        events: asyncio.Queue = asyncio.Queue()  # (choice, new ids, new pieces, done) from every sequence
        try:
            eng = self._pick(req, body)
            reqs = [self._new_request(ids, max_new, eng, sample=i) for i in range(n)]
            for i, r in enumerate(reqs):  # as _serve_openai: the n samples share the prompt on one rank
                r.events = _Tagged(events, i)
                eng.submit(r)
        except RequestTooLong as e:  # the engine's code for a request longer than its room
            return _api_error(APIError(str(e), 400, None, "context_length_exceeded"))
        except ValueError as e:
            return _error(400, str(e))
        except SimEngineError as e:
            return _api_error(_unavailable(e))
        headers = {WORKER_HEADER: self.engine.name}

        def result(r: SimRequest, done: bool) -> dict:
            return {"text": "".join(r.output_pieces[:r.sent]), "output_ids": r.output_ids[:r.sent],
                    "meta_info": {"id": r.rid, "prompt_tokens": len(ids), "completion_tokens": r.sent,
                                  "cached_tokens": r.cached_tokens, "worker_id": self.engine.name,
                                  "finish_reason": {"type": "length", "length": r.sent} if done else None,
                                  "e2e_latency": time.monotonic() - r.arrival}}

        next_event = _event_reader(events, eng, reqs)

        # SGLang (TokenizerManager._handle_batch_request): n > 1 answers a list of n results, in
        # sample order; streamed, every event is one sample's result so far with its "index"
        if not body.get("stream"):
            left = n
            try:
                while left:
                    left -= (await next_event())[3]
            except SimEngineError as e:
                return _api_error(_unavailable(e))
            results = [result(r, True) for r in reqs]
            return web.json_response(results if n > 1 else results[0], headers=headers)
        resp = await self._start_sse(req, headers)
        try:
            left = n
            while left:
                i, _ids, _pieces, done = await next_event()
                payload = result(reqs[i], done)
                if n > 1:
                    payload["index"] = i
                await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                left -= done
            await resp.write(b"data: [DONE]\n\n")
        except SimEngineError as e:  # the engine's way: a last error event and no [DONE]
            await _write_error_event(resp, e)
        except ConnectionResetError:  # the client went away mid-stream: nothing more to send (no traceback)
            for r in reqs:
                eng.abort(r)
        except asyncio.CancelledError:
            for r in reqs:
                eng.abort(r)
            raise
        return resp

    async def _start_sse(self, req: web.Request, headers: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **headers})
        await resp.prepare(req)
        return resp

    async def _serve_openai(self, req: web.Request, body: dict, ids: list[int], max_new: int,
                            chat: bool, n: int = 1) -> web.StreamResponse:
        """Answer an OpenAI request with ``n`` choices (OpenAI's ``n``, checked by the engine's validation).

        As the engine does (``TokenizerManager.submit``), the ``n`` samples are ``n`` sequences
        of the same prompt on one rank: the scheduler prefills the prompt once (the others wait
        one step under the in-batch share rule, then find it cached and prefill one token each)
        and decodes the ``n`` together. Shapes as vLLM's: choices ``index`` 0..n-1; streaming chat
        sends each choice's ``role`` chunk first (n > 1); usage counts the prompt once,
        ``completion_tokens`` over every choice and ``cached_tokens`` of choice 0 (the engine's).
        """
        events: asyncio.Queue = asyncio.Queue()  # (choice, new ids, new pieces, done) from every sequence
        try:
            eng = self._pick(req, body)
            reqs = [self._new_request(ids, max_new, eng, sample=i) for i in range(n)]
            for i, r in enumerate(reqs):  # the same prompt each: the first refused means none was queued
                r.events = _Tagged(events, i)
                eng.submit(r)
        except RequestTooLong as e:  # the engine's code for a request longer than its room
            return _api_error(APIError(str(e), 400, None, "context_length_exceeded"))
        except ValueError as e:
            return _error(400, str(e))
        except SimEngineError as e:
            return _api_error(_unavailable(e))
        headers = {WORKER_HEADER: self.engine.name}
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + reqs[0].rid
        obj = "chat.completion" if chat else "text_completion"

        def usage() -> dict:
            out = sum(r.sent for r in reqs)
            return {"prompt_tokens": len(ids), "completion_tokens": out, "total_tokens": len(ids) + out,
                    "prompt_tokens_details": {"cached_tokens": reqs[0].cached_tokens}}

        next_event = _event_reader(events, eng, reqs)

        if not body.get("stream"):
            left = n
            try:
                while left:
                    left -= (await next_event())[3]
            except SimEngineError as e:
                return _api_error(_unavailable(e))
            choices = []
            for i, r in enumerate(reqs):
                text = "".join(r.output_pieces[:r.sent])
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "finish_reason": "length"} if chat else
                               {"index": i, "text": text, "logprobs": None, "finish_reason": "length"})
            return web.json_response({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                      "choices": choices, "usage": usage(), "worker_id": self.engine.name},
                                     headers=headers)
        stream_options = body.get("stream_options") or {}
        include_usage = bool(stream_options.get("include_usage"))
        # vLLM's continuous_usage_stats (with include_usage): every chunk carries the usage so far
        continuous = include_usage and bool(stream_options.get("continuous_usage_stats"))
        resp = await self._start_sse(req, headers)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(choices: list, **extra: Any) -> None:
            if continuous and choices:
                extra["usage"] = usage()
            data = {"id": rid, "object": chunk_obj, "created": created, "model": self.model_name,
                    "choices": choices, **extra}
            await resp.write(b"data: " + json.dumps(data).encode() + b"\n\n")

        try:
            first, left = True, n
            while left:
                i, _ids, pieces, done = await next_event()
                text = "".join(pieces)
                if chat:
                    if first and n > 1:  # vLLM: every choice's role first, once the prefill is done
                        for j in range(n):
                            await send([{"index": j, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}])
                    delta = {"role": "assistant", "content": text} if first and n == 1 else {"content": text}
                    await send([{"index": i, "delta": delta, "finish_reason": "length" if done else None}])
                else:
                    await send([{"index": i, "text": text, "logprobs": None,
                                 "finish_reason": "length" if done else None}])
                first = False
                left -= done
            if include_usage:
                await send([], usage=usage(), worker_id=self.engine.name)
            await resp.write(b"data: [DONE]\n\n")
        except SimEngineError as e:  # the engine's way: a last error event and no [DONE]
            await _write_error_event(resp, e)
        except ConnectionResetError:  # the client went away mid-stream: nothing more to send (no traceback)
            for r in reqs:
                eng.abort(r)
        except asyncio.CancelledError:
            for r in reqs:
                eng.abort(r)
            raise
        return resp


async def _write_error_event(resp: web.StreamResponse, e: SimEngineError) -> None:
    """End a stream cut short by a failed engine as the engine does: ``{"error": ...}`` (503's body), no ``[DONE]``."""
    await resp.write(b"data: " + json.dumps(_unavailable(e).to_dict()).encode() + b"\n\n")


def _event_reader(events: asyncio.Queue, eng, reqs: list):
    """``await next_event()`` for one HTTP request's samples: the next tagged event from ``events``;
    if the client goes away (the task is cancelled) every sample in ``reqs`` is aborted first.
    Raises :class:`SimEngineError` for a sample the failed engine ended (``SimRequest.error``)."""
    async def next_event() -> tuple:
        try:
            event = await events.get()
        except asyncio.CancelledError:
            for r in reqs:
                eng.abort(r)
            raise
        failed = reqs[event[0]].error
        if failed is not None:
            raise SimEngineError(f"the simulated engine stopped while generating this request: {failed}")
        return event
    return next_event


class _Tagged:
    """A sequence's ``events`` sink that puts ``(choice, *event)`` into a queue shared by the ``n``
    sequences of one request (the sim engine only calls ``put_nowait``)."""

    def __init__(self, queue: asyncio.Queue, choice: int):
        self.queue, self.choice = queue, choice

    def put_nowait(self, event: tuple) -> None:
        self.queue.put_nowait((self.choice, *event))


def _access_logger(enabled: bool):
    """aiohttp's ``aiohttp.access`` logger writing to stderr at INFO, or None (no access log)."""
    if not enabled:
        return None
    import logging

    log = logging.getLogger("aiohttp.access")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    return log


async def serve(args: argparse.Namespace, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run ``args.num_workers`` workers until ``stop`` is set (or forever)."""
    model = timing_model.from_args(args)
    tok = make_tokenizer(args.tokenizer)
    kv_events = parse_kv_events_config(getattr(args, "kv_events_config", None))
    runners: list[web.AppRunner] = []
    engines: list[SimEngine] = []
    for i in range(args.num_workers):
        port = args.port + i
        url = f"http://{args.host}:{port}"
        dp = getattr(args, "dp_size", 1)
        ranks = [SimEngine(model, name=f"{args.host}:{port}",
                           event_sink=make_publisher(kv_events, r, port_offset=i * dp + r)) for r in range(dp)]
        for eng in ranks:
            eng.start()
        worker = SimWorker(ranks, tok, args.model_name, args.stream_interval, url,
                           getattr(args, "kv_events_config", None) if kv_events else None,
                           loads_api=getattr(args, "loads_api", "sglang"))
        # handler_cancellation: a client that goes away cancels its handler, so a non-streamed request is
        # aborted in the engine too (as a stream already was), not decoded to the end for nobody
        runner = web.AppRunner(worker.app, access_log=_access_logger(getattr(args, "access_log", False)),
                               shutdown_timeout=2.0, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, args.host, port, backlog=4096)
        await site.start()
        runners.append(runner)
        engines.extend(ranks)
        if port == 0:  # the port the OS picked, so the line below names where it really listens
            args.port = port = runner.addresses[0][1]
            for eng in ranks:
                eng.name = f"{args.host}:{port}"
            worker.url = f"http://{args.host}:{port}"
    print(f"sim-worker: {args.num_workers} worker(s) on http://{args.host}:{args.port}"
          f"..{args.port + args.num_workers - 1} ({args.profile}, time_scale={model.time_scale})", flush=True)
    if ready is not None:
        ready.set()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass
    try:
        await stop.wait()
    finally:
        await asyncio.gather(*(r.cleanup() for r in runners))
        for e in engines:
            await e.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bad = check_args(args)
    if bad:
        print(f"sim-worker: {bad}", file=sys.stderr)
        return 2
    bad = port_range_error("--port", args.port, args.num_workers, allow_zero=True)
    if bad:
        print(f"sim-worker: {bad}" + (f" (--num-workers {args.num_workers})" if args.num_workers > 1 else ""),
              file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    try:
        asyncio.run(serve(args))
    except ValueError as e:
        print(f"sim-worker: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a port already in use
        ports = f"{args.port}" if args.num_workers == 1 else f"{args.port}..{args.port + args.num_workers - 1}"
        print(f"sim-worker: --port {args.port}: cannot listen on {args.host}:{ports}: "
              f"{os.strerror(e.errno) if e.errno else e}"
              + (f" (--num-workers {args.num_workers})" if args.num_workers > 1 else ""), file=sys.stderr)
        return 2  # a start-up error, as a bad flag (and as serve / the router / launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
