"""Workload generators: sizes, sharing structure, determinism, token counts."""

from fleetserve.bench.sim_tokenizer import WordTokenizer
from fleetserve.bench.workloads import VOCAB, build, multi_turn, random_prompts, shared_prefix


def test_shared_prefix_groups_share_system_prompt():
    reqs = shared_prefix(num_groups=5, prompts_per_group=3, system_prompt_len=40, question_len=7, output_len=9, seed=2)
    assert len(reqs) == 15 and len({r.rid for r in reqs}) == 15
    by_group = {}
    for r in reqs:
        by_group.setdefault(r.group, set()).add(r.messages[0]["content"])
        assert len(r.messages[0]["content"].split()) == 40 and len(r.messages[1]["content"].split()) == 7
        assert r.output_len == 9 and r.prompt_len == 47 and r.after is None
    assert all(len(v) == 1 for v in by_group.values())
    assert len({next(iter(v)) for v in by_group.values()}) == 5  # groups differ
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # shuffled (interleaved)


def test_same_seed_same_requests_other_seed_differs():
    a = shared_prefix(num_groups=3, prompts_per_group=2, system_prompt_len=10, seed=7)
    b = shared_prefix(num_groups=3, prompts_per_group=2, system_prompt_len=10, seed=7)
    c = shared_prefix(num_groups=3, prompts_per_group=2, system_prompt_len=10, seed=8)
    assert [(r.rid, r.messages) for r in a] == [(r.rid, r.messages) for r in b]
    assert [r.messages for r in a] != [r.messages for r in c]


def test_multi_turn_history_grows_and_turns_chain():
    reqs = multi_turn(num_conversations=3, num_turns=4, question_len=5, output_len=6, seed=1)
    assert [r.rid for r in reqs[:4]] == ["c0-t0", "c1-t0", "c2-t0", "c0-t1"]  # interleaved, turn-major
    by = {r.rid: r for r in reqs}
    for c in range(3):
        for t in range(1, 4):
            prev, cur = by[f"c{c}-t{t - 1}"], by[f"c{c}-t{t}"]
            assert cur.after == prev.rid
            assert cur.messages[: len(prev.messages)] == prev.messages  # previous prompt is a prefix
            assert cur.messages[len(prev.messages)]["role"] == "assistant"
            assert len(cur.messages[len(prev.messages)]["content"].split()) == 6
            assert cur.prompt_len == t * 11 + 5
            assert cur.prompt.startswith(prev.prompt)


def test_random_has_no_sharing_and_word_token_counts():
    reqs = random_prompts(num_prompts=20, input_len=50, output_len=3, seed=0)
    tok = WordTokenizer()
    firsts = {tuple(tok.encode(r.prompt)[:3]) for r in reqs}
    assert len(firsts) == 20
    assert all(len(tok.encode(r.prompt)) == 50 for r in reqs)
    assert len(set(VOCAB)) == len(VOCAB) and all(" " not in w for w in VOCAB)


def test_build_dispatches_and_rejects_unknown():
    assert len(build("random", num_prompts=4, input_len=5, num_groups=99)) == 4
    try:
        build("nope")
    except ValueError as e:
        assert "nope" in str(e)
    else:
        raise AssertionError("unknown workload accepted")


def test_multi_turn_real_replies_leave_the_history_to_the_client():
    real = multi_turn(num_conversations=2, num_turns=3, question_len=5, output_len=6, seed=1, replies="real")
    synthetic = multi_turn(num_conversations=2, num_turns=3, question_len=5, output_len=6, seed=1)
    assert [r.rid for r in real] == [r.rid for r in synthetic]
    for r, s in zip(real, synthetic):
        assert r.after == s.after and r.prompt_len == s.prompt_len
        if r.meta["turn"] == 0:
            assert r.history_from is None and r.messages == s.messages
        else:
            assert r.history_from == r.after and r.messages == [s.messages[-1]]  # the same question, alone
    assert all(s.history_from is None for s in synthetic)
    try:
        multi_turn(num_conversations=1, num_turns=1, replies="echo")
    except ValueError as e:
        assert "echo" in str(e)
    else:
        raise AssertionError("unknown replies mode accepted")
