"""Where the router of a ``fleetserve launch`` listens: launch's ``--host`` / ``--port``, or the
``--host`` / ``--port`` inside ``--router-args``.

The router's own parser (``launch/router_check.py``, run on launch's flags followed by the
``--router-args``) says which address it would take: the last one given, so one in
``--router-args`` wins. Launch then uses that address for everything it does with the router:
its port check and port plan, its ``--port 0`` choice, its readiness wait, the admin calls on a
dead instance and the printed URL. When the user gave both launch's flag and the same flag in
``--router-args`` with different values, the launch is refused with one line naming both
(exit 2): there is no telling which one was meant.
"""

from __future__ import annotations

import argparse

LAUNCH_DESTS = ("host", "port")


def given_launch_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests among ``host`` / ``port`` that ``argv`` sets explicitly (a default is not "given")."""
    unset = object()  # not a str: argparse converts only string defaults
    parser.set_defaults(**{d: unset for d in LAUNCH_DESTS})
    ns, _ = parser.parse_known_args(argv)
    return {d for d in LAUNCH_DESTS if getattr(ns, d) is not unset}


def adopt_router_address(args: argparse.Namespace, router: dict, given: set[str]) -> str | None:
    """Set ``args.router_host`` / ``args.port`` to where the router will listen; an error line, or None.

    ``router``: the router check's JSON (its ``host`` and ``port``); ``given``: from
    :func:`given_launch_flags`. Also sets ``args.router_port_flag`` / ``args.router_host_flag``
    (``--port`` or ``--router-args --port``, for messages) and ``args.router_address_set`` (the
    router's command line then ends with this address, see ``launch.router_argv``).
    """
    host, port = router.get("host", args.host), router.get("port", args.port)
    args.router_host_flag, args.router_port_flag = "--host", "--port"
    if port != args.port:
        if "port" in given:
            return (f"--port {args.port} and --router-args --port {port} differ: give the router's port "
                    f"once (either flag alone sets it)")
        args.port, args.router_port_flag = port, "--router-args --port"
    if host != args.host:
        if "host" in given:
            return (f"--host {args.host} and --router-args --host {host} differ: give the router's address "
                    f"once (launch's --host alone sets the instances' and the router's)")
        args.router_host_flag = "--router-args --host"
    args.router_host = host
    args.router_address_set = True
    return None


def http_url(host: str, port: int) -> str:
    """``http://HOST:PORT`` (an IPv6 host in brackets); a wildcard host as it is: on Linux a
    connection to ``0.0.0.0`` / ``::`` reaches this machine, where the router listens."""
    host = host.strip("[]")
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
