"""Tool calls from JSON-in-tags text (Qwen 2.5 / Hermes format), whole and streamed, and the forcing grammar."""

import json

import pytest

from fleetserve.engine.grammar.spec import GrammarKey, to_library_grammar
from fleetserve.entrypoints.errors import APIError
from fleetserve.entrypoints.tool_checks import check_tools
from fleetserve.entrypoints.tool_parser import ToolCallStream, forced_call_grammar, parse_tool_calls, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}

TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def fn(calls):
    return [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_parse_two_calls_and_content():
    content, calls = parse_tool_calls(TEXT)
    assert content == "Let me check."
    assert fn(calls) == [("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


def test_plain_text_and_broken_json_stay_text():
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    broken = "<tool_call>\n{\"name\": \"get_weather\", \"argu\n</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])
    only = parse_tool_calls('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert only[0] is None and fn(only[1]) == [("function", "get_time", {})]


@pytest.mark.parametrize("step", [1, 2, 5, 11, 1000])
def test_stream_gives_the_same_content_and_calls(step):
    s = ToolCallStream()
    sent = "".join(s.feed(TEXT[i:i + step]) for i in range(0, len(TEXT), step))
    rest, calls = s.finish()
    assert (sent + rest).strip() == "Let me check."
    assert "<" not in sent
    assert fn(calls) == fn(parse_tool_calls(TEXT)[1])


def test_stream_holds_back_only_a_possible_tag_start():
    s = ToolCallStream()
    assert s.feed("a <tool") == "a "
    assert s.feed("kit") == "<toolkit"
    assert s.finish() == ("", [])


def test_forced_grammar_compiles_and_plan():
    g = forced_call_grammar([WEATHER, TIME], None)
    assert isinstance(to_library_grammar(GrammarKey("ebnf", g)), str)
    assert "get_time" not in forced_call_grammar([WEATHER, TIME], "get_weather")
    assert plan_tools(None, "auto", "qwen25") == (False, None)
    assert plan_tools([WEATHER], "none", "qwen25") == (False, None)
    assert plan_tools([WEATHER], "auto", None) == (False, None)
    assert plan_tools([WEATHER], None, "hermes") == (True, None)
    assert plan_tools([WEATHER], "required", None)[1] is not None


@pytest.mark.parametrize("tools,choice,param", [
    ([], "required", "tool_choice"),
    (None, "required", "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([{"type": "code"}], None, "tools.0.type"),
    ([{"type": "function"}], None, "tools.0.function"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools.0.function.parameters"),
])
def test_tool_checks(tools, choice, param):
    with pytest.raises(APIError) as e:
        check_tools(tools, choice)
    assert e.value.status == 400 and e.value.param == param


def test_good_tools_pass():
    check_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    check_tools([WEATHER], "required")
    check_tools(None, "none")
    check_tools(None, "auto")
