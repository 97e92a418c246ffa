"""``POST /v1/completions``: OpenAI's legacy completions (text, texts, token ids; echo; logprobs; SSE)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from fleetserve.entrypoints.http.body import read_request
from fleetserve.entrypoints.http.state import server_state
from fleetserve.entrypoints.http.streaming import Collected, Merged, respond, submit_all
from fleetserve.entrypoints.http.usage import continuous_usage, stream_usage, usage_of, usage_so_far
from fleetserve.entrypoints.openai_protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from fleetserve.entrypoints.tokenizer_manager import TokenizerManager, TokenOutput
from fleetserve.entrypoints.validation import check_completion_request, completion_prompts, completion_sampling

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state = server_state(request)
    tm, info = state.tm, state.info
    req = await read_request(request, CompletionRequest, state.max_request_bytes)
    state.check_model(req.model)
    routed = state.routed_dp_rank(request, req.routed_dp_rank)
    check_completion_request(req)
    prompts = completion_prompts(req.prompt, tm.encode, info.vocab_size)
    sampling = [completion_sampling(req, prompt_len=len(p), vocab_size=info.vocab_size,
                                    context_length=info.context_length) for p in prompts]
    want_lp = req.logprobs is not None
    streams = submit_all(state, prompts, sampling, return_logprob=want_lp, top_logprobs_num=req.logprobs or 0,
                         logprob_start_len=0 if (want_lp and req.echo) else -1, routed_dp_rank=routed)
    answer = CompletionAnswer(tm, state.model_name, req, random_id("cmpl"), prompts)
    return await respond(request, streams, stream=bool(req.stream), build=answer.build, chunks=answer.chunks)


def completion_logprobs(tm: TokenizerManager, outs: list[TokenOutput], prompt: list[int] | None,
                        echo_text_len: int, top_n: int) -> CompletionLogprobs:
    """Legacy logprobs of ``outs`` (one choice), preceded by the prompt's when ``prompt`` is given (echo).

    ``echo_text_len`` (characters of the echoed prompt) shifts the output tokens'
    ``text_offset``; ``top_n`` alternatives per position.
    """
    lp = CompletionLogprobs()
    offset_base = 0
    if prompt is not None and outs and outs[0].input_logprobs is not None:
        pos = 0
        tops = outs[0].input_top_logprobs or []
        for j, (val, tid) in enumerate(outs[0].input_logprobs):
            t = tm.token_text(tid)
            lp.tokens.append(t)
            lp.token_logprobs.append(val)
            top = tops[j] if j < len(tops) else None
            lp.top_logprobs.append({tm.token_text(i): v for v, i in top[:top_n]} if (top and top_n) else None)
            lp.text_offset.append(pos)
            pos += len(t)
        offset_base = echo_text_len
    for o in outs:
        for j, (val, tid) in enumerate(o.output_logprobs or []):
            lp.tokens.append(tm.token_text(tid))
            lp.token_logprobs.append(val)
            tops = o.output_top_logprobs[j] if o.output_top_logprobs and j < len(o.output_top_logprobs) else None
            lp.top_logprobs.append({tm.token_text(i): v for v, i in tops[:top_n]} if (tops and top_n) else
                                   ({} if top_n else None))
            off = o.token_offsets[j] if j < len(o.token_offsets) else 0
            lp.text_offset.append(offset_base + off)
    return lp


@dataclass
class CompletionAnswer:
    """Turns one completions request's outputs into its response or its chunks.

    Choice ``i`` is sample ``i % n`` of prompt ``i // n``.
    """

    tm: TokenizerManager
    model_name: str
    req: CompletionRequest
    rid: str
    prompts: list[list[int]]
    prompt_texts: list[str] = field(init=False)  # what echo puts before each prompt's choices

    def __post_init__(self) -> None:
        decode = self.tm.tokenizer.decode
        self.prompt_texts = [decode(p, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                             if self.req.echo else "" for p in self.prompts]

    def logprobs(self, outs: list[TokenOutput], prompt_index: int, with_prompt: bool) -> CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        prompt = self.prompts[prompt_index] if with_prompt else None
        return completion_logprobs(self.tm, outs, prompt, len(self.prompt_texts[prompt_index]), self.req.logprobs)

    def build(self, per: Collected) -> CompletionResponse:
        n, echo = self.req.n, self.req.echo
        choices = []
        completion = 0
        prompt_counts, cached_counts = [], []
        for i, outs in enumerate(per):
            last = outs[-1] if outs else None
            pidx = i // n
            text = "".join(o.text for o in outs)
            if echo:
                text = self.prompt_texts[pidx] + text
            choices.append(CompletionChoice(index=i, text=text, logprobs=self.logprobs(outs, pidx, echo),
                                            finish_reason=last.finish_reason if last else "abort",
                                            matched_stop=last.matched_stop if last else None))
            completion += last.completion_tokens if last else 0
            if i % n == 0:
                prompt_counts.append(last.prompt_tokens if last else len(self.prompts[pidx]))
                cached_counts.append(last.cached_tokens if last else 0)
        return CompletionResponse(id=self.rid, model=self.model_name, choices=choices,
                                  usage=usage_of(prompt_counts, cached_counts, completion))

    async def chunks(self, merged: Merged) -> AsyncIterator[CompletionChunk]:
        created = int(time.time())
        last: dict[int, TokenOutput] = {}
        sent_echo: set[int] = set()
        echo = self.req.echo
        async for i, out in merged:
            pidx = i // self.req.n
            first_with_echo = echo and i not in sent_echo
            lp = self.logprobs([out], pidx, first_with_echo)
            text = out.text
            if first_with_echo:
                text = self.prompt_texts[pidx] + text
                sent_echo.add(i)
            last[i] = out
            if not text and not out.finished and not (lp and lp.tokens):
                continue
            usage = (usage_so_far(len(self.prompts[pidx]), out.completion_tokens)
                     if continuous_usage(self.req.stream_options) else None)
            yield CompletionChunk(id=self.rid, created=created, model=self.model_name, usage=usage, choices=[
                CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=out.finish_reason,
                                 matched_stop=out.matched_stop if out.finished else None)])
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield CompletionChunk(id=self.rid, created=created, model=self.model_name, choices=[],
                                  usage=stream_usage(last, self.req.n))
