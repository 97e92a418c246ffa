"""Requests in, :class:`SamplingParams` out: every field check before a request reaches a scheduler.

The HTTP routes and the offline :class:`~fleetserve.entrypoints.engine.Engine`
both go through these functions, and every refusal is an
:class:`~fleetserve.entrypoints.errors.APIError` (status 400 unless said
otherwise) whose ``param`` names the request field at fault, spelled the way
the client spelled it (``max_tokens``, ``max_completion_tokens``,
``sampling_params.temperature``). The engine's own range check
(:meth:`SamplingParams.verify`, raising ``SamplingParamsError``) is called
here and translated; nothing below ``entrypoints/`` knows about HTTP.

Two request dialects are understood:

* OpenAI completions and chat completions (the pydantic models of
  :mod:`fleetserve.entrypoints.openai_protocol`);
* SGLang's ``sampling_params`` dict (``POST /generate`` and ``Engine.generate``).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from fleetserve.engine.grammar.spec import GRAMMAR_FIELDS, JSON_OBJECT_SCHEMA
from fleetserve.engine.sampling_params import SamplingParams, SamplingParamsError
from fleetserve.entrypoints.errors import APIError
from fleetserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from fleetserve.entrypoints.tool_checks import check_tool_messages, check_tools

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
NATIVE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for sampling_params.max_new_tokens
MAX_TOP_LOGPROBS = 20
# Samples one request may ask for (``n``; ``sampling_params.n`` on /generate). OpenAI's own API allows
# 128; each sample holds its own decode slot and KV, so more is refused (400, param ``n``). README: "Limits".
MAX_N = 128


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _unsupported(field: str, why: str = "is not supported by this server") -> APIError:
    return APIError(f"'{field}' {why}", 400, field, "unsupported_parameter")


# ------------------------------------------------------------------ token ids


def check_input_ids(ids: Sequence[Any], vocab_size: int, param: str) -> list[int]:
    """``ids`` as a list of token ids.

    Raises:
        APIError(400, param): empty, an element that is not an int (bools count as
            not), or an id outside ``[0, vocab_size)``.
    """
    if len(ids) == 0:
        raise APIError(f"{param} must not be empty", 400, param)
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise APIError(f"token ids must be integers; {param}[{i}] is {t!r}", 400, param)
        if not 0 <= t < vocab_size:
            raise APIError(f"token id {t} at {param}[{i}] is outside the vocabulary [0, {vocab_size})", 400, param)
    return list(ids)


# ------------------------------------------------------------- sampling params


def fit_sampling(fields: dict[str, Any], *, prompt_len: int, vocab_size: int, context_length: int | None,
                 max_tokens_param: str = "max_tokens", default_max_tokens: int | None = None,
                 prompt_param: str = "prompt") -> SamplingParams:
    """Build and range-check :class:`SamplingParams`, fitting ``max_new_tokens`` into the context.

    Args:
        fields: SamplingParams field names; a None value means "the default", and
            ``max_new_tokens=None`` (or absent) means ``default_max_tokens`` capped by
            the room the context leaves, or all of that room when there is no default.
        prompt_len: tokens in the prompt.
        vocab_size: valid token ids are ``[0, vocab_size)`` (for ``stop_token_ids``).
        context_length: prompt plus output tokens the model takes; None skips the
            context checks (the offline engine leaves them to its scheduler).
        max_tokens_param: the client's name for ``max_new_tokens``, used in errors.
        default_max_tokens: see ``fields``.
        prompt_param: the client's name for the prompt, used in errors (``messages`` on chat, as OpenAI).

    Raises:
        APIError(400): ``param="n"`` when more than :data:`MAX_N` samples are asked for;
            ``param=prompt_param`` when the prompt alone fills the context;
            ``max_tokens_param`` when prompt + output overflows it (both with code
            ``context_length_exceeded``); the field's name when a value is out of range.
    """
    ctx = context_length
    if ctx is not None and prompt_len >= ctx:
        raise APIError(f"the prompt has {prompt_len} tokens, the model's context is {ctx} tokens", 400,
                       prompt_param, "context_length_exceeded")
    fields = {k: v for k, v in fields.items() if v is not None or k == "max_new_tokens"}
    if fields.get("max_new_tokens") is None and ctx is not None:
        room = ctx - prompt_len
        fields["max_new_tokens"] = room if default_max_tokens is None else min(default_max_tokens, room)
    try:
        sp = SamplingParams.from_dict(fields)
        sp.verify(vocab_size)
    except SamplingParamsError as e:
        raise APIError(str(e), 400, max_tokens_param if e.param == "max_new_tokens" else e.param) from e
    except TypeError as e:
        raise APIError(str(e), 400, None) from e
    if sp.n > MAX_N:
        raise APIError(f"n must be at most {MAX_N}, got {sp.n}", 400, "n")
    if ctx is not None and prompt_len + sp.max_new_tokens > ctx:
        raise APIError(
            f"this model's maximum context length is {ctx} tokens; the prompt has {prompt_len} tokens and "
            f"{max_tokens_param}={sp.max_new_tokens} asks for {prompt_len + sp.max_new_tokens}",
            400, max_tokens_param, "context_length_exceeded")
    return sp


def native_sampling(raw: dict[str, Any] | None, *, prompt_len: int, vocab_size: int,
                    context_length: int | None) -> SamplingParams:
    """SGLang's ``sampling_params`` dict -> checked :class:`SamplingParams`.

    ``max_new_tokens`` absent means 128; ``None`` means up to the context limit.
    Errors name the field as ``sampling_params.<field>`` (``prompt`` stays
    ``prompt``). Raises :class:`APIError` (400) for an unknown key, a value out of
    range, or a request that does not fit the context (see :func:`fit_sampling`).
    """
    d = dict(raw or {})
    try:
        base = SamplingParams.from_dict({k: v for k, v in d.items() if k != "max_new_tokens"})
    except SamplingParamsError as e:
        raise APIError(str(e), 400, f"sampling_params.{e.param}") from e
    except TypeError as e:
        raise APIError(str(e), 400, "sampling_params") from e
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__ if k in d}
    fields["max_new_tokens"] = d.get("max_new_tokens", NATIVE_DEFAULT_MAX_NEW_TOKENS)
    try:
        return fit_sampling(fields, prompt_len=prompt_len, vocab_size=vocab_size, context_length=context_length,
                            max_tokens_param="max_new_tokens")
    except APIError as e:
        if e.param and not e.param.startswith("sampling_params") and e.param != "prompt":
            e.param = f"sampling_params.{e.param}"
        raise


def openai_grammar_fields(req: CompletionRequest | ChatCompletionRequest) -> tuple[dict[str, Any], str | None]:
    """The constraint of an OpenAI body as SamplingParams fields, and the request field it came from.

    ``response_format`` ``json_object`` is the schema ``{"type": "object"}`` and
    ``json_schema`` its ``json_schema.schema`` (none given: any JSON object), as
    SGLang and vLLM map them; ``text`` is no constraint. The extra fields
    ``json_schema`` (text or object), ``regex`` and ``ebnf`` are SGLang's.

    Raises:
        APIError(400): ``response_format`` ``json_schema`` without its ``json_schema``
            object, or two constraints at once (``param`` the second one).
    """
    found: list[tuple[str, str, str]] = []  # (SamplingParams field, text, request field)
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("json_schema", JSON_OBJECT_SCHEMA, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError("response_format of type 'json_schema' needs the 'json_schema' object", 400,
                           "response_format.json_schema")
        schema = rf.json_schema.schema_
        found.append(("json_schema", JSON_OBJECT_SCHEMA if schema is None else json.dumps(schema),
                      "response_format"))
    if req.json_schema is not None:
        text = req.json_schema if isinstance(req.json_schema, str) else json.dumps(req.json_schema)
        found.append(("json_schema", text, "json_schema"))
    for name in ("regex", "ebnf"):
        if getattr(req, name) is not None:
            found.append((name, getattr(req, name), name))
    if len(found) > 1:
        raise APIError(f"only one of response_format (json), json_schema, regex, ebnf may be given; got "
                       f"{', '.join(f[2] for f in found)}", 400, found[1][2])
    if not found:
        return {}, None
    field, text, source = found[0]
    return {field: text}, source


def openai_sampling_fields(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The OpenAI request's sampling fields under SamplingParams names (None: "use the default")."""
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    return {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "stop": stop,
        "stop_token_ids": req.stop_token_ids,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "n": req.n,
        **openai_grammar_fields(req)[0],
    }


