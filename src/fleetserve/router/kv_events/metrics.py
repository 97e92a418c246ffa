"""Prometheus families of ``kv_aware`` (prefix ``fleetserve_router_kv_``), built at scrape time.

* ``stream_state{worker,dp_rank,state}``: 1 for the stream's trust (exact / degraded / fallback).
* ``events_total``, ``batches_total``, ``malformed_total``, ``gaps_total``, ``replays_total``,
  ``replay_failures_total`` ``{worker,dp_rank}``: what each subscription received.
* ``index_blocks{worker,dp_rank}``: blocks the event index holds for the target.
* ``index_evicted_total``, ``index_orphans_total``: entries dropped by ``--kv-index-max-blocks``;
  stored blocks skipped for an unknown parent.
* ``decisions_total{branch}``: decisions by the chosen target's trust.
* ``load_tokens{target}``: in-flight tokens per target (``url`` or ``url#rank``).
* ``worker_active_prefill_tokens{worker,dp_rank}``: the queued prefill the policy counts per
  target: uncached prompt tokens of this router's requests there whose prefill has not ended
  (no first answer byte yet), ``policy.queued_tokens``. The name is NVIDIA Dynamo's KV router
  gauge (``dynamo_frontend_worker_active_prefill_tokens{worker_id,dp_rank,...}``) under our
  prefix; ``dp_rank`` is ``-`` for a whole worker (no ``--dp-aware``: the worker picks the rank,
  as in the route header). Every target chosen since its worker was added is listed, 0 when idle.
* ``engine_load_tokens{worker,dp_rank}``: the engines' fresh ``/v1/loads`` ``num_total_tokens``
  (for a vLLM worker, the running requests' KV from its ``/metrics`` gauges: :func:`.loads.vllm_figures`)
  less the prompts of this router's requests that ended since the snapshot, as the engine counts:
  the cached prefixes of this router's requests included.  Without ``--dp-aware`` the ended prompts are
  known per worker, not per rank: a worker of several ranks shows each rank's figure as reported.
* ``cost_load_tokens{worker,dp_rank}``: the load term the cost uses per target (``dp_rank`` ``-``
  for a whole worker): the larger of ``load_tokens`` and the engine's figure in the router's
  units (without those cached prefixes, each shared page once: :meth:`.policy.KvAwarePolicy.load_term`).
  Listed for every target chosen since its worker was added.
* ``inferred_prefills_total``: non-streamed requests taken out of the queued prefill because an
  engine snapshot's ``num_waiting_reqs`` showed them admitted (:meth:`.policy.KvAwarePolicy.engine_snapshot`).
* with ``--router-queue-threshold`` (:mod:`.router_queue`): ``router_queue_pending_requests``,
  requests waiting in the router now (Dynamo's ``dynamo_frontend_router_queue_pending_requests``
  under our prefix); ``router_queue_held_total``, requests that waited;
  ``router_queue_wait_seconds_total``, their time waiting (not the admission queue's
  ``fleetserve_router_queue_wait_seconds``); ``router_queue_expired_total``, requests routed because
  they had waited the longest allowed; ``router_queue_gone_total``, those whose client went away
  while waiting; ``router_queue_budget_tokens{worker}``, each budget read from a worker.
* ``tokenizer_mismatch{worker}``: 1 while the worker counts other prompt tokens than the
  router's tokenizer (routed ``fallback``, reason ``tokenizer``; :mod:`.tokenizer_check`).
* ``prompt_token_checks_total{worker,result}``: answers whose prompt count ``agreed`` /
  ``disagreed`` with the router's.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_P = "fleetserve_router_kv_"
_COUNTERS = (("events", "events"), ("batches", "batches"), ("malformed", "malformed"), ("gaps", "gaps"),
             ("replays", "replays"), ("replay_failures", "replay_failures"))


def families(policy):
    """Yield the families of a :class:`~.policy.KvAwarePolicy`."""
    state = GaugeMetricFamily(_P + "stream_state", "Trust of each KV-event stream",
                              labels=["worker", "dp_rank", "state"])
    counters = {name: CounterMetricFamily(_P + name, f"KV-event stream: {name.replace('_', ' ')}",
                                          labels=["worker", "dp_rank"]) for name, _ in _COUNTERS}
    blocks = GaugeMetricFamily(_P + "index_blocks", "Blocks in the event index per target",
                               labels=["worker", "dp_rank"])
    for url, subs in list(policy.subs.items()):
        for rank, sub in sorted(subs.items()):
            lab = [url, str(rank)]
            for s in ("exact", "degraded", "fallback"):
                state.add_metric(lab + [s], 1 if sub.state == s else 0)
            for name, attr in _COUNTERS:
                counters[name].add_metric(lab, getattr(sub, attr))
            blocks.add_metric(lab, policy.index.blocks_of((url, rank)))
    yield state
    yield from counters.values()
    yield blocks
    ix = policy.index
    yield CounterMetricFamily(_P + "index_evicted", "Index entries dropped by --kv-index-max-blocks", value=ix.evicted)
    yield CounterMetricFamily(_P + "index_orphans", "Stored blocks skipped: unknown parent", value=ix.orphans)
    dec = CounterMetricFamily(_P + "decisions", "kv_aware decisions by the target's trust", labels=["branch"])
    for branch, n in policy.decisions.items():
        dec.add_metric([branch], n)
    yield dec
    load = GaugeMetricFamily(_P + "load_tokens", "In-flight prompt + decode tokens per target", labels=["target"])
    for (url, rank), n in list(policy.load_tokens.items()):
        load.add_metric([url if rank is None else f"{url}#{rank}"], n)
    yield load
    yield queued_prefill_family(policy)
    yield CounterMetricFamily(_P + "inferred_prefills", "Non-streamed requests whose prefill end an engine's "
                              "num_waiting_reqs told", value=policy.inferred_prefills)
    rq = policy.router_queue
    if rq is not None:
        yield GaugeMetricFamily(_P + "router_queue_pending_requests", "Requests waiting in the router while every "
                                "target is busy (--router-queue-threshold)", value=rq.pending)
        yield CounterMetricFamily(_P + "router_queue_held", "Requests that waited in the router queue",
                                  value=rq.held_total)
        yield CounterMetricFamily(_P + "router_queue_wait_seconds", "Seconds requests waited in the router queue",
                                  value=rq.wait_seconds_total)
        yield CounterMetricFamily(_P + "router_queue_expired", "Requests routed because they had waited the "
                                  "longest the router queue allows (30 s)", value=rq.expired_total)
        budgets = GaugeMetricFamily(_P + "router_queue_budget_tokens", "Prefill tokens per step the router queue "
                                    "takes for the worker, per DP rank (8192 until its /get_server_info reports one)",
                                    labels=["worker"])
        for url in sorted(rq.budgets):
            budgets.add_metric([url], rq.budgets[url])
        yield budgets
        yield CounterMetricFamily(_P + "router_queue_gone", "Requests whose client went away while they waited in "
                                  "the router queue", value=rq.gone_total)
    tc = policy.tokenizer_check
    mism = GaugeMetricFamily(_P + "tokenizer_mismatch", "1 while the worker's prompt token counts disagree with "
                             "the router's tokenizer (routed by the approximate tree)", labels=["worker"])
    checks = CounterMetricFamily(_P + "prompt_token_checks", "Answers whose prompt token count agreed or "
                                 "disagreed with the router's", labels=["worker", "result"])
    for url in tc.urls():
        mism.add_metric([url], 1 if tc.mismatched(url) else 0)
        checks.add_metric([url, "agreed"], tc.agreed.get(url, 0))
        checks.add_metric([url, "disagreed"], tc.disagreed.get(url, 0))
    yield mism
    yield checks
    el = policy.engine_loads
    if el is not None:
        eng = GaugeMetricFamily(_P + "engine_load_tokens", "Fresh engine load per worker and DP rank: "
                                "/v1/loads num_total_tokens, or for a vLLM worker the running requests' KV "
                                "from its /metrics",
                                labels=["worker", "dp_rank"])
        for url in list(el.snapshots):
            ranks = sorted(el.snapshots[url][1])
            for rank in ranks:
                # one rank: less every ended request (without --dp-aware they are kept for the whole worker)
                n = el.tokens(url, None if len(ranks) == 1 else rank)
                if n is not None:
                    eng.add_metric([url, str(rank)], n)
        yield eng
    cost = GaugeMetricFamily(_P + "cost_load_tokens", "Load tokens the kv_aware cost uses per target: the "
                             "larger of the router's in-flight tokens and the engine's fresh figure without the "
                             "cached prefixes of the router's requests", labels=["worker", "dp_rank"])
    for url, rank in sorted({*policy.chosen_at, *policy.load_tokens}, key=_target_order):
        cost.add_metric([url, "-" if rank is None else str(rank)], policy.load_term(url, rank))
    yield cost


def _target_order(lk):
    return lk[0], -1 if lk[1] is None else lk[1]


def queued_prefill_family(policy) -> GaugeMetricFamily:
    """``worker_active_prefill_tokens{worker,dp_rank}`` of a :class:`~.policy.KvAwarePolicy` (see above)."""
    fam = GaugeMetricFamily(_P + "worker_active_prefill_tokens", "Uncached prompt tokens routed to the target "
                            "whose prefill has not ended (no first answer byte yet)", labels=["worker", "dp_rank"])
    queued = dict(policy.queued_tokens)
    for url, rank in sorted({*policy.chosen_at, *queued}, key=_target_order):
        fam.add_metric([url, "-" if rank is None else str(rank)], queued.get((url, rank), 0))
    return fam
