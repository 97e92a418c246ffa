"""The published KV-event stream replays into exactly the radix cache, after every scheduler operation.

Random workloads (shared prefixes, aborts, retractions, flushes, eviction
under a small pool, chunked prefill) run on the real
:class:`~fleetserve.engine.scheduler.Scheduler` over the fake runner, with the
real :class:`~fleetserve.engine.kv_events.publisher.KVEventPublisher` as its
sink. A SUB socket over TCP reads every batch; a mirror index replays them
(add on ``BlockStored``, remove on ``BlockRemoved``, clear on
``AllBlocksCleared``). After each step, abort and flush the mirror must hold
exactly the tree's pages: same page hashes, same parent of each page, same
tokens. Each page hash must also be SGLang's chained page hash recomputed
from the token ids from the root (:func:`fleetserve.engine.page_hash.page_hashes`),
so a router that only hashes prompts finds them. Page sizes 1, 4, 16; both
encodings. A seeded loop (not hypothesis): one publisher per case, the same
seeds every run, and the loop asserts that every kind of event happened.

The simulated engine of ``fleetserve sim-worker`` publishes from the same
radix cache; its stream is checked the same way each time its asyncio loop
has settled (aborts of running requests included).
"""

import random

import pytest

from fleetserve.engine.args import ServerArgs
from fleetserve.engine.io_struct import TokenizedGenerateReq
from fleetserve.engine.kv_events.config import KVEventsConfig
from fleetserve.engine.kv_events.publisher import KVEventPublisher
from fleetserve.engine.page_hash import digest_to_int64, page_digests
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.scheduler import Scheduler
from helpers.fake_runner import FakeRunner
from helpers.kv_events_sub import Subscriber, batch_of, free_port_block, seq_of, wait_connected

PAGE_SIZES = (1, 4, 16)
ENCODINGS = ("map", "array")
WORKLOADS = 6  # per case
OPS = 40  # per workload


def _prompt(rng, n, vocab=50):
    return [rng.randrange(1, vocab) for _ in range(n)]


def _decode(ev, encoding):
    """``(type, block_hashes, parent, token_ids, block_size)`` of one event in either encoding."""
    if encoding == "map":
        t = ev["type"]
        if t == "BlockStored":
            assert ev["medium"] == "GPU" and ev["extra_keys"] == [None] * len(ev["block_hashes"])
            return t, ev["block_hashes"], ev["parent_block_hash"], ev["token_ids"], ev["block_size"]
        if t == "BlockRemoved":
            return t, ev["block_hashes"], None, None, None
        assert ev == {"type": "AllBlocksCleared"}
        return t, None, None, None, None
    assert isinstance(ev, list), ev
    t = ev[0]
    if t == "BlockStored":
        assert len(ev) == 8 and ev[6] == "GPU"
        return t, ev[1], ev[2], ev[3], ev[4]
    if t == "BlockRemoved":
        assert len(ev) == 3 and ev[2] == "GPU"
        return t, ev[1], None, None, None
    assert ev == ["AllBlocksCleared"]
    return t, None, None, None, None


class Mirror:
    """A router-side index built only from the events: page hash -> (parent hash, page tokens, page digest)."""

    def __init__(self, page_size, encoding):
        self.ps, self.encoding = page_size, encoding
        self.pages: dict[int, tuple[int | None, tuple[int, ...], bytes]] = {}
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}

    def apply(self, ev):
        t, hashes, parent, tokens, bs = _decode(ev, self.encoding)
        self.counts[t] += 1
        if t == "AllBlocksCleared":
            self.pages.clear()
            return
        if t == "BlockRemoved":
            for h in hashes:
                assert h in self.pages, f"BlockRemoved of a page never stored (or already removed): {h}"
                del self.pages[h]
            return
        ps = self.ps
        assert bs == ps and len(tokens) == len(hashes) * ps, (bs, len(tokens), len(hashes))
        if parent is None:
            digest = None
        else:
            assert parent in self.pages, f"BlockStored whose parent {parent} is not held"
            digest = self.pages[parent][2]
        for i, h in enumerate(hashes):
            page = tuple(tokens[i * ps: (i + 1) * ps])
            assert h not in self.pages, f"page {h} stored twice"
            # SGLang's chained page hash, recomputed here from the token ids and the parent's digest
            (digest,) = page_digests(list(page), ps, digest)
            assert h == digest_to_int64(digest), "block hash is not the chained page hash of its tokens"
            self.pages[h] = (parent, page, digest)
            parent = h