def _grammar_param(req: CompletionRequest | ChatCompletionRequest, e: APIError) -> APIError:
    """A grammar error names the request field the client used (``response_format`` or the extra field)."""
    if e.param in GRAMMAR_FIELDS:
        e.param = openai_grammar_fields(req)[1] or e.param
    return e


def completion_sampling(req: CompletionRequest, *, prompt_len: int, vocab_size: int,
                        context_length: int) -> SamplingParams:
    """Sampling for one prompt of ``/v1/completions`` (``max_tokens`` absent: 16, capped by the context)."""
    try:
        return _completion_sampling(req, prompt_len, vocab_size, context_length)
    except APIError as e:
        raise _grammar_param(req, e) from e.__cause__


def check_openai_max_tokens(value: Any, param: str, echo: bool = False) -> None:
    """OpenAI's and vLLM's floor on the output length: a given ``max_tokens`` /
    ``max_completion_tokens`` below 1 is a 400 naming ``param`` (vLLM's message,
    ``max_tokens must be at least 1, got 0.``, from ``SamplingParams._verify_args``).

    ``echo=True`` with ``max_tokens`` 0 on ``/v1/completions`` stays allowed: the prompt
    comes back (with its logprobs) and nothing is generated, vLLM's "echo without
    generation" (``CompletionRequest.to_sampling_params``). SGLang's ``max_new_tokens`` 0
    on ``/generate`` is not checked here (SGLang allows it).
    """
    if _is_int(value) and value < 1 and not (echo and value == 0):
        raise APIError(f"{param} must be at least 1, got {value}.", 400, param)


