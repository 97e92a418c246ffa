"""Adding a field to a client's JSON body without writing the body anew.

The router passes request bodies on byte for byte.  Where it must add a field (the DP rank it chose,
the ``stream_options`` a migrating stream needs) it puts the field first into the client's bytes, so
everything the client wrote reaches the worker as written: a number a JSON parser would round (an
integer past 64 bits) stays exact, and no time goes into serializing the body again.
"""

from __future__ import annotations


def put_first(body: bytes, name: bytes, value: bytes) -> bytes:
    """The JSON object ``body`` with ``"name": value`` as its first member (``value``: JSON bytes).

    A later member of the same name in ``body`` wins in the usual JSON parsers (Python's ``json``,
    orjson, pydantic), so callers add a name the client did not send, or one the client's own value
    should override.  Bytes before the opening brace (whitespace) are kept.  Raises ValueError when
    ``body`` holds no ``{``."""
    i = body.index(b"{") + 1
    rest = body[i:]
    sep = b"" if rest.strip() == b"}" else b","
    return body[:i] + b'"' + name + b'":' + value + sep + rest