def _tree_pages(cache):
    """The radix tree's pages as ``{hash: (parent hash, page tokens)}``."""
    out = {}
    ps = cache.page_size
    stack = [(cache.root, None)]
    while stack:
        node, parent = stack.pop()
        for child in node.children.values():
            assert child.hashes is not None and len(child.hashes) == len(child.key) // ps
            p = parent
            for i, d in enumerate(child.hashes):
                h = digest_to_int64(d)
                assert h not in out, "two tree pages with one hash"
                out[h] = (p, tuple(child.key[i * ps: (i + 1) * ps]))
                p = h
            stack.append((child, p))
    return out


class Harness:
    def __init__(self, pub, sub, mirror):
        self.pub, self.sub, self.mirror = pub, sub, mirror
        self.expect_seq = pub.next_seq

    def sync(self):
        """Read every batch published so far (no gaps allowed) into the mirror."""
        target = self.pub.next_seq
        while self.expect_seq < target:
            m = self.sub.recv(10.0)
            assert m is not None, f"batch {self.expect_seq} never arrived (next_seq {target})"
            assert seq_of(m) == self.expect_seq, f"seq {seq_of(m)}, expected {self.expect_seq}"
            ts, events, dp_rank = batch_of(m)
            assert dp_rank == 0 and isinstance(ts, float) and events
            for ev in events:
                self.mirror.apply(ev)
            self.expect_seq += 1
        assert self.pub.dropped == 0

    def check(self, sched):
        self.sync()
        tree = _tree_pages(sched.cache)
        mirror = {h: (p, page) for h, (p, page, _) in self.mirror.pages.items()}
        assert mirror == tree, (f"mirror {len(mirror)} pages, tree {len(tree)}; "
                                f"only in mirror {len(mirror.keys() - tree.keys())}, "
                                f"only in tree {len(tree.keys() - mirror.keys())}")


@pytest.fixture(params=ENCODINGS)
def publisher(request):
    port = free_port_block(1)
    cfg = KVEventsConfig(publisher="zmq", endpoint=f"tcp://*:{port}", encoding=request.param, topic="kv")
    pub = KVEventPublisher(cfg)
    sub = Subscriber(f"tcp://127.0.0.1:{port}", b"kv")
    try:
        wait_connected(pub, sub)
        yield pub, sub, request.param
    finally:
        sub.close()
        pub.shutdown()


