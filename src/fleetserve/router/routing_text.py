"""The text a request is routed by.

* ``/generate``: ``text`` (a string or a list of strings), else ``input_ids``.
* ``/v1/completions``: ``prompt`` as a string, a list of strings, a list of
  token ids or a list of lists of token ids.
* ``/v1/chat/completions``: every message in order, each as
  ``content + "\\x1e" + role + "\\x1f"``; list content keeps its ``text``
  parts in order and names other parts by type.  Each message adds a piece
  that does not depend on later messages, so turn N's text is a prefix of
  turn N+1's and a conversation keeps matching the same worker.  The role
  marker follows the content: were it first, every conversation would start
  with the same few characters (``"\\x1euser\\x1f"``), and short chats would
  all count as cache hits on whichever worker got the first one (issue 15).

Token ids are turned into a stable text form: one character per id
(``chr(id)``), after a ``"\\x1d"`` marker, so that matched characters are
matched tokens.  Ids outside ``[0, 0x10FFFF]`` fall back to decimal text.
Anything unrecognised routes as ``""`` (no key: load-based choice).
"""

from __future__ import annotations

import codecs
from array import array

_MSG = "\x1e"
_ROLE_END = "\x1f"
_IDS = "\x1d"
_MAX_CP = 0x10FFFF
_U32 = "I" if array("I").itemsize == 4 else "L"  # a 4-byte unsigned array type code
_LE = array(_U32, [1]).tobytes()[0] == 1
# the codec's C function itself: bytes.decode("utf-32-le") would go through encodings/utf_32_le.py's wrapper
_U32_DECODE = codecs.utf_32_le_decode if _LE else codecs.utf_32_be_decode


def ids_text(ids: list, chars: str | None = None) -> str:
    """Stable text form of a list of token ids ("" for an empty list).  ``chars``: the ids as one
    character each (``"".join(map(chr, ids))``) when the caller has them (the router's tokenizer
    joins them from its cached blocks): then only the marker is added."""
    if not ids:
        return ""
    if chars is not None:
        return _IDS + chars
    try:  # the same string as "".join(map(chr, ids)), built in C (3-4x faster on 300 ids)
        return _IDS + _U32_DECODE(array(_U32, ids).tobytes(), "surrogatepass", True)[0]
    except (TypeError, ValueError, OverflowError):  # UnicodeDecodeError is a ValueError: ids > 0x10FFFF
        pass
    try:
        return _IDS + "".join(map(chr, ids))
    except (TypeError, ValueError, OverflowError):
        return _IDS + "".join(f"{i} " for i in ids)


def _prompt_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return ids_text(prompt)
        if isinstance(first, str):
            return "\n".join(p for p in prompt if isinstance(p, str))
        if isinstance(first, list):
            return "\n".join(ids_text(p) for p in prompt if isinstance(p, list))
    return ""


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type")
                if kind == "text":
                    text = part.get("text")
                    parts.append(text if isinstance(text, str) else "")
                else:
                    parts.append(f"<{kind}>")
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return ""


def chat_text(messages) -> str:
    """Routing text of a chat ``messages`` list."""
    if not isinstance(messages, list):
        return ""
    out = []
    for m in messages:
        if isinstance(m, dict):
            role = m.get("role")
            out.append(_content_text(m.get("content")) + _MSG + (role if isinstance(role, str) else "") + _ROLE_END)
    return "".join(out)


def routing_text(path: str, body: dict) -> str:
    """Routing text of a parsed JSON request ``body`` sent to ``path``."""
    if path == "/v1/chat/completions":
        return chat_text(body.get("messages"))
    if path == "/v1/completions":
        return _prompt_text(body.get("prompt"))
    # /generate
    text = body.get("text")
    if text is not None:
        return _prompt_text(text)
    return _prompt_text(body.get("input_ids"))
