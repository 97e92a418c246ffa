"""Where each later turn of a conversation went, and what it found cached, from ``--dump-requests`` files.

``routing_experiment.py kv --rates ... --dump-requests`` writes, per router row,
``<log-dir>/requests-<router>-<rate>-<run>.json``: every request's id (``c<conversation>-t<turn>``),
worker, prompt and cached tokens and whether it went straight to a worker.  This groups every turn after
a conversation's first by how it was sent (routed / direct) and by where it went against the turn
before it:

- after a routed turn: ``stay`` (the same worker) or ``moved``;
- after a direct turn: ``to the direct worker`` (the previous turn's), ``to the last routed worker`` (the
  worker of the conversation's latest routed turn, when that was another), or ``elsewhere``
  (``elsewhere, no routed turn yet`` when the conversation had none).

Each class gets its count and its hit rate (cached over prompt tokens).  A router that follows the cache
keeps ``routed after routed: moved`` small; the direct classes show what traffic past the router does
to a conversation's cache, whichever router is in front.

A second table (:func:`shortfalls`) compares, for every routed request, the cached tokens the router
predicted (its ``x-fleetserve-route`` header's ``cached_tokens``) with what the worker found: how many
found less than predicted, how many tokens they lost, and what that cost the run's hit rate (lost tokens
over every served request's prompt tokens, direct ones included).  For ``kv_aware`` under a backlog that is
mostly a prefix the worker held at the decision and evicted while the request waited in its queue (the
prediction was right when made), so it tells a run that lost its cache in the queues from one whose
decisions differed; for ``cache_aware`` it also counts its approximate tree's drift.

Usage::

    python benchmarks/routing_kv_moves.py /tmp/fpin2/r5-request
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

_RID = re.compile(r"c(\d+)-t(\d+)$")
_PREDICTED = re.compile(r"(?:^|; )cached_tokens=(\d+)(?:;|$)")


def classify(records: list[dict]) -> dict[str, tuple[int, int, int]]:
    """``{class: (turns, cached tokens, prompt tokens)}`` over the turns after each conversation's first.

    ``records``: dicts with ``rid`` (``c<conv>-t<turn>``), ``worker``, ``direct``, ``cached`` and
    ``prompt`` (a ``--dump-requests`` file).  A failed request (``worker`` null: it was never served) is
    left out, and a turn whose previous turn is missing (failed, not in the file) is skipped.  Raises
    ValueError on an id of another shape (e.g. shared_prefix's ``g<group>-p<prompt>``)."""
    convs: dict[int, dict[int, dict]] = defaultdict(dict)
    for r in records:
        if r.get("worker") is None:
            continue
        m = _RID.search(r["rid"])
        if m is None:
            raise ValueError(f"request id {r['rid']!r} is not c<conversation>-t<turn>")
        convs[int(m[1])][int(m[2])] = r
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for turns in convs.values():
        for t in sorted(turns):
            prev = turns.get(t - 1)
            if t == 0 or prev is None:
                continue
            r = turns[t]
            how = "direct" if r["direct"] else "routed"
            if not prev["direct"]:
                where = "stay" if r["worker"] == prev["worker"] else "moved"
                name = f"{how} after routed: {where}"
            else:
                last = next((turns[u]["worker"] for u in range(t - 2, -1, -1)
                             if u in turns and not turns[u]["direct"]), None)
                if r["worker"] == prev["worker"]:
                    where = "to the direct worker"
                elif last is not None and r["worker"] == last:
                    where = "to the last routed worker"
                else:
                    where = "elsewhere" if last is not None else "elsewhere, no routed turn yet"
                name = f"{how} after direct: {where}"
            c = out[name]
            c[0] += 1
            c[1] += r["cached"]
            c[2] += r["prompt"]
    return {k: (v[0], v[1], v[2]) for k, v in sorted(out.items())}


def shortfalls(records: list[dict]) -> tuple[int, int, int, int, int]:
    """``(predicted, predicted tokens, short, short tokens, found tokens)`` over the routed requests.

    ``predicted``: served routed requests whose ``route`` (the ``x-fleetserve-route`` header) names a
    ``cached_tokens`` figure; ``predicted tokens``: the sum of those figures; ``short``: the requests
    whose worker found fewer cached tokens (``cached``) than that; ``short tokens``: the sum of
    ``predicted - cached`` over them; ``found tokens``: the sum of ``cached`` over the predicted
    requests.  Direct, failed (``worker`` null) and unpredicted (``cached_tokens=-``) requests are
    left out.  Raises KeyError on a record without ``direct`` or ``cached``."""
    n = pred_sum = short = lost = found = 0
    for r in records:
        if r.get("worker") is None or r["direct"]:
            continue
        m = _PREDICTED.search(r.get("route") or "")
        if m is None:
            continue
        p, c = int(m[1]), r["cached"]
        n += 1
        pred_sum += p
        found += c
        if c < p:
            short += 1
            lost += p - c
    return n, pred_sum, short, lost, found


# the fields a record must have, and their types (``--dump-requests``); worker and route may be null
_FIELDS = {"rid": (str,), "worker": (str, type(None)), "direct": (bool,), "cached": (int,), "prompt": (int,),
           "route": (str, type(None))}


def _load(f: Path) -> list:
    """The records of one dump file, each checked (:data:`_FIELDS`: ``route`` may be absent, counts as
    null; token counts are ints >= 0).  Raises ValueError naming the record and the field."""
    records = json.loads(f.read_text())
    if not isinstance(records, list):
        raise ValueError("not a list of request records")
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ValueError(f"record {i} is a {type(r).__name__}, not an object")
        for name, types in _FIELDS.items():
            if name not in r:
                if name == "route":
                    continue
                raise ValueError(f"record {i} ({r.get('rid')!r}): missing field '{name}'")
            v = r[name]
            if not isinstance(v, types) or (types == (int,) and (isinstance(v, bool) or v < 0)):
                raise ValueError(f"record {i} ({r.get('rid')!r}): {name} = {v!r} is not "
                                 + ("a token count" if types == (int,) else " or ".join(
                                     "null" if t is type(None) else t.__name__ for t in types)))
    return records


def _named(f: Path, fn):
    """``fn(records of f)``; raises ValueError naming the file on anything it cannot read."""
    try:
        return fn(_load(f))
    except (ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError) as e:  # json's: ValueErrors
        what = f"missing field {e}" if isinstance(e, KeyError) else str(e) or type(e).__name__
        raise ValueError(f"{f}: {what}") from None


def read_records(f: Path) -> dict[str, tuple[int, int, int]]:
    """:func:`classify` of one dump file; raises ValueError naming the file on anything it cannot read."""
    return _named(f, classify)


def _summary(records: list[dict]) -> tuple[dict, tuple, int]:
    """:func:`classify`, :func:`shortfalls` and the served prompt tokens of one file's records."""
    served = sum(r["prompt"] for r in records if r.get("worker") is not None)
    return classify(records), shortfalls(records), served


def table(files: list[Path]) -> str:
    """Markdown: one row per (file, class), then one row per file of :func:`shortfalls`.  Each file is
    read once."""
    runs = [(f.stem.removeprefix("requests-"), *_named(f, _summary)) for f in files]
    lines = ["| run | class | turns | hit rate |", "|---|---|---|---|"]
    for run, classes, _short, _served in runs:
        for name, (n, cached, prompt) in classes.items():
            lines.append(f"| {run} | {name} | {n} | {cached / prompt:.1%} |" if prompt else
                         f"| {run} | {name} | {n} | - |")
    lines += ["", "| run | routed with a prediction | found less than predicted | tokens predicted | "
              "tokens lost | lost share | hit-rate points lost |", "|---|---|---|---|---|---|---|"]
    for run, _classes, (n, pred, short, lost, _found), served in runs:
        share = f"{lost / pred:.1%}" if pred else "-"
        points = f"{lost / served * 100:.1f}" if served else "-"
        lines.append(f"| {run} | {n} | {short} | {pred} | {lost} | {share} | {points} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log_dir", help="a --log-dir of a run with --dump-requests")
    a = p.parse_args()
    d = Path(a.log_dir)
    if not a.log_dir or not d.is_dir():
        raise SystemExit(f"{a.log_dir!r}: not a directory (give the run's --log-dir)")
    files = sorted(d.glob("requests-*.json"))
    if not files:
        raise SystemExit(f"{d}: no requests-*.json (run with --dump-requests)")
    try:
        print(table(files))
    except ValueError as e:
        raise SystemExit(str(e)) from None


if __name__ == "__main__":
    main()
