"""The scheduler on tiny random Llama and DeepSeek-V2/V3 (MLA + MoE) models:
radix cache on/off, mixed batch vs alone, chunked prefill and a tight pool
(retraction) all give the same greedy tokens; the KV invariant holds every step."""

import pytest
import torch

from fleetserve.engine.args import ServerArgs
from fleetserve.engine.io_struct import TokenizedGenerateReq
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.scheduler import Scheduler
from helpers.scheduler_driver import run_to_completion as run


@pytest.mark.parametrize("kind", ["tiny_llama_dir", "tiny_deepseek_v2_dir", "tiny_deepseek_v3_dir"])
def test_scheduling_variants_give_same_tokens(kind, request):
    from fleetserve.engine.model_runner import ModelRunner

    path = request.getfixturevalue(kind)
    runner = ModelRunner(path, dtype="float32", max_total_tokens=512, show_progress=False)

    def sched(pool=None, **kw):
        from fleetserve.core.kv_pool import TokenSlotAllocator

        runner.allocator = TokenSlotAllocator(pool or 512)
        return Scheduler(ServerArgs(random_seed=0, **kw), runner, check_invariants=True)

    g = torch.Generator().manual_seed(0)
    vocab = min(runner.vocab_size, 250)
    shared = torch.randint(3, vocab, (24,), generator=g).tolist()
    prompts = [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 9, 30)] + [[5, 6, 7]]
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    reqs = [TokenizedGenerateReq(f"r{i}", p, sp) for i, p in enumerate(prompts)]

    alone = {r.rid: run(sched(disable_radix_cache=True), [r])[r.rid][0] for r in reqs}
    s = sched()
    run(s, [reqs[0]])
    cached = run(s, reqs[1:])
    assert [cached[r.rid][1].cached_tokens for r in reqs[1:3]] == [len(shared)] * 2
    variants = {
        "batch, radix on": cached | {"r0": (alone["r0"], None)},
        "batch, radix off": run(sched(disable_radix_cache=True), reqs),
        "chunked 5": run(sched(chunked_prefill_size=5), reqs),
    }
    tight = sched(pool=80, schedule_conservativeness=0.05)  # the longest request alone needs 64
    variants["pool 80"] = run(tight, reqs)
    assert tight.num_retracted > 0
    for name, res in variants.items():
        for r in reqs:
            assert res[r.rid][0] == alone[r.rid], (kind, name, r.rid)


@pytest.mark.parametrize("kind", ["tiny_llama_dir", "tiny_deepseek_v2_dir"])
def test_page_sizes_give_same_tokens(kind, request):
    """--page-size 1 / 4 / 16 on a real model: same greedy tokens, with shared prefixes,
    chunked prefill and a tight pool (retraction); the KV invariant holds every step."""
    from fleetserve.core.kv_pool import TokenSlotAllocator
    from fleetserve.engine.model_runner import ModelRunner

    path = request.getfixturevalue(kind)
    runner = ModelRunner(path, dtype="float32", max_total_tokens=512, show_progress=False, page_size=16)
    assert runner.allocator.page_size == 16 and runner.max_total_tokens == 512
    assert runner.allocator.max_slot == 527  # the KV rows hold the last page

    def sched(ps, pool=512, **kw):
        runner.allocator = TokenSlotAllocator(pool, ps)
        return Scheduler(ServerArgs(random_seed=0, page_size=ps, **kw), runner, check_invariants=True)

    g = torch.Generator().manual_seed(1)
    vocab = min(runner.vocab_size, 250)
    shared = torch.randint(3, vocab, (21,), generator=g).tolist()
    prompts = [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (2, 11, 27)] + [[5, 6, 7]]
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    reqs = [TokenizedGenerateReq(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    want = {r.rid: run(sched(1, disable_radix_cache=True), [r])[r.rid][0] for r in reqs}
    for ps in (1, 4, 16):
        s = sched(ps)
        first = run(s, [reqs[0]])
        rest = run(s, reqs[1:])
        assert [rest[r.rid][1].cached_tokens for r in reqs[1:3]] == [21 - 21 % ps] * 2
        got = {"warm cache": first | rest,
               "chunked 16": run(sched(ps, chunked_prefill_size=16), reqs)}
        tight = sched(ps, pool=96, schedule_conservativeness=0.05)
        got["pool 96"] = run(tight, reqs)
        assert tight.num_retracted > 0
        for name, res in got.items():
            for r in reqs:
                assert res[r.rid][0] == want[r.rid], (kind, ps, name, r.rid)
