"""``--page-size``: the scheduler gives the same tokens at page sizes 1, 4 and 16.

The fake runner's next token depends on the KV it reads back through the
request's slots, so a slot shared by mistake, a wrong page continuation or a
prefix matched past a page boundary changes the tokens. The KV invariant (free
+ cached + in use == pool, whole pages in the tree, every token at offset
``position % page_size`` of its page) is checked after every step.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.core.forward_batch import ForwardMode
from fleetserve.engine.args import ServerArgs
from fleetserve.engine.io_struct import TokenizedGenerateReq
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.scheduler import Scheduler
from helpers.fake_runner import FakeRunner, make_scheduler
from helpers.scheduler_driver import prompt, run

PAGE_SIZES = (1, 4, 16)


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def workload():
    shared = prompt(1, 37)
    reqs = [TokenizedGenerateReq(f"s{i}", shared + prompt(100 + i, n), greedy(9 + i))
            for i, n in enumerate([1, 5, 16, 23])]
    reqs += [TokenizedGenerateReq(f"m{i}", prompt(200 + i, n), greedy(20)) for i, n in enumerate([3, 17, 32, 1])]
    return reqs


@pytest.fixture(scope="module")
def reference():
    """Every request alone at page size 1 on a roomy pool."""
    return {r.rid: run(make_scheduler(pool_size=1024, chunked_prefill_size=-1), [r])[r.rid][0] for r in workload()}


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("variant", ["batch", "radix off", "chunked 32", "chunked 16", "tight pool"])
def test_tokens_identical_across_page_sizes(ps, variant, reference):
    kw = {"page_size": ps}
    if variant == "radix off":
        kw["disable_radix_cache"] = True
    elif variant.startswith("chunked"):
        kw["chunked_prefill_size"] = int(variant.split()[1])
    elif variant == "tight pool":
        kw.update(pool_size=128, schedule_conservativeness=0.05)
    s = make_scheduler(**kw)
    reqs = workload()
    # warm the cache with the shared prefix, then the batch
    first = run(s, reqs[:1])
    rest = run(s, reqs[1:])
    got = first | rest
    for r in reqs:
        assert got[r.rid][0] == reference[r.rid], (ps, variant, r.rid)
    if variant == "tight pool":
        assert s.num_retracted > 0
    s.check_kv()
    assert s.cache.protected_size() == 0
    assert s.allocator.available_size() + s.cache.evictable_size() == s.pool_size
    if variant == "batch":
        # the shared 37-token prefix is reused in whole pages only
        assert [rest[f"s{i}"][1].cached_tokens for i in (1, 2, 3)] == [37 - 37 % ps] * 3


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_cached_tokens_round_down_to_pages(ps):
    s = make_scheduler(page_size=ps)
    run(s, [TokenizedGenerateReq("a", list(range(1, 11)) + [40, 41], greedy(1))])
    # the first 10 tokens are shared: cached in whole pages (10 -> 10 / 8 / 0)
    out = run(s, [TokenizedGenerateReq("b", list(range(1, 11)) + [30, 31], greedy(1))])
    assert out["b"][1].cached_tokens == {1: 10, 4: 8, 16: 0}[ps]
    # the tree holds whole pages only: a's 12 prompt tokens + 0 computed outputs
    assert s.cache.total_size() % ps == 0


@pytest.mark.parametrize("ps", (4, 16))
def test_partial_pages_stay_private_and_are_freed(ps):
    s = make_scheduler(page_size=ps, pool_size=256)
    s.add_request(TokenizedGenerateReq("a", prompt(5, ps + 3), greedy(ps)))
    s.step()  # prefill: one whole page in the tree (locked), ps+3 tokens computed
    r = s.running[0]
    assert r.num_kv == ps + 3 and r.num_tree == ps
    assert s.cache.total_size() == ps
    # the request owns its second page (3 slots used, the rest reserved)
    assert s.allocator.available_size() == 256 - 2 * ps
    own = r.own_slots()
    assert int(own[0]) % ps == 0 and own.tolist() == list(range(int(own[0]), int(own[0]) + 3))
    s.step()  # one decode token continues in that page: no new page
    assert s.allocator.available_size() == 256 - 2 * ps and int(r.kv_slots[r.num_kv - 1]) == int(own[0]) + 3
    out = s.abort("a")
    assert out[0].finish_reason["type"] == "abort"
    s.check_kv()
    # every whole page computed (ps + 4 tokens) went to the tree; a partial last page was freed
    whole = (ps + 4) - (ps + 4) % ps
    assert s.cache.total_size() == whole and s.allocator.available_size() == 256 - whole


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_flush_cache_frees_every_page(ps):
    s = make_scheduler(page_size=ps, pool_size=256)
    run(s, workload()[:3])
    assert s.cache.total_size() > 0
    assert s.flush_cache()
    assert s.allocator.available_size() == 256 and s.cache.total_size() == 0
    s.check_kv()


def test_scheduler_refuses_a_runner_with_another_page_size():
    with pytest.raises(ValueError, match="--page-size 4"):
        Scheduler(ServerArgs(page_size=4, random_seed=0), FakeRunner(pool_size=64))


def test_decode_takes_a_new_page_only_at_page_ends():
    s = make_scheduler(page_size=4, pool_size=64)
    s.add_request(TokenizedGenerateReq("a", prompt(9, 4), greedy(9)))
    free = []
    while s.has_work():
        s.step()
        free.append(s.allocator.available_size())
    modes = [m for m, _, _ in s.runner.forwards]
    assert modes[0] == ForwardMode.EXTEND
    # prompt 4 = 1 page; decode tokens 5..12 take page 2 at token 5 and page 3 at token 9;
    # at the end the 12 computed tokens (3 whole pages) stay cached in the tree
    assert free == [60, 56, 56, 56, 56, 52, 52, 52, 52]
    assert s.cache.total_size() == 12 and s.cache.evictable_size() == 12


# ----------------------------------------------------------- random workloads
ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 40), st.integers(1, 30)),
        st.tuples(st.just("step"), st.integers(1, 6), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.just(0), st.just(0)),
        st.tuples(st.just("flush"), st.just(0), st.just(0), st.just(0)),
    ),
    min_size=1, max_size=30,
)
PREFIXES = [prompt(300 + i, n) for i, n in enumerate([0, 9, 20, 33])]
_ALONE: dict = {}


def alone(ids, n):
    key = (tuple(ids), n)
    if key not in _ALONE:
        s = make_scheduler(pool_size=1024, chunked_prefill_size=-1)
        _ALONE[key] = run(s, [TokenizedGenerateReq("x", ids, greedy(n))])["x"][0]
    return _ALONE[key]


@pytest.mark.parametrize("ps", PAGE_SIZES)
@settings(max_examples=60, deadline=None)
@given(actions=ACTIONS, chunk=st.sampled_from([-1, 16, 32]), disable=st.booleans())
def test_random_workload_keeps_invariant_and_tokens(ps, actions, chunk, disable):
    """Shared prefixes, aborts, flushes, retraction and eviction under a small pool."""
    s = make_scheduler(page_size=ps, pool_size=160, chunked_prefill_size=chunk, disable_radix_cache=disable,
                       schedule_conservativeness=0.05)
    reqs, toks, done = {}, {}, {}

    def collect(outs):
        for o in outs:
            toks.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished:
                done[o.rid] = o

    for i, (kind, a, b, c) in enumerate(actions):
        if kind == "add":
            ids = PREFIXES[a] + prompt(400 + i, b)
            reqs[f"q{i}"] = (ids, c)
            collect(s.add_request(TokenizedGenerateReq(f"q{i}", ids, greedy(c))))
        elif kind == "step":
            for _ in range(a):
                collect(s.step())
        elif kind == "abort":
            collect(s.abort(f"q{a}"))
            s.check_kv()
        else:
            if s.flush_cache():
                assert s.cache.total_size() == 0
    steps = 0
    while s.has_work():
        collect(s.step())
        steps += 1
        assert steps < 5000
    s.check_kv()
    assert s.cache.protected_size() == 0
    assert s.allocator.available_size() + s.cache.evictable_size() == s.pool_size
    for rid, o in done.items():
        if o.finish_reason["type"] == "length":
            ids, n = reqs[rid]
            assert toks[rid] == alone(ids, n), (ps, rid)
