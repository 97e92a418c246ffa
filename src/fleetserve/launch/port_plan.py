"""Every TCP port a ``fleetserve launch`` will listen on, checked for collisions before anything starts.

The plan lists, per owner: the router's ``--port`` (or the ``--port`` / ``--host`` in
``--router-args``, ``launch/router_address.py``; and its ``--prometheus-port`` when the
``--router-args`` give one), each instance's HTTP port (``--worker-base-port + i``) and, with a
``--kv-events-config``, the ports each instance's DP rank ``r`` binds: the ``endpoint``'s
(when it binds: a wildcard host, see :func:`~fleetserve.engine.kv_events.config.binds`) and the
``replay_endpoint``'s (always bound), each at the port + ``i x D + r`` (``launch/kv_ports.py``).
Two entries collide when they have the same port and their hosts overlap (the same host, or
either one a wildcard: ``*``, ``0.0.0.0``, ``::``, empty); then the launch is refused with one
line naming the flag of the later entry, and which earlier one it meets. Without this check
the second owner would die only when it starts (minutes into a launch of engines). A KV-event
port that another program holds now is refused the same way (:func:`first_busy`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetserve.engine.kv_events.config import FLAG, binds, offset_endpoint, parse_kv_events_config
from fleetserve.launch.kv_ports import _last, dp_size, instance_kv_events_args

WILDCARDS = ("*", "0.0.0.0", "::", "[::]", "")


@dataclass(frozen=True)
class PlannedPort:
    """One port launch's children will bind: ``flag`` sets it, ``owner`` says whose it is."""

    flag: str
    owner: str
    host: str
    port: int


def _overlap(a: str, b: str) -> bool:
    return a in WILDCARDS or b in WILDCARDS or a == b


def _tcp(endpoint: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``tcp://HOST:PORT`` endpoint (brackets kept off an IPv6 host), else None."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return host.strip("[]") if host.startswith("[") else host, int(port)


def kv_event_ports(instance_args: list[str], workers: int) -> list[PlannedPort]:
    """The TCP ports the instances' KV-event sockets bind, instance by instance, rank by rank.

    Call it after :func:`~fleetserve.launch.kv_ports.check_kv_event_ports` passed (a bad config
    or a port past 65535 raises ``ValueError`` here).
    """
    _, text, _ = _last(instance_args, (FLAG,))
    if parse_kv_events_config(text) is None:
        return []
    ranks = dp_size(instance_args)
    out = []
    for i in range(workers):
        _, own, _ = _last(instance_kv_events_args(instance_args, i), (FLAG,))
        cfg = parse_kv_events_config(own)
        for r in range(ranks):
            for key, ep, bound in (("endpoint", cfg.endpoint, binds(cfg.endpoint)),
                                   ("replay_endpoint", cfg.replay_endpoint, True)):
                if ep is None or not bound:
                    continue
                hp = _tcp(offset_endpoint(ep, r))
                if hp is not None:
                    out.append(PlannedPort(FLAG, f"worker{i}'s {key} (DP rank {r})", *hp))
    return out


def plan(host: str, router_port: int, worker_base_port: int, workers: int, instance_args: list[str],
         prometheus: tuple[str, int] | None = None, router_host: str | None = None,
         router_flag: str = "--port") -> list[PlannedPort]:
    """Every port of the launch, HTTP ones first (``prometheus``: the router's ``(host, port)``).

    ``host``: the instances' (and, unless ``router_host`` is given, the router's) address;
    ``router_flag``: the flag that set ``router_port`` (``--router-args --port`` when it came from there).
    """
    ports = [PlannedPort(router_flag, "the router's HTTP port", host if router_host is None else router_host,
                         router_port)]
    if prometheus is not None and prometheus[1] != 0:
        ports.append(PlannedPort("--router-args --prometheus-port", "the router's metrics port", *prometheus))
    ports += [PlannedPort("--worker-base-port", f"worker{i}'s HTTP port", host, worker_base_port + i)
              for i in range(workers)]
    return ports + kv_event_ports(instance_args, workers)


def first_busy(ports: list[PlannedPort]) -> str | None:
    """One line naming the flag of the first KV-event port that cannot be bound now (another program
    holds it); None if all can. The HTTP ports are checked by ``launch.check_ports``."""
    from fleetserve.entrypoints.ports import port_busy_error

    for p in ports:
        if p.flag == FLAG:
            busy = port_busy_error(f"{FLAG}: {p.owner}", "0.0.0.0" if p.host in WILDCARDS else p.host, p.port)
            if busy:
                return busy
    return None


def first_collision(ports: list[PlannedPort]) -> str | None:
    """One line naming the flag of the first port that an earlier entry already takes; None if none."""
    seen: dict[int, list[PlannedPort]] = {}
    for p in ports:
        for q in seen.get(p.port, ()):
            if _overlap(p.host, q.host):
                return (f"{p.flag}: {p.owner} would listen on port {p.port}, which is already {q.owner} "
                        f"({q.flag}); every port of the launch must differ")
        seen.setdefault(p.port, []).append(p)
    return None
