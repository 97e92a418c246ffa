"""Structured outputs through `fleetserve serve` on SmolLM2-135M, with the `openai` client.

The real server (HTTP process + scheduler process) is the entrypoint tests' shared
``smollm2_server`` (``conftest.py`` here). Outputs are checked
against their schema by hand (a small validator for the keywords used here: the
``jsonschema`` package is not a dependency), regex outputs with ``re.fullmatch``.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from helpers.smollm2_server import API_KEY

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def validate(value, schema, path="$"):
    """Assert ``value`` satisfies ``schema`` (type, properties, required, additionalProperties,
    enum, minimum, maximum, items, maxItems)."""
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    t = schema.get("type")
    if t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), (path, value)
    elif t == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (path, value)
    elif t is not None:
        assert isinstance(value, types[t]), (path, value)
    if "enum" in schema:
        assert value in schema["enum"], (path, value)
    if "minimum" in schema:
        assert value >= schema["minimum"], (path, value)
    if "maximum" in schema:
        assert value <= schema["maximum"], (path, value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            assert k in value, (path, k)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), (path, set(value) - set(props))
        for k, v in value.items():
            if k in props:
                validate(v, props[k], f"{path}.{k}")
    if isinstance(value, list):
        assert len(value) <= schema.get("maxItems", len(value)), (path, value)
        for i, v in enumerate(value):
            validate(v, schema.get("items", {}), f"{path}[{i}]")


@pytest.fixture(scope="module")
def server(smollm2_server):
    """The entrypoint tests' shared SmolLM2 server (``conftest.py`` here), ``--tool-call-parser qwen25``."""
    return smollm2_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


ASK = [{"role": "user", "content": "Describe a user of a web site as JSON."}]
RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_json_schema_chat_parses_validates_and_streams_the_same(client, model):
    whole = client.chat.completions.create(model=model, messages=ASK, max_tokens=120, temperature=0,
                                           response_format=RF)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop"
    validate(json.loads(choice.message.content), PERSON)
    chunks = list(client.chat.completions.create(model=model, messages=ASK, max_tokens=120, temperature=0,
                                                 response_format=RF, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_object_n2_sampled_and_free_text_unconstrained(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=150, temperature=0.8, seed=7, n=2,
                                       response_format={"type": "json_object"})
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "stop", c
        assert isinstance(json.loads(c.message.content), dict)
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=20, temperature=0,
                                           response_format={"type": "text"})
    assert plain.choices[0].message.content


def test_max_tokens_cuts_json_short_with_length(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=4, temperature=0, response_format=RF)
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


def test_regex_on_completions_and_generate_and_ebnf(client, http, model):
    r = client.completions.create(model=model, prompt="Call us at", max_tokens=30, temperature=0,
                                  extra_body={"regex": PHONE})
    assert re.fullmatch(PHONE, r.choices[0].text), r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    g = http.post("/generate", json={"text": "Is the sky blue? Answer:", "sampling_params": {
        "ebnf": 'root ::= " yes" | " no"', "temperature": 0, "max_new_tokens": 10}}).json()
    assert g["text"] in (" yes", " no"), g
    assert g["meta_info"]["finish_reason"]["type"] == "stop"
    s = http.post("/generate", json={"text": "Phone:", "sampling_params": {
        "regex": PHONE, "temperature": 1.0, "seed": 3, "max_new_tokens": 30}}).json()
    assert re.fullmatch(PHONE, s["text"]), s


def test_stop_string_inside_constrained_output(client, model):
    r = client.completions.create(model=model, prompt="Call us at", max_tokens=30, temperature=0,
                                  extra_body={"regex": PHONE}, stop=[") "])
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"\(\d{3}", r.choices[0].text), r.choices[0].text


def test_free_request_beside_constrained_ones_gets_its_tokens_alone(http):
    free = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    prompt = "Once upon a time, in a small village,"
    alone = http.post("/generate", json={"text": prompt, "sampling_params": free}).json()["output_ids"]
    con = {"json_schema": json.dumps(PERSON), "temperature": 0, "max_new_tokens": 60}
    # one batch request (constrained first, then the free one), and concurrent constrained ones
    with ThreadPoolExecutor(3) as pool:
        others = [pool.submit(http.post, "/generate", json={"text": f"User {i} as JSON:", "sampling_params": con})
                  for i in range(2)]
        mixed = http.post("/generate", json={"text": ["A user as JSON:", prompt],
                                             "sampling_params": [con, free]}).json()
        for f in others:
            validate(json.loads(f.result().json()["text"]), PERSON)
    assert mixed[1]["output_ids"] == alone
    validate(json.loads(mixed[0]["text"]), PERSON)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/completions", {"prompt": "x", "regex": "[0-"}, "regex"),
    ("/v1/completions", {"prompt": "x", "regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{oops"}}, "sampling_params.json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= nothing"}}, "sampling_params.ebnf"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [], "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {"name": "a"}}],
                              "tool_choice": {"type": "function", "function": {"name": "b"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {}}]},
     "tools.0.function.name"),
])
def test_bad_constraints_are_400_naming_the_field_and_server_keeps_serving(http, model, path, body, param):
    r = http.post(path, json={"model": model, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    ok = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_openai_sdk_parse_with_pydantic(client, model):
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str
        population: int

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model=model, messages=[{"role": "user", "content": "A city as JSON."}], max_tokens=80,
              temperature=0, response_format=City)
    city = r.choices[0].message.parsed
    assert isinstance(city, City)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                            "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
WEATHER_Q = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]


