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


def run(sched, reqs, max_steps: int = 5000) -> dict:
    """Add ``reqs`` (outputs of ``add_request`` included, e.g. a request refused at once), then step
    until idle, at most ``max_steps`` steps. ``{rid: (generated token ids, last ReqOutput)}``."""
    toks, last = {}, {}
    for r in reqs:
        for o in sched.add_request(r):
            last[o.rid] = o
    for _ in range(max_steps):
        if not sched.has_work():
            break
        for o in sched.step():
            toks.setdefault(o.rid, []).extend(o.new_token_ids)
            last[o.rid] = o
    assert not sched.has_work(), "scheduler did not finish"
    return {rid: (toks.get(rid, []), o) for rid, o in last.items()}


def prompt(seed: int, n: int, vocab: int = 50) -> list[int]:
    """``n`` token ids in ``[1, vocab)``, reproducible from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()