def _completion_sampling(req: CompletionRequest, prompt_len: int, vocab_size: int,
                         context_length: int) -> SamplingParams:
    check_openai_max_tokens(req.max_tokens, "max_tokens", echo=bool(req.echo))
    return fit_sampling({**openai_sampling_fields(req), "max_new_tokens": req.max_tokens}, prompt_len=prompt_len,
                        vocab_size=vocab_size, context_length=context_length, max_tokens_param="max_tokens",
                        default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)


def chat_sampling(req: ChatCompletionRequest, *, prompt_len: int, vocab_size: int,
                  context_length: int) -> SamplingParams:
    """Sampling for ``/v1/chat/completions``: ``max_completion_tokens`` wins over ``max_tokens``;
    neither means up to the context limit."""
    try:
        return _chat_sampling(req, prompt_len, vocab_size, context_length)
    except APIError as e:
        raise _grammar_param(req, e) from e.__cause__


def _chat_sampling(req: ChatCompletionRequest, prompt_len: int, vocab_size: int,
                   context_length: int) -> SamplingParams:
    for param in ("max_completion_tokens", "max_tokens"):
        check_openai_max_tokens(getattr(req, param), param)
    newer = req.max_completion_tokens is not None
    return fit_sampling({**openai_sampling_fields(req),
                         "max_new_tokens": req.max_completion_tokens if newer else req.max_tokens},
                        prompt_len=prompt_len, vocab_size=vocab_size, context_length=context_length,
                        max_tokens_param="max_completion_tokens" if newer else "max_tokens", prompt_param="messages")