def sdk_accumulated(chunks, tools):
    """The ``openai`` SDK's own accumulation of a streamed chat answer (choice 0)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState(input_tools=tools)
    for ch in chunks:
        state.handle_chunk(ch)
    return state.get_final_completion().choices[0]


@pytest.mark.parametrize("choice,name", [("required", None),
                                         ({"type": "function", "function": {"name": "get_time"}}, "get_time")])
def test_forced_tool_call_has_schema_valid_arguments_streaming_or_not(client, model, choice, name):
    kw = dict(model=model, messages=WEATHER_Q, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=80,
              temperature=0, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if name:
        assert call.function.name == name
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    heads = [t for t in streamed if t.id is not None]
    assert [(t.index, t.type, t.function.name, t.function.arguments) for t in heads] == \
        [(0, "function", call.function.name, "")]
    assert len(streamed) > 2  # the arguments came in several pieces
    final = sdk_accumulated(chunks, [WEATHER, TIME])
    assert final.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]


def test_required_with_parallel_calls_allows_several_each_valid(client, model):
    r = client.chat.completions.create(model=model, messages=WEATHER_Q, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=160, temperature=0)
    c = r.choices[0]
    if c.finish_reason == "length":  # several calls ran out of tokens: every complete one still parses
        return
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) >= 1
    for call in c.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_auto_parses_the_call_the_model_writes(client, model):
    """``--tool-call-parser qwen25`` with ``tool_choice: auto``: the model's ``<tool_call>`` text becomes
    ``tool_calls``. SGLang's ``ebnf`` extra field (the grammar a ``required`` choice would use) makes
    SmolLM2 write one; the answer is read by the auto parser, not by the forced path."""
    from fleetserve.entrypoints.tool_parser import forced_call_grammar

    kw = dict(model=model, messages=WEATHER_Q, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=80,
              temperature=0, extra_body={"ebnf": forced_call_grammar([WEATHER, TIME], None)})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1 and not c.message.content
    call = c.message.tool_calls[0]
    validate(json.loads(call.function.arguments),
             {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"])
    final = sdk_accumulated(list(client.chat.completions.create(**kw, stream=True)), [WEATHER, TIME])
    assert final.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]
    # unconstrained auto: the model may or may not call; either way the answer is well formed
    free = client.chat.completions.create(**{**kw, "extra_body": {}}).choices[0]
    if free.message.tool_calls:
        assert free.finish_reason == "tool_calls"
        for t in free.message.tool_calls:
            assert isinstance(json.loads(t.function.arguments), dict)
    else:
        assert free.finish_reason in ("stop", "length") and free.message.content


def test_tool_call_and_result_go_back_through_the_template(client, model):
    turn = WEATHER_Q + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    short = client.chat.completions.create(model=model, messages=WEATHER_Q, tools=[WEATHER], max_tokens=1,
                                           temperature=0).usage.prompt_tokens
    r = client.chat.completions.create(model=model, messages=turn, tools=[WEATHER], max_tokens=20, temperature=0)
    # the call's JSON and the result are in the prompt (SmolLM2's template would drop them)
    assert r.usage.prompt_tokens > short + 20
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_is_plain_text(client, model):
    r = client.chat.completions.create(model=model, messages=WEATHER_Q, tools=[WEATHER], tool_choice="none",
                                       max_tokens=10, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("parser", ["deepseekv3", "llama3", "qwen25"])
def test_each_formats_forcing_grammar_yields_text_its_parser_reads(http, parser):
    """The grammar a ``required`` choice uses under ``--tool-call-parser <parser>`` makes SmolLM2 write
    a call in that format; the format's parser reads it back, whole and streamed, schema-valid."""
    from helpers.tool_streams import accumulate, stream

    from fleetserve.entrypoints.tool_parser import forced_call_grammar
    from fleetserve.entrypoints.tool_parsers import get_format, parse_tool_calls

    grammar = forced_call_grammar([WEATHER, TIME], None, parser, parallel=False)
    r = http.post("/generate", json={"text": "What's the weather in Paris for the next 3 days? Call a tool.",
                                     "sampling_params": {"ebnf": grammar, "max_new_tokens": 100, "temperature": 0}})
    assert r.status_code == 200, r.text
    text = r.json()["text"]
    assert r.json()["meta_info"]["finish_reason"]["type"] == "stop", text
    fmt = get_format(parser)
    content, calls = parse_tool_calls(fmt, text)
    assert content is None and len(calls) == 1, text
    call = calls[0]["function"]
    validate(json.loads(call["arguments"]), {"get_weather": WEATHER, "get_time": TIME}[call["name"]]["function"]
             ["parameters"])
    streamed_content, deltas = stream(fmt, text, 2)
    assert not streamed_content.strip()
    assert [(n, a) for _, n, a in accumulate(deltas)] == [(call["name"], call["arguments"])]
