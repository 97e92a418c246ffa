"""Tool definitions, assistant tool calls and tool results reach the prompt through the chat template,
also SmolLM2's built-in one (which renders only role and content)."""

import json

import pytest

from fleetserve.entrypoints.tool_messages import template_messages
from fleetserve.entrypoints.tool_parsers import get_format, parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_abc123", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc123", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from fleetserve.models.tokenizer import load_tokenizer

    return load_tokenizer()


def test_smollm2_prompt_carries_tools_calls_and_results(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert "tool_calls" not in tok.chat_template  # the built-in template knows no tools
    messages, tools = template_messages(MESSAGES, TOOLS, tok.chat_template)
    prompt = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert tools is None and prompt.startswith("<|im_start|>system\nYou can call functions")
    assert json.dumps(TOOLS[0]["function"]) in prompt
    call = '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert call in prompt
    assert '<|im_start|>tool\n<tool_response id="call_abc123">\nsunny, 21 C\n</tool_response><|im_end|>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # the call written into the prompt is one the qwen25 parser reads back
    block = prompt[prompt.rindex("<tool_call>"):prompt.rindex("</tool_call>") + len("</tool_call>")]
    assert parse_tool_calls(get_format("qwen25"), block)[1][0]["function"]["name"] == "get_weather"
    assert MESSAGES[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # input untouched


def test_tool_aware_template_gets_calls_with_object_arguments():
    template = "{% for m in messages %}{{ m.role }}{% for c in m.tool_calls or [] %} {{ c.function.arguments | tojson }}" \
               "{% endfor %}{% endfor %}{{ tools | length }}"
    messages, tools = template_messages(MESSAGES, TOOLS, template)
    assert tools == TOOLS and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2]["content"] == "sunny, 21 C"


@pytest.mark.parametrize("bad, param", [
    ({"role": "tool", "content": "x"}, "messages.1.tool_call_id"),
    ({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}, "messages.1.tool_calls.0.id"),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "code", "function": {
        "name": "f", "arguments": "{}"}}]}, "messages.1.tool_calls.0.type"),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": {"a": 1}}}]}, "messages.1.tool_calls.0.function.arguments"),
    ({"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}, "messages.1.tool_calls"),
])
def test_malformed_tool_messages_are_400_naming_the_field(bad, param):
    from fleetserve.entrypoints.errors import APIError
    from fleetserve.entrypoints.openai_protocol import ChatCompletionRequest
    from fleetserve.entrypoints.validation import check_chat_request

    with pytest.raises(APIError) as e:
        check_chat_request(ChatCompletionRequest(messages=[MESSAGES[0], bad]))
    assert (e.value.status, e.value.param) == (400, param)
    check_chat_request(ChatCompletionRequest(messages=MESSAGES, tools=TOOLS))  # the good ones pass
