"""A stand-in for a kv_aware KV-event stream (``kv_events.subscriber.Subscription``) in router tests.

It has a trust ``state``, the counters ``/metrics`` reads (all 0) and the stop calls a router's
shutdown makes; no socket.  Put ``{rank: FakeStream()}`` into ``policy.subs[url]`` to give a worker
DP ranks without a publisher.
"""

from __future__ import annotations

import threading


class FakeStream:
    def __init__(self, state: str = "fallback") -> None:
        self.state = state
        self.events = self.batches = self.malformed = self.gaps = self.replays = self.replay_failures = 0
        self._stop = threading.Event()

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()


def two_ranks(policy, urls) -> None:
    """Every worker in ``urls`` has DP ranks 0 and 1 (as its ``/get_server_info`` would say), no events yet."""
    for u in urls:
        policy.subs[u] = {0: FakeStream(), 1: FakeStream()}
