"""The chat answer with tool-call parsing on (``--tool-call-parser`` with ``tool_choice`` auto):
scripted outputs in, the OpenAI response and chunks out, checked through the ``openai`` SDK's types."""

import asyncio
import json

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from fleetserve.entrypoints.http.chat import ChatAnswer
from fleetserve.entrypoints.openai_protocol import ChatCompletionRequest
from fleetserve.entrypoints.tokenizer_manager import TokenOutput

TEXT = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def outputs(text, step, reason="stop"):
    parts = [text[i:i + step] for i in range(0, len(text), step)]
    return [TokenOutput(index=0, text=p, token_ids=[1], token_offsets=[0], finished=k == len(parts) - 1,
                        finish_reason=reason if k == len(parts) - 1 else None, matched_stop=None, prompt_tokens=5,
                        completion_tokens=k + 1, cached_tokens=0) for k, p in enumerate(parts)]


def answer(parse=True):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "weather?"}],
                                tools=[{"type": "function", "function": {"name": "get_weather"}}])
    return ChatAnswer(None, "m", req, "chatcmpl-x", parse)


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

    async def collect():
        async def merged():
            for o in outputs(TEXT, 3):
                yield 0, o
        return [ChatCompletionChunk.model_validate(c.model_dump()) async for c in answer().chunks(merged())]

    chunks = asyncio.run(collect())
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert content.strip() == "Sure." and "<tool_call>" not in content
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
