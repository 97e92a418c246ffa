"""Drive a :class:`~fleetserve.engine.scheduler.Scheduler` in-process until its requests finish."""

from __future__ import annotations


def run_to_completion(sched, reqs) -> dict:
    """Add ``reqs``, step until idle; ``{rid: (all generated token ids, last ReqOutput)}``."""
    toks, last = {}, {}
    for r in reqs:
        sched.add_request(r)
    while sched.has_work():
        for o in sched.step():
            toks.setdefault(o.rid, []).extend(o.new_token_ids)
            last[o.rid] = o
    return {rid: (toks[rid], last[rid]) for rid in last}
