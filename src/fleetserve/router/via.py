"""Request loops: the ``Via`` header (RFC 9110, section 7.6.3) that tells a router its own request.

A router registered as its own worker (``/add_worker`` with its own URL), or two routers registered
as each other's workers, would forward a request round the loop until every attempt timed out.  So
every request this router sends a worker carries ``Via`` with this router's pseudonym
(``1.1 fleetserve-<8 hex digits>``, random per process) appended to the client's own ``Via``; a
request that arrives already naming that pseudonym came round a loop and is answered
``508 Loop Detected`` (code ``loop_detected``) at once, which the sending attempt then counts as
that worker's 5xx.  Routers stacked on purpose (a router in front of routers) have distinct
pseudonyms and pass.
"""

from __future__ import annotations

import logging
import secrets

from .http.server import Response, json_error

log = logging.getLogger("fleetserve.router")


def new_pseudonym() -> str:
    """This router's ``Via`` entry: ``1.1 fleetserve-`` and 8 random hex digits."""
    return f"1.1 fleetserve-{secrets.token_hex(4)}"


def forwarded_via(incoming: str | None, own: str) -> str:
    """The ``Via`` value to send on: the client's entries, then ``own``."""
    return own if not incoming else f"{incoming}, {own}"


def loop_answer(headers: dict[str, str], own: str, path: str) -> Response | None:
    """508 when ``headers`` (lower-case names) carry a ``Via`` naming ``own``, else None."""
    via = headers.get("via")
    if via is None or own not in via:
        return None
    log.warning("request loop on %s: it arrived with this router's own Via entry (%s); is the router "
                "registered as one of its own workers?", path, own)
    return json_error(508, f"request loop detected: this request already passed through this router ({own}); "
                      "a worker URL points back at the router", "loop_detected", code="loop_detected")
