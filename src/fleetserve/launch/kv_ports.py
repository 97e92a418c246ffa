"""Each instance of ``fleetserve launch`` gets its own KV-event publisher ports.

An instance publishes KV-cache events (``--kv-events-config``, docs/kv_events.md) on the
config's ``endpoint`` (and ``replay_endpoint``), DP rank ``r`` on the port ``+ r`` (vLLM's and
SGLang's ``offset_endpoint_port``).  Given the same flag, every instance of a launch would
bind the same ports and all but the first would die at start-up.  So launch gives instance
``i`` the config with both endpoints offset by ``i * D``, ``D`` being the instance's DP size
(``--dp-size`` / ``--dp``, default 1), the same rule as ``fleetserve sim-worker --num-workers``:

=========  ==========================================
instance   ports (base ``P`` from the flag, ``D`` ranks)
=========  ==========================================
0          ``P .. P + D - 1``
1          ``P + D .. P + 2D - 1``
i          ``P + i*D .. P + i*D + D - 1``
=========  ==========================================

``ipc://`` and ``inproc://`` endpoints of instance ``i`` > 0 get the suffix ``_w<i>`` instead
(the engine then suffixes ``_dp<r>`` for its rank ``r`` > 0, so no two names meet).  The instances report their own config in ``/get_server_info``, so a ``kv_aware``
router finds each stream from the worker URL alone.  The same for ``--worker-kind engine``
and ``sim``.

With ``--policy kv_aware`` and no ``--kv-events-config``, launch gives the instances one itself
(:func:`default_kv_events_config`): ZMQ on ``tcp://*:P``, ``P`` the first port from
:data:`DEFAULT_KV_EVENTS_PORT` (vLLM's and SGLang's default endpoint, ``tcp://*:5557``) whose
whole range for the fleet can be bound now; a kv_aware router without streams would only route
on its approximate tree.  ``--kv-events-config '{"publisher":"null"}'`` keeps them off.
"""

from __future__ import annotations

import json

from fleetserve.engine.kv_events.config import FLAG, offset_endpoint, parse_kv_events_config


def _offset(endpoint: str, index: int, ranks: int) -> str:
    """Instance ``index``'s endpoint: a ``tcp://`` port + ``index * ranks``; other schemes + ``_w<index>``."""
    if endpoint.startswith("tcp://"):
        return offset_endpoint(endpoint, index * ranks)
    return f"{endpoint}_w{index}"


def _last(argv: list[str], flags: tuple[str, ...]) -> tuple[int, str | None, bool]:
    """``(index, value, joined)`` of the last ``--flag v`` / ``--flag=v`` among ``flags``; ``(-1, None, False)``."""
    found = (-1, None, False)
    for i, tok in enumerate(argv):
        if tok in flags and i + 1 < len(argv):
            found = (i, argv[i + 1], False)
        else:
            for f in flags:
                if tok.startswith(f + "="):
                    found = (i, tok.split("=", 1)[1], True)
    return found


def dp_size(instance_args: list[str]) -> int:
    """The instances' DP size from ``--dp-size`` / ``--dp`` (1 when absent or not a positive integer:
    the instance refuses a bad value itself, with its own one-line error)."""
    _, v, _ = _last(instance_args, ("--dp-size", "--dp"))
    try:
        n = int(v) if v is not None else 1
    except ValueError:
        return 1
    return n if n >= 1 else 1


def instance_kv_events_args(instance_args: list[str], index: int) -> list[str]:
    """``instance_args`` with instance ``index``'s ``--kv-events-config`` (endpoints offset by
    ``index * dp_size``); unchanged when the flag is absent, publishes nothing, or ``index`` is 0.

    Raises:
        ValueError: one line naming ``--kv-events-config``: the JSON is bad, or an offset port
            passes 65535.
    """
    pos, text, joined = _last(instance_args, (FLAG,))
    if pos < 0 or index == 0:
        return list(instance_args)
    cfg = parse_kv_events_config(text)
    if cfg is None:
        return list(instance_args)
    ranks = dp_size(instance_args)
    obj = json.loads(text)
    obj["endpoint"] = _offset(cfg.endpoint, index, ranks)
    if cfg.replay_endpoint is not None:
        obj["replay_endpoint"] = _offset(cfg.replay_endpoint, index, ranks)
    new = json.dumps(obj, separators=(",", ":"))
    out = list(instance_args)
    if joined:
        out[pos] = f"{FLAG}={new}"
    else:
        out[pos + 1] = new
    return out


#: vLLM's and SGLang's default KV-event endpoint port (their ``KVEventsConfig.endpoint`` ``tcp://*:5557``).
DEFAULT_KV_EVENTS_PORT = 5557


def given(instance_args: list[str]) -> bool:
    """Whether the instance flags hold a ``--kv-events-config`` (any value, "publish nothing" included)."""
    return _last(instance_args, (FLAG,))[0] >= 0


def default_kv_events_config(instance_args: list[str], workers: int, taken: set[int],
                             start: int = DEFAULT_KV_EVENTS_PORT, tries: int = 200,
                             busy=None) -> str | None:
    """The ``--kv-events-config`` JSON launch gives a kv_aware fleet that has none: ZMQ on ``tcp://*:P``
    with the first ``P >= start`` such that the ports ``P .. P + workers x D - 1`` (instance ``i``'s DP
    rank ``r`` on ``P + i x D + r``) are none of ``taken`` (the launch's HTTP ports) and can all be
    bound on every interface now; None when no such range is found in ``tries`` steps.  ``busy``:
    ``port -> bool`` (default: a bind test on 0.0.0.0)."""
    if busy is None:
        from fleetserve.entrypoints.ports import port_busy_error

        def busy(q: int) -> bool:
            return port_busy_error("", "0.0.0.0", q) is not None

    n = workers * dp_size(instance_args)
    base = start
    for _ in range(tries):
        if base + n - 1 > 65535:
            return None
        clash = next((q for q in range(base, base + n) if q in taken or busy(q)), None)
        if clash is None:
            return json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{base}"}, separators=(",", ":"))
        base = clash + 1
    return None


def check_kv_event_ports(instance_args: list[str], workers: int) -> str | None:
    """One line naming ``--kv-events-config`` when its JSON is bad or the last instance's last DP
    rank would use a port above 65535; None when fine (or no events)."""
    _, text, _ = _last(instance_args, (FLAG,))
    try:
        cfg = parse_kv_events_config(text)
    except ValueError as e:
        return str(e)
    if cfg is None:
        return None
    ranks = dp_size(instance_args)
    for key, ep in (("endpoint", cfg.endpoint), ("replay_endpoint", cfg.replay_endpoint)):
        if ep is None or not ep.startswith("tcp://"):
            continue
        top = int(ep.rsplit(":", 1)[1]) + workers * ranks - 1
        if top > 65535:
            return (f"{FLAG}: {key} {ep!r}: {workers} instance(s) x {ranks} DP rank(s) need ports up to "
                    f"{top} > 65535 (instance i uses the port + i x DP size + rank)")
    return None
