"""Which grammar a request asks for, and whether that grammar is well formed.

SGLang's sampling params name three mutually exclusive constraints:
``json_schema`` (a JSON schema, as JSON text), ``regex`` and ``ebnf`` (a GBNF /
Lark grammar). OpenAI's ``response_format`` maps onto them (``json_object`` is
the schema ``{"type": "object"}``, as SGLang and vLLM map it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
# llguidance's names of the same formats (its ``grammar_from``)
LIBRARY_FORMAT = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(ValueError):
    """The grammar text is not valid. ``param`` names the field (``json_schema``, ``regex``, ``ebnf``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarKey:
    """One grammar: ``kind`` in :data:`GRAMMAR_FIELDS`, ``text`` as the client sent it.

    Hashable: the compile cache is keyed by it.
    """

    kind: str
    text: str


def grammar_key(sampling) -> GrammarKey | None:
    """The grammar of a :class:`~fleetserve.engine.sampling_params.SamplingParams`, or None."""
    for kind in GRAMMAR_FIELDS:
        text = getattr(sampling, kind, None)
        if text is not None:
            return GrammarKey(kind, text)
    return None


def to_library_grammar(key: GrammarKey) -> str:
    """The llguidance grammar definition (a string) of ``key``.

    Raises:
        GrammarError: the JSON schema is not JSON (or not an object / boolean), the
            regex or grammar does not parse, or llguidance rejects it; the message
            carries llguidance's reason.
    """
    import llguidance

    if key.kind == "json_schema":
        try:
            schema = json.loads(key.text)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}", key.kind) from e
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("json_schema must be a JSON object (or a boolean)", key.kind)
    try:
        grammar = llguidance.grammar_from(LIBRARY_FORMAT[key.kind], key.text)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid {key.kind}: {e}", key.kind) from e
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise GrammarError(f"invalid {key.kind}: {'; '.join(m.strip() for m in messages)}", key.kind)
    return grammar


def check_grammar(sampling) -> None:
    """Refuse a request that sets more than one grammar field, a non-string one, or a bad grammar.

    Raises:
        GrammarError: naming the field at fault.
    """
    set_fields = [k for k in GRAMMAR_FIELDS if getattr(sampling, k, None) is not None]
    if len(set_fields) > 1:
        raise GrammarError(f"only one of json_schema, regex, ebnf may be set, got {', '.join(set_fields)}",
                           set_fields[1])
    for k in set_fields:
        if not isinstance(getattr(sampling, k), str):
            raise GrammarError(f"{k} must be a string", k)
    key = grammar_key(sampling)
    if key is not None:
        to_library_grammar(key)
