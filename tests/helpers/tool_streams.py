"""Feeding a tool-call format piece by piece, and adding up its OpenAI-style deltas as a client does."""

from fleetserve.entrypoints.tool_parsers import ToolCallStream


def stream(fmt, text, step, max_calls=None):
    """Feed ``text`` in ``step``-character pieces: (content, deltas)."""
    s = ToolCallStream(fmt, max_calls)
    content, deltas = "", []
    for i in range(0, len(text), step):
        c, d = s.feed(text[i:i + step])
        content, deltas = content + c, deltas + d
    c, d = s.finish()
    return content + c, deltas


def accumulate(deltas):
    """Tool calls from OpenAI-style deltas, as a client adds them up: {index: (id, name, arguments)}."""
    calls = {}
    for d in deltas:
        cur = calls.setdefault(d["index"], [None, None, ""])
        if "id" in d:
            assert cur[0] is None and d["type"] == "function" and d["function"]["arguments"] == ""
            cur[0], cur[1] = d["id"], d["function"]["name"]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        cur[2] += d["function"]["arguments"]
    return [tuple(calls[k]) for k in sorted(calls)]
