"""The sim-worker's cache hits equal our engine's scheduler on the same requests.

The reference is the engine's real :class:`fleetserve.engine.scheduler.Scheduler`
(over the same RadixCache) driven by a stub model runner whose greedy output is
always token 0, a token no prompt contains; the sim engine's synthetic outputs
never occur in prompts either, so both trees hold the same prompt tokens and
output branches of the same lengths. The pools are small, so LRU eviction runs.
"""

import asyncio

import pytest
import torch

from fleetserve.bench.sim_engine import SimEngine, SimRequest
from fleetserve.bench.sim_tokenizer import WordTokenizer
from fleetserve.bench.timing_model import TimingModel
from fleetserve.bench.workloads import multi_turn, shared_prefix
from fleetserve.engine.args import ServerArgs
from fleetserve.engine.io_struct import TokenizedGenerateReq
from fleetserve.core.kv_pool import TokenSlotAllocator
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.scheduler import Scheduler

torch.set_num_threads(1)
VOCAB = 1000


class ConstRunner:
    """Stub model: logits favour token 0 for every sequence."""

    def __init__(self, pool: int, page_size: int = 1):
        self.allocator = TokenSlotAllocator(pool, page_size)
        self.vocab_size = VOCAB
        self.max_context_len = 100_000
        self.eos_token_ids = []
        self.device = "cpu"

    def forward(self, fb):
        n = fb.batch_size
        out = torch.zeros(n, VOCAB)
        out[:, 0] = 1.0
        return out


def token_requests(kind: str) -> list[tuple[list[int], int]]:
    tok = WordTokenizer()
    if kind == "shared_prefix":
        reqs = shared_prefix(num_groups=4, prompts_per_group=4, system_prompt_len=60, question_len=10,
                             output_len=8, seed=3)
    else:
        reqs = multi_turn(num_conversations=4, num_turns=4, question_len=12, output_len=9, seed=4)
    # map into [1, VOCAB) so the engine's vocabulary check passes; 0 is the engine's output token
    return [([1 + t % (VOCAB - 1) for t in tok.encode_chat(r.messages)], r.output_len) for r in reqs]


def engine_hits(reqs, pool: int, concurrent: bool, page_size: int = 1) -> list[int]:
    sched = Scheduler(ServerArgs(random_seed=0, page_size=page_size), ConstRunner(pool, page_size),
                      check_invariants=True)
    hits: dict[str, int] = {}

    def submit(i, ids, out):
        sp = SamplingParams(max_new_tokens=out, temperature=0.0, ignore_eos=True)
        assert sched.add_request(TokenizedGenerateReq(rid=str(i), input_ids=ids, sampling=sp)) == []

    def drain(expect: int):
        for _ in range(10_000):
            for o in sched.step():
                if o.finished:
                    assert o.finish_reason["type"] == "length", o.finish_reason
                    hits[o.rid] = o.cached_tokens
            if len(hits) == expect:
                return
        raise AssertionError("engine did not finish")

    if concurrent:
        for i, (ids, out) in enumerate(reqs):
            submit(i, ids, out)
        drain(len(reqs))
    else:
        for i, (ids, out) in enumerate(reqs):
            submit(i, ids, out)
            drain(i + 1)
    return [hits[str(i)] for i in range(len(reqs))]


async def sim_hits(reqs, pool: int, concurrent: bool, page_size: int = 1) -> list[int]:
    model = TimingModel(max_total_tokens=pool, time_scale=1e-6, max_running_requests=1024, page_size=page_size)
    eng = SimEngine(model, "t")
    eng.start()
    tok = WordTokenizer()

    def make(i, ids, out):
        out_ids, pieces = tok.synth_output(ids, out)
        return SimRequest(rid=str(i), input_ids=ids, max_new_tokens=out, output_ids=out_ids, output_pieces=pieces)

    async def wait(r):
        while True:
            _, _, done = await asyncio.wait_for(r.events.get(), 10)
            if done:
                return r.cached_tokens

    try:
        if concurrent:
            rs = [make(i, ids, out) for i, (ids, out) in enumerate(reqs)]
            for r in rs:
                eng.submit(r)
            res = [await wait(r) for r in rs]
        else:
            res = []
            for i, (ids, out) in enumerate(reqs):
                r = make(i, ids, out)
                eng.submit(r)
                res.append(await wait(r))
        assert eng.allocator.available_size() + eng.cache.total_size() == pool  # no KV leaked
        assert eng.cache.protected_size() == 0
        return res
    finally:
        await eng.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("kind", ["shared_prefix", "multi_turn"])
@pytest.mark.parametrize("pool", [100_000, 400])
async def test_sequential_hits_match_engine(kind, pool, page_size):
    reqs = token_requests(kind)
    want = engine_hits(reqs, pool, concurrent=False, page_size=page_size)
    got = await sim_hits(reqs, pool, concurrent=False, page_size=page_size)
    assert got == want
    assert sum(want) > 0  # the workload does share prefixes
    assert all(h % page_size == 0 for h in want)  # whole pages only
    if pool == 400 and kind == "shared_prefix":
        assert want != engine_hits(reqs, 100_000, concurrent=False, page_size=page_size)  # eviction changed something


@pytest.mark.timeout(60)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("kind", ["shared_prefix", "multi_turn"])
async def test_concurrent_hits_match_engine(kind, page_size):
    reqs = token_requests(kind)
    want = engine_hits(reqs, 100_000, concurrent=True, page_size=page_size)
    got = await sim_hits(reqs, 100_000, concurrent=True, page_size=page_size)
    assert got == want
    assert sum(want) > 0
