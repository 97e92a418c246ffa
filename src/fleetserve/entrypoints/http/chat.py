"""``POST /v1/chat/completions``: the model's chat template over text messages; logprobs; SSE."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from fleetserve.entrypoints.http.body import read_request
from fleetserve.entrypoints.http.state import server_state
from fleetserve.entrypoints.http.streaming import Collected, Merged, respond, submit_all
from fleetserve.entrypoints.http.usage import stream_usage, usage_of
from fleetserve.entrypoints.openai_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    random_id,
)
from fleetserve.entrypoints.tokenizer_manager import TokenizerManager, TokenOutput
from fleetserve.entrypoints.validation import chat_messages, chat_sampling, check_chat_request

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    tm, info = state.tm, state.info
    req = await read_request(request, ChatCompletionRequest, state.max_request_bytes)
    state.check_model(req.model)
    routed = state.routed_dp_rank(request, req.routed_dp_rank)
    check_chat_request(req)
    ids = tm.apply_chat_template(chat_messages(req), req.tools, req.add_generation_prompt,
                                 req.continue_final_message, req.chat_template_kwargs)
    sp = chat_sampling(req, prompt_len=len(ids), vocab_size=info.vocab_size, context_length=info.context_length)
    streams = submit_all(state, [ids], [sp], return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0,
                         routed_dp_rank=routed)
    answer = ChatAnswer(tm, state.model_name, req, random_id("chatcmpl"))
    return await respond(request, streams, stream=bool(req.stream), build=answer.build, chunks=answer.chunks)


def chat_logprobs(tm: TokenizerManager, outs: list[TokenOutput], top_n: int) -> ChatLogprobs:
    """Chat logprobs of the tokens in ``outs``, each with its ``top_n`` best alternatives and UTF-8 bytes."""
    content = []
    for o in outs:
        for j, (val, tid) in enumerate(o.output_logprobs or []):
            tops = o.output_top_logprobs[j] if o.output_top_logprobs and j < len(o.output_top_logprobs) else []
            content.append(ChatTokenLogprob(
                token=tm.token_text(tid), logprob=val, bytes=tm.token_bytes(tid),
                top_logprobs=[TopLogprob(token=tm.token_text(i), logprob=v, bytes=tm.token_bytes(i))
                              for v, i in (tops or [])[:top_n]]))
    return ChatLogprobs(content=content)


@dataclass
class ChatAnswer:
    """Turns one chat request's outputs (one stream per choice) into its response or its chunks."""

    tm: TokenizerManager
    model_name: str
    req: ChatCompletionRequest
    rid: str

    def logprobs(self, outs: list[TokenOutput]) -> ChatLogprobs | None:
        return chat_logprobs(self.tm, outs, self.req.top_logprobs or 0) if self.req.logprobs else None

    def build(self, per: Collected) -> ChatCompletionResponse:
        choices, completion = [], 0
        for i, outs in enumerate(per):
            last = outs[-1] if outs else None
            choices.append(ChatChoice(
                index=i, message=ChatMessageOut(content="".join(o.text for o in outs)),
                logprobs=self.logprobs(outs),
                finish_reason=last.finish_reason if last else "abort",
                matched_stop=last.matched_stop if last else None))
            completion += last.completion_tokens if last else 0
        first_last = per[0][-1] if per and per[0] else None
        prompt = first_last.prompt_tokens if first_last else 0
        cached = first_last.cached_tokens if first_last else 0
        return ChatCompletionResponse(id=self.rid, model=self.model_name, choices=choices,
                                      usage=usage_of([prompt], [cached], completion))

    def chunk(self, created: int, choices: list[ChatChunkChoice], **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.rid, created=created, model=self.model_name, choices=choices, **extra)

    async def chunks(self, merged: Merged) -> AsyncIterator[ChatCompletionChunk]:
        created = int(time.time())
        last: dict[int, TokenOutput] = {}
        for i in range(self.req.n):
            yield self.chunk(created, [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        async for i, out in merged:
            last[i] = out
            lp = self.logprobs([out])
            if out.text or (lp and lp.content):
                yield self.chunk(created, [ChatChunkChoice(index=i, delta=DeltaMessage(content=out.text),
                                                           logprobs=lp)])
            if out.finished:
                yield self.chunk(created, [ChatChunkChoice(index=i, delta=DeltaMessage(),
                                                           finish_reason=out.finish_reason)])
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield self.chunk(created, [], usage=stream_usage(last, self.req.n))