def _run_workload(rng, ps, h, stats):
    chunk = rng.choice([-1, 16, 32])
    runner = FakeRunner(pool_size=160, page_size=ps)
    args = ServerArgs(random_seed=0, page_size=ps, chunked_prefill_size=chunk, schedule_conservativeness=0.05)
    sched = Scheduler(args, runner, check_invariants=True, event_sink=h.pub)
    prefixes = [_prompt(rng, n) for n in (0, 9, 20, 33)]
    live = []
    h.check(sched)
    for i in range(OPS):
        op = rng.choices(["add", "step", "abort", "flush"], weights=[4, 6, 2, 1])[0]
        if op == "add":
            ids = prefixes[rng.randrange(4)] + _prompt(rng, rng.randint(1, 40))
            rid = f"q{i}"
            sched.add_request(TokenizedGenerateReq(
                rid, ids, SamplingParams(max_new_tokens=rng.randint(1, 30), temperature=0.0, ignore_eos=True)))
            live.append(rid)
        elif op == "step":
            for _ in range(rng.randint(1, 6)):
                sched.step()
                h.check(sched)
        elif op == "abort" and live:
            if sched.abort(live.pop(rng.randrange(len(live)))):
                stats["aborts"] += 1
        elif op == "flush":
            if sched.flush_cache():
                stats["flushes"] += 1
        h.check(sched)  # events of an abort or flush must not wait for the next step
    steps = 0
    while sched.has_work():
        sched.step()
        h.check(sched)
        steps += 1
        assert steps < 5000
    stats["retractions"] += sched.num_retracted
    assert sched.flush_cache()
    h.check(sched)
    assert not h.mirror.pages


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_event_stream_mirrors_the_radix_cache_after_every_step(ps, publisher):
    pub, sub, encoding = publisher
    h = Harness(pub, sub, Mirror(ps, encoding))
    stats = {"aborts": 0, "flushes": 0, "retractions": 0}
    for seed in range(WORKLOADS):
        _run_workload(random.Random(1000 * ps + seed), ps, h, stats)
    # the workloads exercised every path (same seeds every run)
    c = h.mirror.counts
    assert c["BlockStored"] > 0 and c["BlockRemoved"] > 0 and c["AllBlocksCleared"] >= WORKLOADS
    assert stats["aborts"] > 0 and stats["flushes"] > 0 and stats["retractions"] > 0, stats
    assert pub.dropped == 0


# ------------------------------------------------------------------ sim-worker
async def _sim_workload(rng, ps, h, stats):
    import asyncio

    from fleetserve.bench.sim_engine import SimEngine, SimRequest
    from fleetserve.bench.timing_model import TimingModel

    model = TimingModel(prefill_per_token_s=0, prefill_overhead_s=0, decode_base_s=0.001, decode_per_req_s=0,
                        decode_per_ctx_token_s=0, max_running_requests=4, max_total_tokens=256, page_size=ps)
    eng = SimEngine(model, "sim", event_sink=h.pub)
    eng.start()
    prefixes = [_prompt(rng, n) for n in (0, 9, 20, 33)]
    try:
        for i in range(12):
            reqs = []
            for k in range(rng.randint(1, 5)):
                ids = prefixes[rng.randrange(4)] + _prompt(rng, rng.randint(1, 40))
                n = rng.randint(1, 30)
                r = SimRequest(f"s{i}-{k}", ids, n, list(range(1, n + 1)), ["x"] * n)
                eng.submit(r)
                reqs.append(r)
            await asyncio.sleep(rng.choice([0, 0.002, 0.01]))
            for r in reqs:
                if rng.random() < 0.3:
                    eng.abort(r)
                    stats["aborts"] += 1
            for _ in range(5000):  # settle: the loop waits for work
                if eng.idle:
                    break
                await asyncio.sleep(0.002)
            assert eng.idle and not eng.waiting and not eng.running, "the simulated engine did not settle"
            await asyncio.to_thread(h.check, eng)
            if rng.random() < 0.2 and eng.flush_cache():
                stats["flushes"] += 1
                await asyncio.to_thread(h.check, eng)
        assert eng.flush_cache()
        await asyncio.to_thread(h.check, eng)
        assert not h.mirror.pages
    finally:  # not eng.stop(): that would shut the shared publisher down
        eng._task.cancel()
        try:
            await eng._task
        except asyncio.CancelledError:
            pass


@pytest.mark.parametrize("ps", PAGE_SIZES)
async def test_sim_worker_event_stream_mirrors_its_radix_cache(ps, publisher):
    """The simulated engine publishes from the same radix cache: after each wave settles (aborts included),
    the replayed stream holds exactly its tree's pages."""
    pub, sub, encoding = publisher
    h = Harness(pub, sub, Mirror(ps, encoding))
    stats = {"aborts": 0, "flushes": 0}
    for seed in range(3):
        await _sim_workload(random.Random(7000 + 100 * ps + seed), ps, h, stats)
    c = h.mirror.counts
    assert c["BlockStored"] > 0 and c["BlockRemoved"] > 0, c  # 256-token pool: eviction happens
    assert stats["aborts"] > 0 and stats["flushes"] > 0, stats
