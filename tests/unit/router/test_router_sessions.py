"""Session affinity: ``--sticky-sessions`` with ``--routing-key-headers`` (smg's flags), in router/sessions.py."""

import asyncio
import re

import aiohttp
import pytest

from fleetserve.router.config import parse_args
from fleetserve.router.sessions import StickySessions, strip_lineage
from fleetserve.router.workers import Worker
from helpers.fault_worker import FaultWorker

PROMPTS = ["Write a haiku about rain.", "What is 17 * 23?", "Translate 'good night' to French.",
           "List three prime numbers.", "Name a river in Africa.", "Who wrote Hamlet?",
           "Explain photosynthesis briefly.", "Give me a synonym for quick.", "How many legs has a spider?",
           "Spell 'necessary' backwards."]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


# -- the table and the keys -------------------------------------------------------------------------

@pytest.mark.parametrize("rid,key", [  # smg's lineage table (docs/concepts/routing/sticky-sessions.md)
    ("conv", "conv"), ("conv_t2", "conv"), ("conv_t2_r1", "conv"), ("conv_r1", "conv"),
    ("conv_t1_t2", "conv_t1"), ("conv_r1_t2", "conv_r1"), ("conv_t", "conv_t"), ("conv_tx1", "conv_tx1"),
    ("conv_T2", "conv_T2"), ("under_scored_id", "under_scored_id"), ("_t1", "_t1")])
def test_lineage_suffixes_are_stripped_as_smg_does(rid, key):
    assert strip_lineage(rid) == key


def test_key_comes_from_the_first_valid_header_then_the_user_field():
    st = StickySessions(headers=("X-Session-ID", "x-smg-routing-key"), use_user=True)
    assert st.key({"x-session-id": "s1_t3"}, {}) == "s1"
    assert st.key({"x-smg-routing-key": "k", "x-session-id": "s"}, {}) == "s"  # order of the flag, not the request
    assert st.key({"x-session-id": "", "x-smg-routing-key": "k"}, {}) == "k"  # empty: skipped
    assert st.key({"x-session-id": "a" * 129, "x-smg-routing-key": "k"}, {}) == "k"  # over 128 bytes: skipped
    assert st.key({"x-session-id": "a" * 128}, {}) == "a" * 128
    user = st.key({}, {"user": "alice"})
    assert user is not None and user != st.key({"x-session-id": "alice"}, {})  # user keys live apart
    assert st.key({}, {"user": 42}) is None and st.key({}, {}) is None
    assert StickySessions().key({}, {"user": "alice"}) is None  # the user field only with the option
    with pytest.raises(ValueError, match="--routing-key-headers"):
        StickySessions(headers=("bad name",))


def test_sessions_expire_after_the_idle_time():
    clk = Clock()
    st = StickySessions(idle_s=10, clock=clk)
    st.remember("a", "http://w0")
    clk.t += 9
    assert st.lookup("a") == "http://w0"
    st.remember("a", "http://w0")  # a use refreshes it
    clk.t += 9.5
    assert st.lookup("a") == "http://w0"
    clk.t += 10.5
    assert st.lookup("a") is None and len(st) == 0
    st.remember("b", "http://w1")
    clk.t += 11
    st.remember("c", "http://w1")  # remembering drops the expired ones, oldest first
    assert len(st) == 1 and st.lookup("b") is None


def test_the_number_of_sessions_is_bounded_least_recently_used_first():
    st = StickySessions(max_sessions=3, idle_s=0, clock=Clock())
    for k in "abc":
        st.remember(k, "http://w0")
    st.remember("a", "http://w1")  # a is now the most recent
    st.remember("d", "http://w2")
    assert len(st) == 3 and st.lookup("b") is None
    assert [st.lookup(k) for k in "acd"] == ["http://w1", "http://w0", "http://w2"]
    for i in range(1000):
        st.remember(f"k{i}", "http://w0")
    assert len(st) == 3


