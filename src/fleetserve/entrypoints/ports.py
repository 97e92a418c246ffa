"""Port checks every command makes before it starts anything: range first, then a bind.

Each check returns one line naming the flag (or None), so that ``serve``,
``sim-worker`` and ``launch`` refuse a bad port the same way, before loading a
model or starting a child. Standard library only: the router-free commands
import it without torch.
"""

from __future__ import annotations

import socket

MAX_PORT = 65535


def port_range_error(flag: str, port: int, count: int = 1, allow_zero: bool = False) -> str | None:
    """Why ports ``port .. port + count - 1`` cannot be used for ``flag``, or None.

    ``allow_zero``: 0 means "let the OS pick a free port" (only for a single port).
    """
    if allow_zero and port == 0 and count == 1:
        return None
    if not 1 <= port <= MAX_PORT:
        pick = " (or 0: pick a free port)" if allow_zero and count == 1 else ""
        return f"{flag} must be in 1..{MAX_PORT}{pick}, got {port}"
    last = port + count - 1
    if last > MAX_PORT:
        return f"{flag} {port} + {count - 1} = {last} is past the last port {MAX_PORT}"
    return None


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (SO_REUSEADDR, as uvicorn and aiohttp set it); raises OSError.

    ``port`` 0 binds a free port: read it back with ``sock.getsockname()[1]``.
    """
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def port_busy_error(flag: str, host: str, port: int) -> str | None:
    """Bind ``host:port`` once and let it go: one line saying why ``flag`` cannot listen there, or None."""
    try:
        bind_socket(host, port).close()
    except OSError as e:
        return f"{flag} {port}: cannot listen on {host}:{port}: {e.strerror or e}"
    return None
