"""``POST /v1/chat/completions``: the model's chat template over text messages; logprobs; SSE;
tools: calls parsed from the output in the --tool-call-parser format, streamed as argument
deltas (:mod:`fleetserve.entrypoints.tool_parser`, :mod:`fleetserve.entrypoints.tool_parsers`)."""

from __future__ import annotations

import dataclasses
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
from fleetserve.engine.grammar.spec import GrammarError, check_grammar
from fleetserve.entrypoints.errors import APIError
from fleetserve.entrypoints.tokenizer_manager import TokenizerManager, TokenOutput
from fleetserve.entrypoints.tool_messages import template_messages
from fleetserve.entrypoints.tool_parser import ToolPlan, parse_tool_calls, plan_tools
from fleetserve.entrypoints.tool_parsers import ToolCallStream
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
    messages, tools = template_messages(chat_messages(req), req.tools, getattr(tm.tokenizer, "chat_template", None))
    ids = tm.apply_chat_template(messages, tools, req.add_generation_prompt,
                                 req.continue_final_message, req.chat_template_kwargs)
    sp = chat_sampling(req, prompt_len=len(ids), vocab_size=info.vocab_size, context_length=info.context_length)
    plan = plan_tools(req.tools, req.tool_choice, state.server_args.get("tool_call_parser"), req.parallel_tool_calls)
    if plan.grammar is not None:
        sp = forced_sampling(sp, plan.grammar)
    streams = submit_all(state, [ids], [sp], return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0,
                         routed_dp_rank=routed)
    answer = ChatAnswer(tm, state.model_name, req, random_id("chatcmpl"), plan, prompt_len=len(ids))
    return await respond(request, streams, stream=bool(req.stream), build=answer.build, chunks=answer.chunks)


def forced_sampling(sp, grammar: str):
    """``sp`` constrained to the tool-call ``grammar`` (``tool_choice`` required or named).

    Raises:
        APIError(400, ``tool_choice``): the request also has its own constraint
            (``response_format`` json, ``json_schema``, ``regex``, ``ebnf``);
            (400, ``tools``): a tool's ``parameters`` schema is refused by the grammar library.
    """
    if sp.has_grammar:
        raise APIError("tool_choice 'required' or a named function cannot be combined with response_format "
                       "json_object / json_schema, json_schema, regex or ebnf", 400, "tool_choice")
    sp = dataclasses.replace(sp, ebnf=grammar)
    try:
        check_grammar(sp)
    except GrammarError as e:
        raise APIError(f"a tool's parameters are not a usable JSON schema: {e}", 400, "tools") from e
    return sp


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
    plan: ToolPlan = field(default_factory=ToolPlan)  # plan.fmt None: plain text
    prompt_len: int = 0  # prompt tokens, for continuous usage stats
    streams: dict[int, ToolCallStream] = field(default_factory=dict)
    done_tokens: dict[int, int] = field(default_factory=dict)  # choice -> completion tokens so far

    def reader(self, i: int) -> ToolCallStream | None:
        """Choice ``i``'s streaming tool-call reader (None: plain text)."""
        if self.plan.fmt is None:
            return None
        if i not in self.streams:
            self.streams[i] = ToolCallStream(self.plan.fmt, self.plan.max_calls)
        return self.streams[i]

    def logprobs(self, outs: list[TokenOutput]) -> ChatLogprobs | None:
        return chat_logprobs(self.tm, outs, self.req.top_logprobs or 0) if self.req.logprobs else None

    def build(self, per: Collected) -> ChatCompletionResponse:
        choices, completion = [], 0
        for i, outs in enumerate(per):
            last = outs[-1] if outs else None
            text = "".join(o.text for o in outs)
            reason = last.finish_reason if last else "abort"
            message = ChatMessageOut(content=text)
            if self.plan.fmt is not None:
                content, calls = parse_tool_calls(self.plan.fmt, text, self.plan.max_calls)
                if calls:
                    message = ChatMessageOut(content=content, tool_calls=calls)
                    reason = "tool_calls" if reason == "stop" else reason
            choices.append(ChatChoice(
                index=i, message=message, logprobs=self.logprobs(outs), finish_reason=reason,
                matched_stop=last.matched_stop if last else None))
            completion += last.completion_tokens if last else 0
        first_last = per[0][-1] if per and per[0] else None
        prompt = first_last.prompt_tokens if first_last else 0
        cached = first_last.cached_tokens if first_last else 0
        return ChatCompletionResponse(id=self.rid, model=self.model_name, choices=choices,
                                      usage=usage_of([prompt], [cached], completion))

    def chunk(self, created: int, choices: list[ChatChunkChoice], **extra) -> ChatCompletionChunk:
        if choices and "usage" not in extra and continuous_usage(self.req.stream_options):
            extra["usage"] = usage_so_far(self.prompt_len, self.done_tokens.get(choices[0].index, 0))
        return ChatCompletionChunk(id=self.rid, created=created, model=self.model_name, choices=choices, **extra)

    async def chunks(self, merged: Merged) -> AsyncIterator[ChatCompletionChunk]:
        created = int(time.time())
        last: dict[int, TokenOutput] = {}
        roles_sent = False
        async for i, out in merged:
            if not roles_sent:  # with the first token, as vLLM and SGLang: a first chunk means the prefill is done
                roles_sent = True
                for j in range(self.req.n):
                    yield self.chunk(created, [ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant",
                                                                                            content=""))])
            last[i] = out
            self.done_tokens[i] = out.completion_tokens
            lp = self.logprobs([out])
            reader = self.reader(i)
            text, calls = reader.feed(out.text) if reader is not None else (out.text, [])
            if text or (lp and lp.content):
                yield self.chunk(created, [ChatChunkChoice(index=i, delta=DeltaMessage(content=text),
                                                           logprobs=lp)])
            for call in calls:
                yield self.chunk(created, [ChatChunkChoice(index=i, delta=DeltaMessage(tool_calls=[call]))])
            if out.finished:
                reason = out.finish_reason
                if reader is not None:
                    rest, calls = reader.finish()
                    if rest:
                        yield self.chunk(created, [ChatChunkChoice(index=i, delta=DeltaMessage(content=rest))])
                    for call in calls:
                        yield self.chunk(created, [ChatChunkChoice(index=i, delta=DeltaMessage(tool_calls=[call]))])
                    if reader.calls_sent and reason == "stop":
                        reason = "tool_calls"
                yield self.chunk(created, [ChatChunkChoice(index=i, delta=DeltaMessage(), finish_reason=reason)])
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield self.chunk(created, [], usage=stream_usage(last, self.req.n))
