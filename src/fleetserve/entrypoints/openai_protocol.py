"""Request and response models of the HTTP API (pydantic v2).

Two families:

* OpenAI: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``. Field names,
  defaults and response shapes follow the OpenAI API reference (completions default
  ``max_tokens=16``; chat leaves it unset, meaning "up to the context limit").
* SGLang-native: ``/generate`` (``text`` or ``input_ids``, single or batch,
  ``sampling_params`` as SGLang's dict) and ``/abort_request``.

All request models are *strict*: a JSON boolean or float where an integer is
expected (``prompt=[true]``, ``n=2.0``) and a string where a number is expected are
rejected rather than coerced, so bad input gets a 400. Unknown top-level fields are
ignored (clients send vendor extensions), unsupported ones that would change the
result (``suffix``, non-text content parts) are rejected by the server.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer


def random_id(prefix: str) -> str:
    """``prefix-<32 hex chars>``, unique per request."""
    return f"{prefix}-{uuid.uuid4().hex}"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Loose(BaseModel):
    """Response models: plain data, no coercion worries."""

    model_config = ConfigDict(extra="allow")


# --------------------------------------------------------------------- requests


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI ``response_format.json_schema``: ``name`` (required), ``schema``, ``strict``."""

    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    """OpenAI ``response_format``: ``text``, ``json_object`` or ``json_schema`` (with ``json_schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class _SamplingFields(_Strict):
    """Sampling fields shared by completions and chat completions (with SGLang's and vLLM's
    extra constraint fields ``json_schema`` / ``regex`` / ``ebnf`` beside OpenAI's ``response_format``)."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # SGLang's extra field: the DP rank to serve the request (checked by validation.resolve_routed_dp_rank)
    routed_dp_rank: Any = None
    response_format: Optional[ResponseFormat] = None
    json_schema: Optional[Union[str, dict[str, Any]]] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None


# A prompt for /v1/completions: text, texts, token ids, or lists of token ids.
PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: PromptType
    max_tokens: Optional[int] = None  # None (or absent) -> 16, OpenAI's default
    echo: bool = False
    logprobs: Optional[int] = None  # number of top alternatives per position (0..20)
    suffix: Optional[str] = None  # not supported: rejected when not None
    best_of: Optional[int] = None


class TextContentPart(_Strict):
    type: str
    text: Optional[str] = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextContentPart]]] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: Optional[int] = None  # None -> up to the context limit
    max_completion_tokens: Optional[int] = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: bool = True  # OpenAI's default: the model may make several calls
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None


class GenerateRequest(_Strict):
    """SGLang-native ``POST /generate``: exactly one of ``text`` / ``input_ids``.

    ``sampling_params`` is SGLang's dict (``max_new_tokens``, ``temperature``, ...); for a
    batch it may be one dict for all or a list with one per prompt.
    """

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    rid: Optional[Union[str, list[str]]] = None
    routed_dp_rank: Any = None  # checked by validation.resolve_routed_dp_rank
    data_parallel_rank: Any = None  # SGLang's older name for routed_dp_rank


class AbortRequest(_Strict):
    """SGLang-native ``POST /abort_request``."""

    rid: str


# -------------------------------------------------------------------- responses


class PromptTokensDetails(_Loose):
    cached_tokens: int = 0


class UsageInfo(_Loose):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionLogprobs(_Loose):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Loose):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class CompletionResponse(_Loose):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(_Loose):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(_Loose):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Loose):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatMessageOut(_Loose):
    role: str = "assistant"
    content: Optional[str] = None


class ChatChoice(_Loose):
    index: int
    message: ChatMessageOut
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class ChatCompletionResponse(_Loose):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None


class DeltaMessage(_Loose):
    """A streamed chunk's ``delta``: only the fields it carries are written (OpenAI's stream
    sends ``{"role": "assistant", "content": ""}`` first, then ``{"content": ...}`` or
    ``{"tool_calls": [...]}``, and ``{}`` with the finish reason; vLLM serialises its chunks
    with ``exclude_unset`` for the same result), never ``"role": null``."""

    role: Optional[str] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _only_what_is_set(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Loose):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(_Loose):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[UsageInfo] = None


class CompletionChunk(_Loose):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(_Loose):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fleetserve"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Loose):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)
