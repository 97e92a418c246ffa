"""KV-cache events over ZMQ, on the wire as vLLM and SGLang publish them (``--kv-events-config``).

* :mod:`.config`: the JSON config, its checks, and the per-DP-rank endpoints;
* :mod:`.events`: the three events and their msgpack encodings (``map`` / ``array``);
* :mod:`.replay`: the buffer of recent batches and the ROUTER replay protocol;
* :mod:`.publisher`: the sink the radix cache calls, one batch per scheduler
  step, a bounded queue and a background thread that owns the sockets.

See ``docs/kv_events.md`` for the wire format.
"""
