"""A rank's engine driven in-process, step by step (tests and benchmarks).

The server runs each rank's scheduler behind ZMQ
(:mod:`fleetserve.engine.rank_process`); for exact checks and measurements it is
simpler to drive the same :class:`~fleetserve.engine.scheduler.Scheduler`
directly inside a rank of a :class:`~fleetserve.testing.rank_pool.RankPool`:

* :func:`build_rank_engine` builds the rank's ParallelState, then the rank with
  :func:`fleetserve.engine.rank_builder.build_rank`, the builder every rank
  process uses (same DP-attention hook, same scheduling rule), without ZMQ I/O
  and with one sampling seed;
* :func:`drive` feeds requests at given steps (arrivals, aborts), steps the
  scheduler, records each request's tokens and the logits that chose them, and
  stops when *every* rank has finished (an all-reduce(MIN) of "done" over the
  gloo CPU group each iteration, so no rank leaves while others still need it).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from fleetserve.distributed import comm_stats
from fleetserve.distributed.groups import ParallelConfig, build_parallel_state
from fleetserve.engine.args import ServerArgs
from fleetserve.engine.rank_builder import Rank, build_rank


def build_rank_engine(rank: int, model_path: str, timeout_s: float = 30.0, **server_args: Any) -> Rank:
    """Build this rank's engine for ``ServerArgs(model_path=..., **server_args)`` on the
    already initialised default group (one group of ``tp_size`` ranks).

    Returns:
        The :class:`~fleetserve.engine.rank_builder.Rank` (``scheduler``, ``runner``,
        ``pstate``, ``args``; no loop).

    Raises:
        ValueError: bad server arguments. ParallelConfigError: sizes that do not fit the group.
    """
    server_args.setdefault("random_seed", 0)
    args = ServerArgs(model_path=model_path, **server_args)
    ps = build_parallel_state(ParallelConfig.from_server_args(args), rank, timeout_s=timeout_s)
    return build_rank(args, ps)


def drive(engine: Rank, arrivals: dict[int, list[Any]], aborts: dict[int, list[str]] | None = None,
          record_logits: bool = False, max_steps: int = 10_000, on_step: Any = None) -> dict[str, Any]:
    """Step until every rank is done.

    Args:
        arrivals: ``{step: [TokenizedGenerateReq, ...]}`` added before that step on this rank.
        aborts: ``{step: [rid, ...]}`` aborted before that step.
        record_logits: keep, per request, the float32 logits row of every sampled token.
        on_step: optional ``fn(step_index, scheduler)`` called after each step.

    Returns:
        ``{"reqs": {rid: {"ids", "finish_reason", "logits"?}}, "steps", "forward_steps",
        "seconds", "comm": comm_stats snapshot}``.
    """
    sched, ps = engine.scheduler, engine.pstate
    aborts = aborts or {}
    reqs: dict[str, dict[str, Any]] = {}
    if record_logits:
        original = sched.process_batch_result

        def recording(batch: Any, logits: Any) -> Any:
            if logits is not None and not batch.mode.is_idle():
                done = batch.prefill_done if batch.mode.is_extend() else [True] * len(batch.reqs)
                for i, r in enumerate(batch.reqs):
                    if done[i]:
                        reqs.setdefault(r.rid, {"ids": [], "finish_reason": None, "logits": []})
                        reqs[r.rid]["logits"].append(logits[i].detach().clone())
            return original(batch, logits)

        sched.process_batch_result = recording
    last_arrival = max(list(arrivals) + list(aborts) + [-1])
    comm_stats.reset()
    t0 = time.perf_counter()
    step = forward_before = 0
    forward_before = getattr(sched, "forward_ct", 0)
    while step < max_steps:
        for msg in arrivals.get(step, []):
            reqs.setdefault(msg.rid, {"ids": [], "finish_reason": None, "logits": []})
            _take(reqs, sched.add_request(msg))
        for rid in aborts.get(step, []):
            _take(reqs, sched.abort(rid))
        _take(reqs, sched.step())
        if on_step is not None:
            on_step(step, sched)
        step += 1
        done = step > last_arrival and not sched.has_work()
        if ps.tp_size > 1:
            flag = torch.tensor([1 if done else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ps.cpu_group)
            done = bool(flag.item())
        if done:
            break
    seconds = time.perf_counter() - t0
    if not record_logits:
        for r in reqs.values():
            r.pop("logits", None)
    return {"reqs": reqs, "steps": step, "forward_steps": getattr(sched, "forward_ct", 0) - forward_before,
            "seconds": seconds, "comm": comm_stats.snapshot()}


def _take(reqs: dict[str, dict[str, Any]], outs: list[Any]) -> None:
    for o in outs:
        r = reqs.setdefault(o.rid, {"ids": [], "finish_reason": None, "logits": []})
        r["ids"].extend(o.new_token_ids)
        if o.finished:
            r["finish_reason"] = o.finish_reason
