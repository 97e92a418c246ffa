"""``--kv-events-config``: the JSON object that turns KV-cache event publishing on.

Keys and defaults are those of vLLM's ``KVEventsConfig``
(``vllm/config/kv_events.py``) and SGLang's
(``python/sglang/srt/disaggregation/kv_events.py``), so a command line of
either carries over:

* ``publisher`` (``"null"``): ``"zmq"`` publishes, ``"null"`` publishes nothing;
* ``enable_kv_cache_events`` (``false``): vLLM's switch; ``true`` without a
  ``publisher`` means ``"zmq"``;
* ``endpoint`` (``"tcp://*:5557"``): the PUB socket, port + DP rank;
* ``replay_endpoint`` (``null``: none): the ROUTER replay socket, port + DP rank;
* ``buffer_steps`` (``10000``): batches kept for replay;
* ``hwm`` (``100000``): ZMQ send high-water mark, in messages, per subscriber
  (``0``: no limit, ZMQ's meaning);
* ``max_queue_size`` (``100000``): batches waiting for the publisher thread;
  further ones are dropped (counted);
* ``topic`` (``""``): the first frame of every message; subscribers filter on
  its prefix;
* ``encoding`` (``"map"``, ours): ``"map"``, events as tagged maps (vLLM since
  its PR #42892, SGLang since #37482), or ``"array"``, events as tagged
  positional arrays (older vLLM and SGLang).

An unknown key is refused, as SGLang's config model does (``extra="forbid"``).
Every error is a ``ValueError`` whose one-line message starts with
``--kv-events-config`` and names the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

FLAG = "--kv-events-config"
PUBLISHERS = ("null", "zmq")
ENCODINGS = ("map", "array")
SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """A checked ``--kv-events-config`` (see the module docstring for each field)."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: str = "map"

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq"


def _fail(key: str, problem: str) -> ValueError:
    return ValueError(f"{FLAG}: {key}: {problem}")


def _int(obj: dict, key: str, default: int, minimum: int) -> int:
    v = obj.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(key, f"must be an integer, got {v!r}")
    if v < minimum:
        raise _fail(key, f"must be >= {minimum}, got {v}")
    return v


def check_endpoint(key: str, endpoint: object) -> str:
    """``endpoint`` if it is a ZMQ address we can offset per DP rank, else ``ValueError`` naming ``key``.

    Accepted: ``tcp://HOST:PORT`` (``HOST`` may be ``*``, a name, an IPv4
    address or a bracketed IPv6 one; ``PORT`` 1..65535), ``ipc://PATH`` and
    ``inproc://NAME``.
    """
    if not isinstance(endpoint, str) or not endpoint:
        raise _fail(key, f"must be a non-empty string, got {endpoint!r}")
    if not endpoint.startswith(SCHEMES):
        raise _fail(key, f"must start with tcp://, ipc:// or inproc://, got {endpoint!r}")
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise _fail(key, f"must be tcp://HOST:PORT with PORT in 1..65535, got {endpoint!r}")
    elif endpoint.endswith("//"):
        raise _fail(key, f"names no path, got {endpoint!r}")
    return endpoint


def parse_kv_events_config(text: str | None) -> KVEventsConfig | None:
    """Parse and check the JSON of ``--kv-events-config``.

    Args:
        text: the flag's value; ``None`` or ``""``: no events.

    Returns:
        The config, or ``None`` when nothing is to be published (no text, or
        ``publisher`` ``"null"``).

    Raises:
        ValueError: one line naming the flag and the key (not JSON, not an
            object, an unknown key, an unknown publisher or encoding, a malformed
            endpoint, a negative or zero size).
    """
    if text is None or text == "":
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{FLAG}: not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{FLAG}: must be a JSON object, got {type(obj).__name__}")
    known = {f for f in KVEventsConfig.__dataclass_fields__} | {"enable_kv_cache_events"}
    for key in obj:
        if key not in known:
            raise _fail(key, f"unknown key (known: {', '.join(sorted(known))})")
    enable = obj.get("enable_kv_cache_events", False)
    if not isinstance(enable, bool):
        raise _fail("enable_kv_cache_events", f"must be true or false, got {enable!r}")
    publisher = obj.get("publisher")
    if publisher is None:  # vLLM: the publisher follows enable_kv_cache_events; SGLang: "null"
        publisher = "zmq" if enable else "null"
    if publisher not in PUBLISHERS:
        raise _fail("publisher", f"must be one of {PUBLISHERS}, got {publisher!r}")
    encoding = obj.get("encoding", "map")
    if encoding not in ENCODINGS:
        raise _fail("encoding", f"must be one of {ENCODINGS}, got {encoding!r}")
    topic = obj.get("topic", "")
    if not isinstance(topic, str):
        raise _fail("topic", f"must be a string, got {topic!r}")
    replay = obj.get("replay_endpoint")
    cfg = KVEventsConfig(
        publisher=publisher,
        endpoint=check_endpoint("endpoint", obj.get("endpoint", KVEventsConfig.endpoint)),
        replay_endpoint=None if replay is None else check_endpoint("replay_endpoint", replay),
        buffer_steps=_int(obj, "buffer_steps", KVEventsConfig.buffer_steps, 0),
        hwm=_int(obj, "hwm", KVEventsConfig.hwm, 0),
        max_queue_size=_int(obj, "max_queue_size", KVEventsConfig.max_queue_size, 1),
        topic=topic,
        encoding=encoding,
    )
    if cfg.replay_endpoint is not None and cfg.replay_endpoint == cfg.endpoint:
        raise _fail("replay_endpoint", f"must differ from endpoint ({cfg.endpoint!r})")
    return cfg if cfg.enabled else None


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of DP rank ``rank``: ``tcp://`` port + ``rank``; ``ipc://`` and ``inproc://``
    get ``_dp<rank>`` appended; rank 0 keeps ``endpoint`` unchanged.

    vLLM's and SGLang's ``offset_endpoint_port`` do the same for tcp and inproc
    (they refuse ipc for rank > 0; we suffix it like inproc).

    Raises:
        ValueError: the offset port passes 65535.
    """
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        p = int(port) + rank
        if p > 65535:
            raise ValueError(f"{FLAG}: endpoint {endpoint!r}: DP rank {rank} would use port {p} > 65535")
        return f"{base}:{p}"
    return f"{endpoint}_dp{rank}"


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds (a wildcard host ``*``, ``::`` or ``0.0.0.0``, or ``ipc://`` /
    ``inproc://``) or connects (a named host: a collector that binds) - vLLM's and SGLang's rule."""
    return ("*" in endpoint or "::" in endpoint or "0.0.0.0" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))
