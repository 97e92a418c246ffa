"""Requests the router has read in full whose handlers have not started yet.

The server (:mod:`.server`) counts a request when it schedules the task that will handle it
and uncounts it when that task starts (or its connection is lost first).  The upstream client
(:mod:`.client`) reads the count when a handler hands it a request to send: while other
requests read together with it are still to be handled, the write waits for theirs, and the
last of them writes every request queued meanwhile at once (``UpstreamPool._queue_write``).
So the router routes every request that arrived together before it wakes any worker, and a
request that arrives alone is written at once, with no extra turn of the event loop.
"""

from __future__ import annotations


class Arrivals:
    """``waiting``: requests read in full whose handler task has been scheduled but has not started.

    One per router (its :class:`~.client.UpstreamPool` owns it, its main server counts into it).
    Event-loop only.  A count left too high (a bug) only delays writes by one loop turn: the pool
    also writes its queue at the end of every turn in which it queued something.
    """

    __slots__ = ("waiting",)

    def __init__(self) -> None:
        self.waiting = 0
