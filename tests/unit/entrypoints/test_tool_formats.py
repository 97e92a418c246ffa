"""DeepSeek-V3 and Llama 3 tool-call formats (``--tool-call-parser deepseekv3`` / ``llama3``), whole and
streamed, on model outputs laid out as SGLang's ``deepseekv3`` / ``llama3`` detectors and vLLM's
``deepseek_v3`` / ``llama3_json`` parsers document them; their forcing grammars compile."""

import json

import pytest

from fleetserve.engine.args import TOOL_CALL_PARSER_NAMES
from fleetserve.engine.grammar.spec import GrammarKey, to_library_grammar
from fleetserve.entrypoints.tool_parser import forced_call_grammar
from fleetserve.entrypoints.tool_parsers import TOOL_CALL_PARSERS, get_format, parse_tool_calls

from helpers.tool_streams import accumulate, stream

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# SGLang's DeepSeekV3Detector docstring example: two calls, a newline between them
DEEPSEEK_TWO = (f'{B}{CB}function{SEP}get_current_weather\n```json\n{{"location": "Tokyo"}}\n```{CE}\n'
                f'{CB}function{SEP}get_current_weather\n```json\n{{"location": "Paris"}}\n```{CE}{E}')
DEEPSEEK_TEXT = "I will look it up." + DEEPSEEK_TWO
LLAMA_TAG = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
LLAMA_TWO = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "arguments": {}}'


def whole(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_parser_names_match_the_flag():
    assert set(TOOL_CALL_PARSERS) == set(TOOL_CALL_PARSER_NAMES)
    assert get_format("deepseek_v3").name == "deepseekv3" and get_format("llama3_json").name == "llama3"


@pytest.mark.parametrize("text, content, calls", [
    (DEEPSEEK_TEXT, "I will look it up.", [("get_current_weather", '{"location": "Tokyo"}'),
                                          ("get_current_weather", '{"location": "Paris"}')]),
    (f'{B}{CB}function{SEP}get_time\n```json\n{{}}\n```{CE}{E}', None, [("get_time", "{}")]),
    # nested arguments with braces inside strings
    (f'{B}{CB}function{SEP}f\n```json\n{{"q": "a {{b}}", "n": {{"x": [1, 2]}}}}\n```{CE}{E} done',
     "done", [("f", '{"q": "a {b}", "n": {"x": [1, 2]}}')]),
    ("no calls at all", "no calls at all", []),
    # malformed JSON stays text
    (f'{B}{CB}function{SEP}f\n```json\n{{"q": oops}}\n```{CE}{E}',
     f'{B}{CB}function{SEP}f\n```json\n{{"q": oops}}\n```{CE}{E}', []),
])
def test_deepseekv3_whole(text, content, calls):
    got_content, got = parse_tool_calls(get_format("deepseekv3"), text)
    assert got_content == content and whole(got) == calls
    for _, a in calls:
        json.loads(a)


@pytest.mark.parametrize("text, content, calls", [
    (LLAMA_TAG, None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("Checking. " + LLAMA_TAG, "Checking.", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (LLAMA_TWO, None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ("The weather is fine.", "The weather is fine.", []),
])
def test_llama3_whole(text, content, calls):
    got_content, got = parse_tool_calls(get_format("llama3"), text)
    assert got_content == content and whole(got) == calls


@pytest.mark.parametrize("name, text", [("deepseekv3", DEEPSEEK_TEXT), ("llama3", LLAMA_TAG),
                                        ("llama3", LLAMA_TWO), ("llama3", "Checking. " + LLAMA_TAG)])
@pytest.mark.parametrize("step", [1, 3, 7, 10_000])
def test_streamed_deltas_add_up_to_the_whole_answer(name, text, step):
    fmt = get_format(name)
    content, calls = parse_tool_calls(fmt, text)
    got_content, deltas = stream(fmt, text, step)
    assert (got_content.strip() or None) == content
    assert [(n, a) for _, n, a in accumulate(deltas)] == whole(calls)
    assert not any(m in got_content for m in ("｜", "<|python_tag|>", '"name"'))
    if step == 1:  # the arguments arrive piece by piece as written
        assert len(deltas) == sum(1 + len(c["function"]["arguments"]) for c in calls)


def test_deepseekv3_stream_sends_content_before_the_section_at_once():
    fmt = get_format("deepseekv3")
    from fleetserve.entrypoints.tool_parsers import ToolCallStream
    s = ToolCallStream(fmt)
    assert s.feed("Sure<｜tool") == ("Sure", [])  # the tail may begin the marker: held
    content, deltas = s.feed(f"▁calls▁begin｜>{CB}function{SEP}get_time\n```json\n{{")
    assert content == "" and deltas[0]["function"] == {"name": "get_time", "arguments": ""}
    assert deltas[1] == {"index": 0, "function": {"arguments": "{"}}


@pytest.mark.parametrize("parser", ["qwen25", "deepseekv3", "llama3"])
@pytest.mark.parametrize("parallel", [False, True])
def test_forcing_grammars_compile(parser, parallel):
    for name in (None, "get_weather"):
        g = forced_call_grammar([WEATHER, TIME], name, parser, parallel)
        assert isinstance(to_library_grammar(GrammarKey("ebnf", g)), str)
        assert ("get_time" in g) == (name is None)