def test_select_keeps_the_session_worker_only_while_available_and_within_the_bound():
    st = StickySessions(abs_threshold=4, rel_threshold=1.5, clock=Clock())
    ws = [Worker(f"http://w{i}") for i in range(3)]
    assert st.select("s", ws, "t", None) is None and st.new == 1
    st.remember("s", "http://w1")
    assert st.select("s", ws, "t", None) is ws[1] and st.hits == 1
    ws[0].load = ws[2].load = 1
    ws[1].load = 6  # 6 - 1 > 4 and 6 > 1 * 1.5: too busy
    assert st.select("s", ws, "t", None) is None and st.moved == 1
    ws[1].load = 5  # 5 - 1 <= 4
    assert st.select("s", ws, "t", None) is ws[1]
    assert st.select("s", [ws[0], ws[2]], "t", None) is None and st.moved == 2  # not available


def test_flags_follow_smg_and_bad_values_name_the_flag(capsys):
    cfg = parse_args(["--sticky-sessions", "--routing-key-headers", "X-Session-ID", "x-smg-routing-key",
                      "--max-idle-secs", "60", "--sticky-max-sessions", "5", "--routing-key-from-user"])
    assert (cfg.sticky_sessions, cfg.routing_key_headers, cfg.sticky_idle_secs, cfg.sticky_max_sessions,
            cfg.routing_key_from_user) == (True, ["X-Session-ID", "x-smg-routing-key"], 60.0, 5, True)
    alias = parse_args(["--routing-key-override", "--sticky-key-idle-secs", "7"])  # smg's other spellings
    assert alias.sticky_sessions and alias.sticky_idle_secs == 7.0
    d = parse_args([])
    assert (d.sticky_sessions, d.routing_key_headers, d.sticky_idle_secs) == (False, ["x-smg-routing-key"], 14400.0)
    for argv, flag in ((["--routing-key-headers", "no good"], "--routing-key-headers"),
                       (["--sticky-max-sessions", "0"], "--sticky-max-sessions"),
                       (["--max-idle-secs", "-1"], "--max-idle-secs")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert flag in capsys.readouterr().err


# -- through the router ------------------------------------------------------------------------------

@pytest.fixture
async def three():
    ws = [await FaultWorker(f"w{i}").start() for i in range(3)]
    yield ws
    for w in ws:
        await w.close()


async def ask(s, r, prompt, session=None, header="X-Session-ID"):
    headers = {header: session} if session else {}
    async with s.post(r.url + "/v1/completions", json={"prompt": prompt}, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["worker"]


def sticky(urls, **kw):
    return dict(worker_urls=urls, sticky_sessions=True, routing_key_headers=["X-Session-ID"], **kw)


@pytest.mark.timeout(60)
async def test_one_session_with_unrelated_prompts_stays_on_one_worker_and_sessions_spread(three, InProcessRouter):
    urls = [w.url for w in three]
    async with aiohttp.ClientSession() as s:
        async with InProcessRouter(worker_urls=urls) as r:  # control: without stickiness they spread
            assert len({await ask(s, r, p, "chat-1") for p in PROMPTS}) > 1
        async with InProcessRouter(**sticky(urls)) as r:
            assert {await ask(s, r, p, "chat-1") for p in PROMPTS} == {"w0"}
            # turn and retry suffixes keep the conversation together (smg's lineage rule)
            assert await ask(s, r, "unrelated again", "chat-1_t11_r2") == "w0"
            # other sessions start where cache_aware puts them (least loaded, smallest tree): they spread
            firsts = {}
            for i in range(2, 8):
                firsts[f"chat-{i}"] = await ask(s, r, f"session {i} opens with its own prompt {i * 7919}", f"chat-{i}")
            assert len(set(firsts.values())) >= 2, firsts  # w0 holds the most text, so w1 and w2 take them
            for sess, w in firsts.items():  # and each stays on its worker
                assert {await ask(s, r, p, sess) for p in PROMPTS[:4]} == {w}
            # a request without a key is the policy's: a prompt w2 holds goes to w2
            w2_session = next(k for k, v in firsts.items() if v == "w2")
            assert await ask(s, r, f"session {w2_session[5:]} opens with its own prompt "
                                   f"{int(w2_session[5:]) * 7919} and more") == "w2"
            async with s.get(r.url + "/metrics") as resp:
                m = await resp.text()
            assert "fleetserve_router_sticky_sessions 7.0" in m
            hit = float(re.search(r'fleetserve_router_sticky_decisions_total\{result="hit"\} (\S+)', m).group(1))
            assert hit == 9 + 1 + 6 * 4


@pytest.mark.timeout(60)
async def test_the_user_field_as_the_key(three, InProcessRouter):
    urls = [w.url for w in three]
    async with aiohttp.ClientSession() as s, InProcessRouter(**sticky(urls, routing_key_from_user=True)) as r:
        seen = set()
        for p in PROMPTS:
            async with s.post(r.url + "/v1/chat/completions",
                              json={"user": "alice", "messages": [{"role": "user", "content": p}]}) as resp:
                seen.add((await resp.json())["worker"])
        assert len(seen) == 1


@pytest.mark.timeout(60)
async def test_an_idle_session_expires(three, InProcessRouter):
    urls = [w.url for w in three]
    async with aiohttp.ClientSession() as s, InProcessRouter(**sticky(urls, policy="round_robin",
                                                                      sticky_idle_secs=0.3)) as r:
        assert [await ask(s, r, p, "s") for p in PROMPTS[:3]] == ["w0"] * 3
        await asyncio.sleep(0.45)
        assert await ask(s, r, "after a pause", "s") == "w1"  # forgotten: round robin's next turn
        assert await ask(s, r, "and again", "s") == "w1"  # pinned anew


@pytest.mark.timeout(60)
async def test_the_session_bound_is_enforced(three, InProcessRouter):
    urls = [w.url for w in three]
    async with aiohttp.ClientSession() as s, InProcessRouter(**sticky(urls, policy="round_robin",
                                                                      sticky_max_sessions=2)) as r:
        assert [await ask(s, r, "x", k) for k in ("a", "b", "c")] == ["w0", "w1", "w2"]
        assert len(r.router.sessions) == 2
        assert await ask(s, r, "y", "c") == "w2" and await ask(s, r, "y", "b") == "w1"
        assert await ask(s, r, "y", "a") == "w0"  # a was dropped: the policy decides (round robin's next turn)
        assert len(r.router.sessions) == 2 and r.router.sessions.lookup("c") is None  # a pushed out c


@pytest.mark.timeout(60)
async def test_a_removed_worker_forgets_its_sessions_and_a_busy_or_sick_one_lets_them_move(three, InProcessRouter):
    urls = [w.url for w in three]
    words = {"a": "alpha", "b": "bravo", "c": "charlie", "d": "delta"}
    async with aiohttp.ClientSession() as s, InProcessRouter(**sticky(urls, balance_abs_threshold=2)) as r:
        # cache_aware places the new sessions: misses, least loaded, then the smallest tree
        assert [await ask(s, r, words[k], k) for k in "abcd"] == ["w0", "w1", "w2", "w0"]
        async with s.post(r.url + f"/remove_worker?url={urls[0]}") as resp:
            assert resp.status == 200
        assert len(r.router.sessions) == 2 and r.router.sessions.lookup("a") is None
        moved = await ask(s, r, words["a"], "a")
        assert moved in ("w1", "w2") and await ask(s, r, "something else", "a") == moved
        async with s.post(r.url + f"/add_worker?url={urls[0]}") as resp:
            assert resp.status == 200
        assert await ask(s, r, words["a"] + "!", "a") == moved  # re-adding w0 does not bring old sessions back
        # too busy (over the balance thresholds against the least loaded): the session moves
        b = r.router.registry.get(urls[1])
        b.load += 5
        try:
            assert await ask(s, r, words["b"], "b") != "w1"
        finally:
            b.load -= 5
        # unhealthy: the session moves too
        c = r.router.registry.get(urls[2])
        c.healthy = False
        assert await ask(s, r, words["c"], "c") != "w2"
        c.healthy = True
        assert r.router.sessions.moved == 2  # (a was forgotten with w0: that was a new key)
        assert r.router.handling == 0 and all(w.load == 0 for w in r.router.registry.workers)


def route_fields(header: str) -> dict:
    return dict(part.split("=", 1) for part in header.split("; "))


async def routed(s, r, prompt, session):
    async with s.post(r.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4},
                      headers={"X-Session-ID": session}) as resp:
        assert resp.status == 200, await resp.text()
        assert "x-fleetserve-route" in resp.headers, dict(resp.headers)
        return (await resp.json())["worker"], route_fields(resp.headers["x-fleetserve-route"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["cache_aware", "round_robin", "kv_aware"])
async def test_a_session_choice_carries_the_route_header(three, InProcessRouter, policy):
    urls = [w.url for w in three]
    names = {w.url: w.name for w in three}
    async with aiohttp.ClientSession() as s, InProcessRouter(**sticky(urls, policy=policy)) as r:
        worker, first = await routed(s, r, "Open the conversation.", "conv")
        assert first["branch"] != "session" and names[first["target"]] == worker  # the policy's choice
        worker2, again = await routed(s, r, "An unrelated second turn, longer than the first one.", "conv_t2")
        assert worker2 == worker and again["target"] == first["target"]
        assert again["branch"] == "session" and again["dp_rank"] == "-"
        assert int(again["prompt_tokens"]) == 13  # ceil(52 characters / 4)
        if policy == "kv_aware":  # its guess for the session's worker: the tree holds nothing of this text
            assert again["cached_tokens"] == "0"
            assert r.router.policy.load_tokens == {} and r.router.policy.inflight == {}  # charged, then released
        else:
            assert again["cached_tokens"] == "-"


@pytest.mark.timeout(60)
async def test_kv_aware_dp_aware_session_choice_gets_the_policys_rank_on_the_session_worker(three, InProcessRouter):
    from helpers.fake_kv_stream import two_ranks

    urls = [w.url for w in three]
    async with aiohttp.ClientSession() as s, InProcessRouter(**sticky(urls, policy="kv_aware", dp_aware=True)) as r:
        pol = r.router.policy
        two_ranks(pol, urls)
        _, first = await routed(s, r, "Open the conversation.", "conv")
        assert (first["target"], first["dp_rank"], first["branch"]) == (urls[0], "0", "fallback")
        pol.load_tokens[(urls[0], 0)] = 10_000  # rank 0 of the session's worker is busy now
        _, again = await routed(s, r, "Open the conversation. And go on.", "conv")
        # the session keeps the worker; the policy picks its rank there: rank 1, not the busy 0 nor none
        assert (again["target"], again["dp_rank"], again["branch"]) == (urls[0], "1", "session")
        assert pol.load_tokens == {(urls[0], 0): 10_000}  # the session request's own tokens came off again
        # the rank 0 request's text is in the tree under rank 0; rank 1 shares none of it
        assert again["cached_tokens"] == "0"


@pytest.mark.timeout(60)
async def test_a_drained_worker_forgets_its_sessions_too(three, InProcessRouter):
    """/drain_worker ends as /remove_worker does: the drained worker's sessions are forgotten (before, the
    drain removed it from routing but kept its sessions, and a re-added worker got them back)."""
    urls = [w.url for w in three]
    async with aiohttp.ClientSession() as s, InProcessRouter(**sticky(urls, policy="round_robin")) as r:
        assert [await ask(s, r, "x", k) for k in ("a", "b")] == ["w0", "w1"]
        async with s.post(r.url + f"/drain_worker?url={urls[0]}") as resp:
            assert resp.status == 202
        for _ in range(200):
            if r.router.registry.get(urls[0]) is None:
                break
            await asyncio.sleep(0.01)
        assert r.router.registry.get(urls[0]) is None
        assert r.router.sessions.lookup("a") is None and r.router.sessions.lookup("b") is not None
