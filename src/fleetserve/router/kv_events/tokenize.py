"""Router-side tokenization (``--tokenizer-path``): the ids the engine will see, without torch.

``tokenizers.Tokenizer`` encodes; the chat template is rendered with jinja2 in
a sandbox, with the context transformers' ``apply_chat_template`` gives it
(``messages``, ``tools``, ``add_generation_prompt``, the special tokens,
``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII), and
the text is then encoded without special tokens, as our engine and SGLang do.
(transformers itself is not used: importing it imports torch.)

``--tokenizer-path`` is a tokenizer directory (``tokenizer.json`` plus
``tokenizer_config.json`` and optionally ``chat_template.jinja``) or a
``tokenizer.json`` file (its directory is searched for the other two).

Which ids a request gets (:meth:`RouterTokenizer.request_ids`):

* ``/v1/chat/completions``: the rendered ``messages`` (shaped as the engine shapes them:
  :func:`template_chat`; plus ``tools``, ``add_generation_prompt``, ``continue_final_message``,
  ``chat_template_kwargs``);
* ``/v1/completions``: a string ``prompt`` encoded with special tokens, or its token ids;
* ``/generate``: ``input_ids``, else ``text`` encoded with special tokens.

A batch (a list of prompts) or anything that does not fit gives None: the
request is then routed by its text alone.

Encoding goes through :class:`.fast_bpe.ByteLevelBPE` (the same ids, 10x less
CPU or more; its prefix block cache makes a shared opening nearly free) when the tokenizer is a byte-level BPE of a shape it knows and passes its
self-check; otherwise through ``Tokenizer.encode``.  The environment variable
``FLEETSERVE_ROUTER_FAST_TOKENIZE=0`` turns the fast encoder off (to compare).

With ``l0_max_entries`` > 0 (``--tokenizer-cache-enable-l0``, sglang-router's
L0 cache) the ids of each encoded text are remembered, keyed by the exact text,
for at most that many texts (first in, first out): a repeated prompt or
rendered chat skips the encoder.

Where it runs (:meth:`RouterTokenizer.inline`): with the fast encoder, a
request whose text is at most :data:`INLINE_MAX_CHARS` characters is tokenized
on the event loop (about 0.1-0.3 ms for 2 KB; the encoder holds the GIL
anyway, so a thread would only add the hand-off); longer ones, and every
request without the fast encoder, go to the policy's thread pool, where the
event loop still gets the GIL at least every few tens of ms (a 1.6 MB prompt of
new text: at most 29 ms without it; 12 MB: 78 ms).  A text over
:data:`MAX_TOKENIZE_CHARS` characters (:func:`text_size`) is not tokenized: the
policy routes it on its text.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from datetime import datetime

from tokenizers import Tokenizer

from .fast_bpe import ByteLevelBPE

INLINE_MAX_CHARS = 8192  # longer texts are tokenized on a thread (see the module docstring)
# longer texts are not tokenized at all (routed on their text, reason=text): about a million tokens, past
# every model's context but the longest; tokenizing 12 MB took ~7 s of a core, and the body limit is 512 MiB
MAX_TOKENIZE_CHARS = 1 << 22
_CONTEXT_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
log = logging.getLogger("fleetserve.router")


def _token_text(v) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):  # AddedToken as saved by older transformers
        return v["content"]
    return None


class RouterTokenizer:
    """A tokenizer and chat template read from ``path``; raises ``ValueError`` naming what is missing."""

    def __init__(self, path: str, l0_max_entries: int = 0) -> None:
        path = os.path.abspath(os.path.expanduser(path))
        if os.path.isdir(path):
            folder, tok_file = path, os.path.join(path, "tokenizer.json")
        else:
            folder, tok_file = os.path.dirname(path), path
        if not os.path.isfile(tok_file):
            raise ValueError(f"no tokenizer.json at {tok_file}")
        try:
            self.tokenizer = Tokenizer.from_file(tok_file)
        except Exception as e:  # tokenizers raises Exception subclasses from Rust
            raise ValueError(f"cannot read {tok_file}: {e}") from None
        self.path = path
        self.l0_max_entries = l0_max_entries
        self.l0: dict[tuple[str, bool], list[int]] = {}  # (text, add_special_tokens) -> ids, oldest first
        self.l0_hits = self.l0_misses = 0
        self._l0_lock = threading.Lock()
        self.fast = None  # a ByteLevelBPE, or None: Tokenizer.encode
        if os.environ.get("FLEETSERVE_ROUTER_FAST_TOKENIZE", "1") != "0":
            with open(tok_file, encoding="utf-8") as f:
                self.fast = ByteLevelBPE.from_tokenizer(self.tokenizer, json.load(f))
        cfg = {}
        cfg_file = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            try:
                with open(cfg_file, encoding="utf-8") as f:
                    cfg = json.load(f)
            except ValueError as e:  # invalid JSON or UTF-8
                raise ValueError(f"cannot read {cfg_file}: {e}") from None
            if not isinstance(cfg, dict):
                raise ValueError(f"{cfg_file} holds a JSON {type(cfg).__name__}, not an object")
        self.special = {k: _token_text(cfg.get(k)) for k in _CONTEXT_TOKENS}
        template, where, self.template_error = _chat_template(folder, cfg, cfg_file)
        self.chat_template = template
        # compiled here, not on the first chat request: jinja2 takes ~30 ms to compile SmolLM2's
        # template, which the first requests after start-up waited for on the event loop
        self._compiled = None
        if template:
            try:
                self._compiled = _environment().from_string(template)
            except Exception as e:  # jinja2.TemplateSyntaxError and kin: chat requests are then routed on their text
                line = getattr(e, "lineno", None)
                self.template_error = (f"the chat template in {where} does not compile"
                                       f"{f' (line {line})' if line else ''}: {type(e).__name__}: {str(e).rstrip('.')}")
        self._misfit_said = False  # a chat that did not fit the template is said once (render_chat)

    # ------------------------------------------------------------ encoding
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (a new list the caller may keep)."""
        if self.l0_max_entries:
            ids = self.l0.get((text, add_special_tokens))
            if ids is not None:
                self.l0_hits += 1
                return list(ids)
            self.l0_misses += 1
        if self.fast is not None:
            ids = self.fast.encode(text, add_special_tokens)
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if self.l0_max_entries:
            with self._l0_lock:  # pool threads may insert at once
                while len(self.l0) >= self.l0_max_entries:
                    del self.l0[next(iter(self.l0))]
                self.l0[(text, add_special_tokens)] = tuple(ids)
        return ids

    def encode_chars(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], str | None]:
        """``(encode(text, add_special_tokens), chars)``: ``chars``, the ids as one character each
        (``"".join(map(chr, ids))``), when the fast encoder had them at hand (its cached prefix blocks:
        :meth:`.fast_bpe.ByteLevelBPE.encode_chars`), else None."""
        if self.fast is None or self.l0_max_entries:
            return self.encode(text, add_special_tokens), None
        return self.fast.encode_chars(text, add_special_tokens)

    def render_chat(self, messages: list, tools=None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, extra: dict | None = None) -> str:
        """The chat template applied to ``messages``; raises ``ValueError`` without a template or on a misfit."""
        if self._compiled is None:
            raise ValueError(self.template_error)
        ctx = {k: v for k, v in self.special.items() if v is not None}
        ctx.update(extra or {})
        ctx.update(messages=messages, add_generation_prompt=add_generation_prompt and not continue_final_message)
        if tools:
            ctx["tools"] = tools
        try:
            text = self._compiled.render(**ctx)
        except Exception as e:  # jinja2 TemplateError, or raise_exception() from the template
            if not self._misfit_said:  # a template that refuses every chat would otherwise go unnoticed
                self._misfit_said = True
                log.warning("kv_aware: a chat did not fit the chat template (%s: %s); such chats are routed on "
                            "their text (branch=fallback reason=text; said once)", type(e).__name__, e)
            raise ValueError(f"messages do not fit the chat template: {e}") from None
        if continue_final_message and messages and isinstance(messages[-1].get("content"), str):
            # as transformers: cut the rendered text after the final message's content
            final = messages[-1]["content"].strip()
            cut = text.rfind(final)
            if cut >= 0:
                text = text[:cut + len(final)]
        return text

    def inline(self, path: str, body: dict) -> bool:
        """True when ``body`` is cheap enough to tokenize on the event loop (see the module docstring)."""
        if self.fast is None:
            return False
        size = text_size(path, body)
        return size is not None and size <= INLINE_MAX_CHARS and not (
            path == "/v1/chat/completions" and (body.get("tools") or len(body.get("messages")) > 64))

    def request_ids(self, path: str, body: dict) -> list[int] | None:
        """Token ids of one request body (see the module docstring); None when it has none to give."""
        return self.request_ids_chars(path, body)[0]

    def request_ids_chars(self, path: str, body: dict) -> tuple[list[int] | None, str | None]:
        """``(request_ids(path, body), chars)``, ``chars`` as :meth:`encode_chars` gives them (None
        where the ids were not encoded here or the encoder did not have them at hand)."""
        try:
            if path == "/v1/chat/completions":
                msgs = template_chat(body.get("messages"))
                if msgs is None:
                    return None, None
                extra = body.get("chat_template_kwargs")
                text = self.render_chat(msgs, body.get("tools"), body.get("add_generation_prompt", True) is not False,
                                        body.get("continue_final_message") is True,
                                        extra if isinstance(extra, dict) else None)
                return self.encode_chars(text, add_special_tokens=False)
            prompt = body.get("prompt") if path == "/v1/completions" else (
                body.get("input_ids") if body.get("input_ids") is not None else body.get("text"))
            if isinstance(prompt, str):
                return self.encode_chars(prompt)
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return prompt, None
            if isinstance(prompt, list) and len(prompt) == 1:  # a batch of one
                p = prompt[0]
                if isinstance(p, str):
                    return self.encode_chars(p)
                if isinstance(p, list) and p and all(type(t) is int for t in p):
                    return p, None
        except ValueError:
            return None, None
        return None, None