# ------------------------------------------------------------- request shapes


def check_stream_options(req: CompletionRequest | ChatCompletionRequest) -> None:
    """``stream_options`` only with ``"stream": true``, as OpenAI's API and vLLM answer (a 400 naming
    ``stream_options``; OpenAI: "only allowed when 'stream' is enabled")."""
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed when stream is true", 400, "stream_options")


def check_completion_request(req: CompletionRequest) -> None:
    """Refuse what ``/v1/completions`` does not implement (``suffix``, ``best_of != n``,
    ``logit_bias``), ``logprobs`` outside ``[0, 20]`` and ``stream_options`` without ``stream``.
    Raises :class:`APIError` (400)."""
    check_stream_options(req)
    if req.suffix is not None:
        raise _unsupported("suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise _unsupported("best_of", "is not supported (only best_of == n)")
    if req.logit_bias:
        raise _unsupported("logit_bias")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise APIError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", 400, "logprobs")


def completion_prompts(prompt: Any, encode: Callable[[str], list[int]], vocab_size: int) -> list[list[int]]:
    """The ``prompt`` of ``/v1/completions`` (text, texts, token ids or lists of ids) as token id lists.

    Raises:
        APIError(400, ``prompt``): an empty prompt or prompt list, an empty text in a
            list, or token ids that :func:`check_input_ids` refuses.
    """
    if not prompt:
        raise APIError("prompt must not be empty", 400, "prompt")
    if isinstance(prompt, str):
        return [encode(prompt)]
    if isinstance(prompt[0], str):
        out = []
        for i, p in enumerate(prompt):
            if not p:
                raise APIError(f"prompt[{i}] must not be empty", 400, "prompt")
            out.append(encode(p))
        return out
    if isinstance(prompt[0], list):
        return [check_input_ids(p, vocab_size, "prompt") for p in prompt]
    return [check_input_ids(prompt, vocab_size, "prompt")]


def check_chat_request(req: ChatCompletionRequest) -> None:
    """Refuse empty ``messages``, ``logit_bias``, ``top_logprobs`` outside ``[0, 20]`` or
    without ``logprobs``, and ``stream_options`` without ``stream``. Raises :class:`APIError` (400)."""
    check_stream_options(req)
    if not req.messages:
        raise APIError("messages must not be empty", 400, "messages")
    if req.logit_bias:
        raise _unsupported("logit_bias")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise APIError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", 400, "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise APIError("top_logprobs needs logprobs=true", 400, "top_logprobs")
    check_tools(req.tools, req.tool_choice)
    check_tool_messages(req.messages)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as chat-template dicts (``role``, ``content`` text, and ``name`` /
    ``tool_call_id`` / ``tool_calls`` when given). Text parts are joined by newlines;
    the ``developer`` role becomes ``system``.

    Raises:
        APIError(400): a non-text content part (``messages.<k>.content.<j>.type``), or
            no message with any content (``messages``).
    """
    messages = []
    for k, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError(f"content part type {part.type!r} is not supported (text only)", 400,
                                   f"messages.{k}.content.{j}.type")
                parts.append(part.text)
            content = "\n".join(parts)
        # OpenAI's "developer" role is the newer name of "system"; chat templates know the latter
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        for extra in ("name", "tool_call_id", "tool_calls"):
            if getattr(m, extra) is not None:
                msg[extra] = getattr(m, extra)
        messages.append(msg)
    if all(not m["content"] for m in messages):
        raise APIError("messages have no content", 400, "messages")
    return messages


def generate_is_batch(req: GenerateRequest) -> bool:
    """Whether ``/generate`` was sent a batch (a list of texts or a list of id lists)."""
    ids = req.input_ids
    return isinstance(req.text, list) or bool(isinstance(ids, list) and ids and isinstance(ids[0], list))


def generate_prompts(req: GenerateRequest, encode: Callable[[str], list[int]], vocab_size: int) -> list[list[int]]:
    """The prompts of ``/generate`` as token id lists, one per prompt of the batch.

    Raises:
        APIError(400): both or neither of ``text`` / ``input_ids`` (``text``), an
            empty text (``text``), empty or out-of-vocabulary ids (``input_ids``).
    """
    if (req.text is None) == (req.input_ids is None):
        raise APIError("send exactly one of 'text' and 'input_ids'", 400, "text")
    if req.text is not None:
        texts = req.text if isinstance(req.text, list) else [req.text]
        if not texts or not all(texts):
            raise APIError("text must not be empty", 400, "text")
        return [encode(t) for t in texts]
    raw = req.input_ids if generate_is_batch(req) else [req.input_ids]
    if not raw:
        raise APIError("input_ids must not be empty", 400, "input_ids")
    return [check_input_ids(p, vocab_size, "input_ids") for p in raw]


def generate_sampling_dicts(raw: dict[str, Any] | list[dict[str, Any]] | None, count: int) -> list[dict[str, Any]]:
    """``sampling_params`` of ``/generate``, one dict per prompt (one dict or none: shared by all).

    Raises :class:`APIError` (400, ``sampling_params``) when a list has not ``count`` entries.
    """
    if not isinstance(raw, list):
        return [raw or {}] * count
    if len(raw) != count:
        raise APIError("sampling_params list must have one entry per prompt", 400, "sampling_params")
    return raw


def generate_rids(rid: str | list[str] | None, count: int) -> list[str | None]:
    """``rid`` of ``/generate``, one per prompt (None: the server picks).

    Raises :class:`APIError` (400, ``rid``) unless a list, or a single id, gives one per prompt.
    """
    rids = rid if isinstance(rid, list) else ([rid] if rid else [None] * count)
    if len(rids) != count:
        raise APIError("rid list must have one entry per prompt", 400, "rid")
    return rids


# ------------------------------------------------------------ routed DP rank

DP_RANK_HEADER = "x-data-parallel-rank"  # vLLM's X-data-parallel-rank, SGLang's X-Data-Parallel-Rank


def resolve_routed_dp_rank(body_rank: Any, header_rank: str | None, dp_size: int,
                           body_param: str = "routed_dp_rank") -> int | None:
    """The DP rank a request names, checked against ``dp_size``; None when it names none.

    The ``X-data-parallel-rank`` header wins over the body field (SGLang's order; vLLM
    reads only the header). As in SGLang's tokenizer manager, rank 0 on an instance
    with ``dp_size == 1`` is accepted and ignored (None).

    Args:
        body_rank: the body's ``routed_dp_rank`` (or SGLang's older ``data_parallel_rank``), any JSON value.
        header_rank: the header's raw text, or None when absent.
        dp_size: the instance's ``--dp-size`` (>= 1).
        body_param: the body field's name, for errors.

    Raises:
        APIError(400): the header is not an integer (``param`` None, message as SGLang's);
            the body value is not an integer (bools are not); the rank is outside
            ``[0, dp_size)`` (message ``routed_dp_rank=R out of range [0, dp_size)``, SGLang's).
    """
    param = body_param
    rank: Any = body_rank
    if header_rank is not None:
        try:
            rank = int(header_rank.strip())
        except ValueError:
            raise APIError(f"Invalid X-Data-Parallel-Rank header: must be an integer, got '{header_rank}'",
                           400, None) from None
        param = None
    if rank is None:
        return None
    if not _is_int(rank):
        raise APIError(f"{body_param} must be an integer in [0, {dp_size}), got {rank!r}", 400, param)
    if dp_size <= 1 and rank == 0:
        return None
    if not 0 <= rank < dp_size:
        raise APIError(f"routed_dp_rank={rank} out of range [0, {dp_size})", 400, param)
    return rank
