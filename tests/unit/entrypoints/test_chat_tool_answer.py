"""The chat answer with tool-call parsing on (``--tool-call-parser`` with ``tool_choice`` auto):
scripted outputs in, the OpenAI response and chunks out, checked through the ``openai`` SDK's types."""

import asyncio
import json

import pytest

from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from fleetserve.entrypoints.http.chat import ChatAnswer
from fleetserve.entrypoints.openai_protocol import ChatCompletionRequest
from fleetserve.entrypoints.tokenizer_manager import TokenOutput
from fleetserve.entrypoints.tool_parser import plan_tools

TEXT = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def outputs(text, step, reason="stop"):
    parts = [text[i:i + step] for i in range(0, len(text), step)]
    return [TokenOutput(index=0, text=p, token_ids=[1], token_offsets=[0], finished=k == len(parts) - 1,
                        finish_reason=reason if k == len(parts) - 1 else None, matched_stop=None, prompt_tokens=5,
                        completion_tokens=k + 1, cached_tokens=0) for k, p in enumerate(parts)]


TOOLS = [{"type": "function", "function": {"name": "get_weather"}},
         {"type": "function", "function": {"name": "get_time"}}]
TWO = TEXT + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'


def answer(parse=True, parallel=True):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                                parallel_tool_calls=parallel)
    return ChatAnswer(None, "m", req, "chatcmpl-x", plan_tools(TOOLS, "auto", "qwen25" if parse else None, parallel))


def stream_chunks(ans, text, step):
    async def collect():
        async def merged():
            for o in outputs(text, step):
                yield 0, o
        return [ChatCompletionChunk.model_validate(c.model_dump()) async for c in ans.chunks(merged())]
    return asyncio.run(collect())


def test_build_parses_calls_and_sdk_reads_them():
    body = answer().build([outputs(TEXT, 7)]).model_dump()
    r = ChatCompletion.model_validate(body)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure."
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    off = answer(parse=False).build([outputs(TEXT, 7)]).model_dump()
    assert off["choices"][0]["message"]["content"] == TEXT and off["choices"][0]["finish_reason"] == "stop"


def test_length_keeps_its_reason_and_stream_carries_the_call():
    assert answer().build([outputs(TEXT, 7, "length")]).model_dump()["choices"][0]["finish_reason"] == "length"

    chunks = stream_chunks(answer(), TEXT, 3)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert content.strip() == "Sure." and "<tool_call>" not in content
    assert [(t.index, t.function.name) for t in calls if t.id] == [(0, "get_weather")]
    assert json.loads("".join(t.function.arguments for t in calls)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def sdk_final(chunks):
    """The SDK's own accumulation of a chat stream (what ``client.chat.completions.stream`` builds)."""
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for c in chunks:
        state.handle_chunk(c)
    return state.get_final_completion().choices[0]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_streamed_argument_deltas_accumulate_in_the_sdk(step):
    chunks = stream_chunks(answer(), TWO, step)
    deltas = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    firsts = [t for t in deltas if t.id is not None]
    assert [(t.index, t.type, t.function.name, t.function.arguments) for t in firsts] == \
        [(0, "function", "get_weather", ""), (1, "function", "get_time", "")]
    if step == 1:  # then the arguments, piece by piece as the model wrote them
        assert len(deltas) == 2 + len('{"city": "Paris"}') + len('{"tz": "CET"}')
    final = sdk_final(chunks)
    assert final.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == \
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]
    body = answer().build([outputs(TWO, 7)]).model_dump()
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in body["choices"][0]["message"]["tool_calls"]] \
        == [(t.function.name, t.function.arguments) for t in final.message.tool_calls]


def test_parallel_tool_calls_false_keeps_one_call():
    body = answer(parallel=False).build([outputs(TWO, 7)]).model_dump()
    assert [t["function"]["name"] for t in body["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    final = sdk_final(stream_chunks(answer(parallel=False), TWO, 3))
    assert [t.function.name for t in final.message.tool_calls] == ["get_weather"]
    assert final.finish_reason == "tool_calls"