def _chat_template(folder: str, cfg: dict, cfg_file: str) -> tuple[str | None, str | None, str | None]:
    """``(template, where it was found, why there is none usable)``: ``chat_template.jinja`` in ``folder``,
    else the config's ``chat_template`` (a string, or the ``"default"`` of a list of named ones)."""
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        try:
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        except (OSError, ValueError) as e:  # e.g. not UTF-8
            return None, jinja_file, f"cannot read {jinja_file}: {e}"
        return (template, jinja_file, None) if template.strip() else (None, jinja_file, f"{jinja_file} is empty")
    named = cfg.get("chat_template")
    if isinstance(named, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in named if isinstance(t, dict)}.get("default")
        if not isinstance(named, str):
            return None, cfg_file, f"the chat templates in {cfg_file} have none named 'default'"
    if isinstance(named, str) and named.strip():
        return named, cfg_file, None
    return None, None, f"no chat template (no chat_template.jinja, none in {cfg_file})"


def template_chat(messages) -> list[dict] | None:
    """``messages`` as the engine hands them to the chat template: a list of text parts becomes their
    texts joined by newlines, a null content an empty one, and a ``developer`` message a ``system`` one, as
    our engine does
    (``entrypoints/validation.chat_messages``; vLLM joins text parts with newlines too).  None when
    they are not a list of messages or a part is not text (an image: no ids to compute here).
    Tool definitions and calls are left as they are: how they reach the template differs from
    engine to engine (a difference the tokenizer check then shows, :mod:`.tokenizer_check`)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    return None
                texts.append(part["text"])
            m = {**m, "content": "\n".join(texts)}
        elif content is None:
            m = {**m, "content": ""}
        if m.get("role") == "developer":
            m = {**m, "role": "system"}
        out.append(m)
    return out


def text_size(path: str, body: dict) -> int | None:
    """Characters of the text a request would have tokenized: its string ``prompt`` / ``text``, or the
    sum of its chat messages' string contents and text parts; None when that is not known without rendering
    (no messages list), or there is no text to tokenize (a part that is not text gives a chat no ids)."""
    if path == "/v1/chat/completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return None
        size = 0
        for m in msgs:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, list):  # content parts: their texts (template_chat gives no ids for any other part)
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in c):
                    return None
                size += sum(len(p["text"]) for p in c)
            elif c is not None and not isinstance(c, str):
                return None
            else:
                size += len(c or "")
        return size
    prompt = body.get("prompt") if path == "/v1/completions" else body.get("text")
    return len(prompt) if isinstance(prompt, str) else None


def request_ids_without_tokenizer(path: str, body: dict) -> list[int] | None:
    """Token ids a request gives itself (``input_ids`` / a token-id ``prompt``); None otherwise."""
    prompt = body.get("prompt") if path == "/v1/completions" else body.get("input_ids")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


def _environment():
    """A sandboxed jinja2 environment set up as transformers sets up chat templates."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
