"""``fleetserve_router_kv_worker_active_prefill_tokens``: the queued prefill kv_aware counts per target,
in /metrics (the families the router's collector yields under kv_aware)."""

from prometheus_client import CollectorRegistry, generate_latest

from fleetserve.router.kv_events.metrics import families
from fleetserve.router.kv_events.policy import KvAwarePolicy, RouteKey
from fleetserve.router.workers import Worker

A, B = "http://a:1", "http://b:1"
NAME = "fleetserve_router_kv_worker_active_prefill_tokens"
TEMPLATE = list(range(500, 524))


def turn0(c: int) -> list[int]:
    return TEMPLATE + [10_000 + 100 * c + j for j in range(38)]  # 62 tokens, the first 24 shared


def scrape(pol, name: str = NAME) -> dict[tuple[str, str], float]:
    """``{(worker, dp_rank): value}`` of the family ``name`` in the /metrics text of ``pol``'s families."""
    class Collector:
        def collect(self):
            return families(pol)

    reg = CollectorRegistry()
    reg.register(Collector())
    out = {}
    for line in generate_latest(reg).decode().splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            lab = dict(kv.split("=", 1) for kv in labels.split(","))
            out[(lab["worker"].strip('"'), lab["dp_rank"].strip('"'))] = float(value)
    return out


def test_queued_prefill_per_worker_and_back_to_zero():
    pol = KvAwarePolicy(speculative_ttl_s=0)
    assert scrape(pol) == {}  # nothing chosen yet
    wa, wb = Worker(A), Worker(B)
    keys = [RouteKey("", turn0(c), 16) for c in range(4)]
    assert [pol.select([wa, wb], k).url for k in keys] == [A, B, A, B]
    # each worker: one whole prompt (62) and one sharing the 24 template tokens routed after it (38)
    assert scrape(pol) == {(A, "-"): 100.0, (B, "-"): 100.0}
    pol.prefilled(keys[0])  # the first answer bytes of A's first request arrived
    assert scrape(pol) == {(A, "-"): 38.0, (B, "-"): 100.0}
    for k in keys:
        pol.prefilled(k)
        pol.release(k)
    assert scrape(pol) == {(A, "-"): 0.0, (B, "-"): 0.0}  # still listed, at zero


def test_dp_aware_targets_are_labelled_with_their_rank():
    pol = KvAwarePolicy(speculative_ttl_s=0, dp_aware=True)
    key = RouteKey("", turn0(0), 16)
    pol.select([Worker(A)], key)
    assert scrape(pol) == {(A, "0"): 62.0}
    pol.release(key)  # a non-streamed answer ended: its prefill is over too
    assert scrape(pol) == {(A, "0"): 0.0}
