"""Constrained decoding on a tiny vocabulary: the bitmask, the sampler's masking in a mixed
batch, and the scheduler's grammar queue (compile off the step, finish, abort, retraction).

The scheduler tests use a scripted matcher (a fixed token sequence, then stop) behind a
fake backend, so each expected token is known; the real library (llguidance) is covered by
the spec checks below and by tests/integration/entrypoints/test_structured_outputs.py.
"""

import ctypes
import threading

import numpy as np
import pytest
import torch

from fleetserve.engine.grammar.bitmask import allocate_bitmask, apply_bitmask, unpack_bitmask
from fleetserve.engine.grammar.spec import GrammarError, GrammarKey, check_grammar, to_library_grammar
from fleetserve.engine.io_struct import TokenizedGenerateReq
from fleetserve.engine.req import Req
from fleetserve.engine.sampler import Sampler
from fleetserve.engine.sampling_params import SamplingParams, SamplingParamsError

from helpers.fake_runner import make_scheduler


def bitmask_of(allowed_rows, vocab):
    m = torch.zeros(len(allowed_rows), (vocab + 31) // 32, dtype=torch.int32)
    for r, toks in enumerate(allowed_rows):
        for t in toks:
            w = int(m[r, t // 32]) & 0xFFFFFFFF
            w |= 1 << (t % 32)
            m[r, t // 32] = w - (1 << 32) if w >= 1 << 31 else w
    return m


# ------------------------------------------------------------------ bitmask


def test_unpack_matches_bit_layout_across_words():
    vocab = 70  # three words, the last one partial
    allowed = [{0, 31, 32, 63, 69}, set(range(70))]
    m = bitmask_of(allowed, vocab)
    assert int(m[0, 0]) == 1 | -(1 << 31)  # bits 0 and 31 of word 0
    got = unpack_bitmask(m, vocab)
    assert got.shape == (2, 70)
    assert set(torch.nonzero(got[0]).flatten().tolist()) == allowed[0]
    assert got[1].all()
    assert allocate_bitmask(3, 70).shape == (3, 3) and unpack_bitmask(allocate_bitmask(1, 70), 70).all()


def test_apply_only_touches_the_named_rows_and_bans_padded_vocab():
    logits = torch.arange(3 * 40, dtype=torch.float32).reshape(3, 40)
    before = logits.clone()
    # mask covers 32 tokens only (one word): tokens 32..39 are banned in masked rows
    m = bitmask_of([{1, 5}], 32)
    apply_bitmask(logits, m, [2])
    assert torch.equal(logits[:2], before[:2])
    row = logits[2]
    assert row[1] == before[2, 1] and row[5] == before[2, 5]
    assert torch.isinf(row).sum() == 38 and (row[torch.isinf(row)] < 0).all()


def test_apply_all_rows():
    logits = torch.zeros(2, 8)
    apply_bitmask(logits, bitmask_of([{3}, {0, 7}], 8), [0, 1])
    assert torch.isfinite(logits).tolist() == [[False] * 3 + [True] + [False] * 4,
                                               [True] + [False] * 6 + [True]]


# -------------------------------------------------------- scripted matcher


class ScriptedMatcher:
    """Allows exactly ``seq[k]`` at step ``k``; stopped once the sequence is consumed."""

    def __init__(self, seq, vocab):
        self.seq, self.vocab, self.k = list(seq), vocab, 0
        self.consumed = []

    def unsafe_compute_mask_ptr(self, ptr, nbytes):
        words = np.zeros(nbytes // 4, dtype=np.uint32)
        if self.k < len(self.seq):
            t = self.seq[self.k]
            words[t // 32] = np.uint32(1 << (t % 32))
        ctypes.memmove(ptr, words.ctypes.data, nbytes)

    def consume_token(self, t):
        self.consumed.append(t)
        if self.k >= len(self.seq) or t != self.seq[self.k]:
            return False
        self.k += 1
        return True

    def is_stopped(self):
        return self.k >= len(self.seq)

    def get_error(self):
        return "scripted mismatch"


class ScriptedBackend:
    """``regex`` text ``"5 7 9"`` -> a matcher spelling tokens 5, 7, 9; ``"bad"`` fails to compile."""

    def __init__(self, vocab, gate=None):
        self.vocab, self.gate, self.compiles = vocab, gate, []

    def compile(self, key):
        if self.gate is not None:
            assert self.gate.wait(10)
        self.compiles.append(key)
        if key.text == "bad":
            raise GrammarError("invalid regex: scripted", "regex")
        return key.text

    def matcher(self, grammar):
        return ScriptedMatcher([int(x) for x in grammar.split()], self.vocab)


def test_sampler_masks_constrained_rows_and_leaves_free_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    before = logits.clone()
    reqs = [Req(f"r{i}", [1], SamplingParams(temperature=0.0)) for i in range(3)]
    reqs[1].grammar = ScriptedMatcher([17], 50)
    reqs[2].grammar = ScriptedMatcher([3], 50)
    reqs[2].sampling = SamplingParams(temperature=1.0, seed=5)  # sampled rows obey the mask too
    out = Sampler(0)(logits, reqs)
    assert out.next_ids[0] == int(logits[0].argmax())
    assert out.next_ids[1:] == [17, 3]
    assert torch.equal(logits, before)  # the runner's tensor is untouched (no -inf written into it)


# ---------------------------------------------------------------- scheduler


def sched_with(backend, **kw):
    s = make_scheduler(vocab_size=50, **kw)
    s.grammar.backend_factory = lambda: backend
    return s


def run(s, reqs, max_steps=2000):
    toks, last = {}, {}
    for r in reqs:
        for o in s.add_request(r):
            last[o.rid] = o
    for _ in range(max_steps):
        if not s.has_work():
            break
        for o in s.step():
            toks.setdefault(o.rid, []).extend(o.new_token_ids)
            last[o.rid] = o
    assert not s.has_work()
    return {rid: (toks.get(rid, []), last[rid]) for rid in last}


def free(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def test_constrained_request_follows_grammar_and_stops_with_reason_stop():
    s = sched_with(ScriptedBackend(50))
    got = run(s, [TokenizedGenerateReq("g", [1, 2, 3], SamplingParams(regex="5 7 9", max_new_tokens=10,
                                                                      temperature=0.0))])
    toks, last = got["g"]
    assert toks == [5, 7, 9]
    assert last.finish_reason == {"type": "stop", "matched": None}


def test_max_tokens_cuts_the_grammar_short_with_length():
    s = sched_with(ScriptedBackend(50))
    got = run(s, [TokenizedGenerateReq("g", [1, 2], SamplingParams(regex="5 7 9 11", max_new_tokens=2,
                                                                   temperature=0.0))])
    assert got["g"][0] == [5, 7]
    assert got["g"][1].finish_reason["type"] == "length"


def test_free_request_in_a_mixed_batch_gets_the_tokens_it_gets_alone():
    alone = run(make_scheduler(vocab_size=50), [TokenizedGenerateReq("f", [4, 5, 6], free(12))])
    s = sched_with(ScriptedBackend(50))
    mixed = run(s, [TokenizedGenerateReq("f", [4, 5, 6], free(12)),
                    TokenizedGenerateReq("g", [4, 5, 7], SamplingParams(regex="1 2 3 4 5 6 7 8", temperature=0.0,
                                                                        max_new_tokens=20))])
    assert mixed["f"][0] == alone["f"][0]
    assert mixed["g"][0] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_waiting_for_the_grammar_holds_no_slot_and_does_not_block_others():
    gate = threading.Event()
    s = sched_with(ScriptedBackend(50, gate=gate))
    s.add_request(TokenizedGenerateReq("g", [9, 9], SamplingParams(regex="3 4", temperature=0.0)))
    s.add_request(TokenizedGenerateReq("f", [1, 2], free(5)))
    assert s.has_work() and s.get_stats().num_waiting_reqs == 2
    done = {}
    for _ in range(50):  # the free request runs to the end while the grammar is still compiling
        for o in s.step():
            done.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished:
                done[o.rid + ".end"] = o
        if "f.end" in done:
            break
    assert "f.end" in done and len(done["f"]) == 5
    assert all(r.rid != "g" for r in s.running + s.waiting) and s.grammar.pending() == 1
    assert s.cache.protected_size() == 0
    gate.set()
    rest = run(s, [])
    assert rest["g"][0] == [3, 4]


def test_bad_grammar_in_the_engine_aborts_only_that_request():
    s = sched_with(ScriptedBackend(50))
    got = run(s, [TokenizedGenerateReq("bad", [1], SamplingParams(regex="bad")),
                  TokenizedGenerateReq("ok", [1], free(3))])
    assert got["bad"][1].finish_reason["type"] == "abort" and "scripted" in got["bad"][1].finish_reason["message"]
    assert len(got["ok"][0]) == 3


def test_abort_while_compiling():
    gate = threading.Event()
    s = sched_with(ScriptedBackend(50, gate=gate))
    s.add_request(TokenizedGenerateReq("g", [1], SamplingParams(regex="3")))
    out = s.abort("g")
    assert out and out[0].finish_reason["type"] == "abort"
    assert not s.has_work()
    gate.set()


def test_compiled_grammar_is_cached_by_key_for_n_samples():
    b = ScriptedBackend(50)
    s = sched_with(b)
    sp = SamplingParams(regex="6 6 6", temperature=1.0)
    got = run(s, [TokenizedGenerateReq(f"n{i}", [2, 3], sp) for i in range(3)])
    assert all(got[f"n{i}"][0] == [6, 6, 6] for i in range(3))
    assert b.compiles == [GrammarKey("regex", "6 6 6")]


def test_retraction_keeps_the_matcher_state():
    seq = " ".join(str(10 + (i % 30)) for i in range(28))
    reqs = [TokenizedGenerateReq(f"p{i}", [1 + i] * (30 + i), SamplingParams(regex=seq, temperature=0.0,
                                                                             max_new_tokens=40))
            for i in range(6)]
    s = sched_with(ScriptedBackend(50), pool_size=90, schedule_conservativeness=0.05)
    got = run(s, reqs)
    assert s.num_retracted > 0
    for r in reqs:
        assert got[r.rid][0] == [int(x) for x in seq.split()]
        assert got[r.rid][1].finish_reason["type"] == "stop"


# --------------------------------------------------------------- the spec


@pytest.mark.parametrize("fields,param", [
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": '{"type": "objectx"}'}, "json_schema"),
    ({"json_schema": "[1, 2]"}, "json_schema"),
    ({"regex": "[a-"}, "regex"),
    ({"ebnf": "root ::= missing_rule"}, "ebnf"),
    ({"regex": "a", "json_schema": "{}"}, "regex"),
])
def test_bad_grammars_name_their_field(fields, param):
    with pytest.raises(GrammarError) as e:
        check_grammar(SamplingParams(**fields))
    assert e.value.param == param
    with pytest.raises(SamplingParamsError) as e2:
        SamplingParams(**fields).verify(100)
    assert e2.value.param == param


def test_good_grammars_pass():
    for fields in ({"json_schema": '{"type": "object"}'}, {"regex": r"\d{3}-\d{4}"},
                   {"ebnf": 'root ::= "yes" | "no"'}):
        SamplingParams(**fields).verify(100)
        assert isinstance(to_library_grammar(GrammarKey(*next(iter(fields.items())))), str)


def test_chunked_prefill_samples_the_grammar_only_after_the_last_chunk():
    b = ScriptedBackend(50)
    s = sched_with(b, chunked_prefill_size=7)
    reqs = [TokenizedGenerateReq("long", list(range(1, 40)), SamplingParams(regex="8 9 10", temperature=0.0)),
            TokenizedGenerateReq("free", [3] * 20, free(6))]
    got = run(s, reqs)
    alone = run(make_scheduler(vocab_size=50, chunked_prefill_size=7), [reqs[1]])
    assert got["long"][0] == [8, 9, 10] and got["long"][1].finish_reason["type"] == "stop"
    assert got["free"][0] == alone["free"][0]


def test_tensor_parallel_groups_compile_inline():
    from fleetserve.engine.grammar.hook import attn_tp_size
    from fleetserve.engine.grammar.manager import GrammarManager

    assert attn_tp_size(type("A", (), {"tp_size": 2, "enable_dp_attention": False})()) == 2
    assert attn_tp_size(type("A", (), {"tp_size": 4, "dp_size": 4, "enable_dp_attention": True})()) == 1
    m = GrammarManager(lambda: ScriptedBackend(50), sync=True)
    r = Req("r", [1], SamplingParams(regex="4"))
    m.submit(r, GrammarKey("regex", "4"))
    ready, failed = m.take_ready()  # ready at once: every rank of the group admits it on the same step
    assert ready == [r] and not failed and isinstance(r.grammar, ScriptedMatcher)
    m.shutdown()
