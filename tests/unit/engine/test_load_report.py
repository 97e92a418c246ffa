"""What a scheduler reports about its load (/v1/loads, /get_load), on the fake runner.

Values are checked against hand-counted queues: the uncached tokens of waiting
requests come from a real radix-tree match, and every count is back at zero
once requests finish or are aborted.
"""

import time

import torch

from fleetserve.engine.io_struct import TokenizedGenerateReq
from fleetserve.engine.load_report import ThroughputMeter
from fleetserve.engine.sampling_params import SamplingParams


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def prompt(seed, n, vocab=50):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def drain(s, max_steps=2000):
    for _ in range(max_steps):
        if not s.has_work():
            return
        s.step()
    raise AssertionError("scheduler did not finish")


def test_waiting_uncached_tokens_follow_the_radix_tree(make_sched):
    s = make_sched(max_running_requests=1)
    shared = prompt(1, 30)
    s.add_request(TokenizedGenerateReq("warm", shared + [5, 6], greedy(2)))
    drain(s)                                            # the tree now holds shared + [5, 6] (+ output)
    s.add_request(TokenizedGenerateReq("run", prompt(2, 10), greedy(50)))
    s.step()                                            # "run" admitted; the one running slot is taken
    s.add_request(TokenizedGenerateReq("hit", shared + [7, 8, 9], greedy(3)))   # 30 cached, 3 not
    s.add_request(TokenizedGenerateReq("cold", prompt(3, 12), greedy(3)))       # nothing cached
    st = s.get_stats()
    assert (st.num_running_reqs, st.num_waiting_reqs) == (1, 2)
    assert st.num_waiting_uncached_tokens == 3 + 12
    assert st.num_pending_tokens == 33 + 12
    assert st.max_running_requests == 1
    assert st.kv_used_tokens == 10                      # "run"'s prompt (its first token has no KV yet)
    drain(s)
    st = s.get_stats()
    assert (st.num_running_reqs, st.num_waiting_reqs, st.num_waiting_uncached_tokens,
            st.num_pending_tokens, st.kv_used_tokens) == (0, 0, 0, 0, 0)


def test_whole_prompt_cached_still_leaves_its_last_token_to_compute(make_sched):
    s = make_sched(max_running_requests=1)
    p = prompt(4, 20)
    s.add_request(TokenizedGenerateReq("a", p, greedy(1)))
    drain(s)
    s.add_request(TokenizedGenerateReq("busy", prompt(5, 8), greedy(40)))
    s.step()
    s.add_request(TokenizedGenerateReq("same", p, greedy(1)))
    assert s.get_stats().num_waiting_uncached_tokens == 1   # the last prompt token's logits pick the output


def test_chunked_request_counts_what_it_has_left(make_sched):
    s = make_sched(chunked_prefill_size=16, max_prefill_tokens=16)
    s.add_request(TokenizedGenerateReq("long", prompt(6, 50), greedy(2)))
    s.step()                                            # first chunk of 16
    st = s.get_stats()
    assert st.num_running_reqs == 1 and st.num_waiting_reqs == 0
    assert st.num_waiting_uncached_tokens == 34 and st.num_pending_tokens == 34
    s.abort("long")
    st = s.get_stats()
    assert (st.num_running_reqs, st.num_waiting_uncached_tokens, st.kv_used_tokens) == (0, 0, 0)


def test_aborted_waiting_and_running_requests_leave_no_load(make_sched):
    s = make_sched(max_running_requests=1)
    s.add_request(TokenizedGenerateReq("a", prompt(7, 9), greedy(100)))
    s.step()
    s.add_request(TokenizedGenerateReq("b", prompt(8, 9), greedy(100)))
    st = s.get_stats()
    assert (st.num_running_reqs, st.num_waiting_reqs, st.num_waiting_uncached_tokens) == (1, 1, 9)
    s.abort("b")
    s.abort("a")
    st = s.get_stats()
    assert (st.num_running_reqs, st.num_waiting_reqs, st.num_waiting_uncached_tokens,
            st.num_pending_tokens, st.kv_used_tokens) == (0, 0, 0, 0, 0)


def test_throughput_meter_is_tokens_per_second_over_the_window():
    now = [100.0]
    m = ThroughputMeter(window_s=5.0, clock=lambda: now[0])
    assert m.rate() == 0.0
    now[0] = 101.0
    m.record(30)                                        # 30 tokens in the first second
    assert m.rate() == 30.0                             # over the 1 s since start
    now[0] = 104.0
    m.record(60)
    assert m.rate() == 15.0                             # 60 tokens over 4 s
    now[0] = 107.0
    m.record(90)
    assert m.rate() == 12.0                             # window 102..107: 90 - 30 tokens over 5 s
    now[0] = 120.0
    assert m.rate() == 0.0                              # idle for longer than the window


def test_scheduler_reports_generation_throughput(make_sched):
    s = make_sched()
    s.add_request(TokenizedGenerateReq("a", prompt(9, 5), greedy(20)))
    drain(s)
    assert s.generation_tokens_total == 20
    before = time.time()
    st = s.get_stats()
    assert st.gen_throughput > 0
    assert st.prefill_throughput > 0  # 9 uncached prompt tokens in the window
    assert before <= st.timestamp <= time.time()  # taken now, in seconds since the epoch (SGLang's timestamp)


def test_page_size_16_a_finished_request_leaves_its_pages_cached_but_counts_no_load(make_sched):
    """``/v1/loads``' token figures count what requests hold or wait for, never the radix cache: after a
    request at ``--page-size 16`` ends, its full pages stay cached (evictable) and the load is 0."""
    s = make_sched(page_size=16, max_running_requests=1)
    p = prompt(9, 4 * 16 + 5)
    s.add_request(TokenizedGenerateReq("direct", p, greedy(3)))
    s.step()                                            # prefilled: it holds its prompt's slots
    st = s.get_stats()
    assert st.num_running_reqs == 1 and st.kv_used_tokens >= len(p)
    drain(s)
    st = s.get_stats()
    assert st.kv_cached_tokens >= 4 * 16                # the prefix is still there for the next request
    assert (st.num_running_reqs, st.num_waiting_reqs, st.kv_used_tokens, st.num_pending_tokens) == (0, 0, 0, 0)
    # a request reusing that prefix: only what it holds counts, the cached pages it shares once
    s.add_request(TokenizedGenerateReq("again", p[:4 * 16] + [3, 4], greedy(20)))
    s.step()
    st = s.get_stats()
    assert st.num_running_reqs == 1 and 4 * 16 + 2 <= st.kv_used_tokens <= 5 * 16
    drain(s)
    assert s.get_stats().kv_used_tokens == 0
