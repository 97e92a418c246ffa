"""SGLang-native ``POST /generate``: ``text`` or ``input_ids``, single or batch, SGLang's ``sampling_params``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from fleetserve.entrypoints.http.body import read_request
from fleetserve.entrypoints.http.state import server_state
from fleetserve.entrypoints.http.streaming import Collected, Merged, respond, submit_all
from fleetserve.entrypoints.openai_protocol import GenerateRequest
from fleetserve.entrypoints.tokenizer_manager import GenerationStream, TokenOutput
from fleetserve.entrypoints.validation import (
    generate_is_batch,
    generate_prompts,
    generate_rids,
    generate_sampling_dicts,
    native_sampling,
)

router = APIRouter()


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = server_state(request)
    tm, info = state.tm, state.info
    req = await read_request(request, GenerateRequest, state.max_request_bytes)
    if req.routed_dp_rank is None and req.data_parallel_rank is not None:  # SGLang's older name
        routed = state.routed_dp_rank(request, req.data_parallel_rank, "data_parallel_rank")
    else:
        routed = state.routed_dp_rank(request, req.routed_dp_rank)
    prompts = generate_prompts(req, tm.encode, info.vocab_size)
    raw_sampling = generate_sampling_dicts(req.sampling_params, len(prompts))
    rids = generate_rids(req.rid, len(prompts))
    sampling = [native_sampling(d, prompt_len=len(p), vocab_size=info.vocab_size, context_length=info.context_length)
                for p, d in zip(prompts, raw_sampling)]
    streams = submit_all(state, prompts, sampling, rids, return_logprob=req.return_logprob,
                         top_logprobs_num=req.top_logprobs_num, logprob_start_len=req.logprob_start_len,
                         routed_dp_rank=routed)
    answer = GenerateAnswer(req, streams, batch=generate_is_batch(req), t0=time.perf_counter())
    return await respond(request, streams, stream=req.stream, build=answer.build, chunks=answer.chunks)


def sglang_finish_reason(out: TokenOutput) -> dict[str, Any] | None:
    """SGLang's finish reason: ``{"type": "length", "length": n}``, ``{"type": "abort", "message": ...}``
    or ``{"type": "stop", "matched": token id or string}``; None while unfinished."""
    if not out.finished:
        return None
    if out.finish_reason == "length":
        return {"type": "length", "length": out.completion_tokens}
    if out.finish_reason == "abort":
        return {"type": "abort", "message": out.abort_message}
    return {"type": "stop", "matched": out.matched_stop}


@dataclass
class GenerateAnswer:
    """Turns one ``/generate`` request's outputs into SGLang's result dicts.

    A single prompt with ``n == 1`` is answered with one dict; otherwise a list (and,
    streaming, each event carries its ``index``).
    """

    req: GenerateRequest
    streams: list[GenerationStream]
    batch: bool
    t0: float  # when the request was submitted (perf_counter seconds), for e2e_latency

    @property
    def many(self) -> bool:
        return self.batch or len(self.streams) > 1

    def result(self, s: GenerationStream, outs: list[TokenOutput]) -> dict[str, Any]:
        """``{"text", "output_ids", "meta_info"}`` of stream ``s`` from its outputs so far."""
        req = self.req
        last = outs[-1] if outs else None
        meta: dict[str, Any] = {
            "id": s.rid,
            "prompt_tokens": last.prompt_tokens if last else len(s.req.input_ids),
            "completion_tokens": last.completion_tokens if last else 0,
            "cached_tokens": last.cached_tokens if last else 0,
            "finish_reason": sglang_finish_reason(last) if last else None,
            "e2e_latency": time.perf_counter() - self.t0,
        }
        if req.return_logprob:
            first = outs[0] if outs else None
            meta["input_token_logprobs"] = [list(x) for x in (first.input_logprobs or [])] if first else []
            meta["output_token_logprobs"] = [list(x) for o in outs for x in (o.output_logprobs or [])]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = [[list(y) for y in x]
                                               for o in outs for x in (o.output_top_logprobs or [])]
        text = "".join(o.text for o in outs)
        return {"text": text, "output_ids": [t for o in outs for t in o.token_ids], "meta_info": meta}

    def build(self, per: Collected) -> list[dict[str, Any]] | dict[str, Any]:
        results = [self.result(s, outs) for s, outs in zip(self.streams, per)]
        return results if self.many else results[0]

    async def chunks(self, merged: Merged) -> AsyncIterator[dict[str, Any]]:
        per: list[list[TokenOutput]] = [[] for _ in self.streams]
        async for i, out in merged:
            per[i].append(out)
            res = self.result(self.streams[i], per[i])
            if self.many:
                res["index"] = i
            yield res
