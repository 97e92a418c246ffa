"""Tool calls from JSON-in-tags text (Qwen 2.5 / Hermes format), whole and streamed, and the forcing grammar."""

import json

import pytest

from fleetserve.engine.grammar.spec import GrammarKey, to_library_grammar
from fleetserve.entrypoints.errors import APIError
from fleetserve.entrypoints.tool_checks import check_tools
from fleetserve.entrypoints.tool_parser import ToolPlan, forced_call_grammar, plan_tools
from fleetserve.entrypoints.tool_parsers import ToolCallStream, get_format, parse_tool_calls
from helpers.tool_streams import accumulate, stream

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}

TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def fn(calls):
    return [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


QWEN = get_format("qwen25")


def test_parse_two_calls_and_content():
    content, calls = parse_tool_calls(QWEN, TEXT)
    assert content == "Let me check."
    assert fn(calls) == [("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
    assert calls[0]["function"]["arguments"] == '{"city": "Paris"}'  # the text the model wrote
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert fn(parse_tool_calls(QWEN, TEXT, max_calls=1)[1]) == [("function", "get_weather", {"city": "Paris"})]


def test_plain_text_and_broken_json_stay_text():
    assert parse_tool_calls(QWEN, "no calls here") == ("no calls here", [])
    broken = "<tool_call>\n{\"name\": \"get_weather\", \"argu\n</tool_call>"
    assert parse_tool_calls(QWEN, broken) == (broken, [])
    only = parse_tool_calls(QWEN, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert only[0] is None and fn(only[1]) == [("function", "get_time", {})]
    # keys in another order: read whole
    other = parse_tool_calls(QWEN, '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>')
    assert fn(other[1]) == [("function", "f", {"a": 1})]


@pytest.mark.parametrize("step", [1, 2, 5, 11, 1000])
def test_stream_gives_the_same_content_and_calls(step):
    content, deltas = stream(QWEN, TEXT, step)
    assert content.strip() == "Let me check."
    assert "<" not in content
    whole = parse_tool_calls(QWEN, TEXT)[1]
    got = accumulate(deltas)
    assert [(n, a) for _, n, a in got] == [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    if step == 1:  # arguments come in pieces as written, after a first delta with the name and ""
        assert sum(1 for d in deltas if d["index"] == 0) == 1 + len('{"city": "Paris"}')


def test_stream_holds_back_only_a_possible_tag_start():
    s = ToolCallStream(QWEN)
    assert s.feed("a <tool") == ("a ", [])
    assert s.feed("kit") == ("<toolkit", [])
    assert s.finish() == ("", [])
    assert not s.calls_sent


def test_stream_parallel_false_keeps_the_first_call():
    content, deltas = stream(QWEN, TEXT, 4, max_calls=1)
    assert [n for _, n, _ in accumulate(deltas)] == ["get_weather"]


def test_forced_grammar_compiles_and_plan():
    g = forced_call_grammar([WEATHER, TIME], None)
    assert isinstance(to_library_grammar(GrammarKey("ebnf", g)), str)
    assert "get_time" not in forced_call_grammar([WEATHER, TIME], "get_weather")
    assert plan_tools(None, "auto", "qwen25") == ToolPlan()
    assert plan_tools([WEATHER], "none", "qwen25") == ToolPlan()
    assert plan_tools([WEATHER], "auto", None) == ToolPlan()
    auto = plan_tools([WEATHER], None, "hermes", parallel=False)
    assert auto.fmt.name == "qwen25" and auto.grammar is None and auto.max_calls == 1
    forced = plan_tools([WEATHER], "required", None)
    assert forced.fmt.name == "qwen25" and forced.grammar is not None and forced.max_calls is None
    assert plan_tools([WEATHER], "required", "llama3").fmt.name == "llama3"


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
