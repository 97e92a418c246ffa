"""The collect-or-stream helper every generating route uses: submit cleanup, merging, 503s, SSE framing."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.entrypoints.errors import APIError
from fleetserve.entrypoints.http.lifespan import ENGINE_DIED
from fleetserve.entrypoints.http.state import ServerState
from fleetserve.entrypoints.http.streaming import SSE_DONE, collect, merge_streams, sse_events, submit_all


def out(text, finished=False, reason=None, message=None):
    return SimpleNamespace(text=text, finished=finished, finish_reason=reason, abort_message=message)


class FakeStream:
    """Yields its outputs with a pause between them; records abort()."""

    def __init__(self, outs, pause=0.0):
        self.outs, self.pause, self.aborted = outs, pause, False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for o in self.outs:
            await asyncio.sleep(self.pause)
            yield o

    def abort(self):
        self.aborted = True


class FakeManager:
    """submit() hands out one FakeStream per prompt and fails on call ``fail_at`` (1-based)."""

    def __init__(self, fail_at=None, error=RuntimeError("Resource temporarily unavailable")):
        self.fail_at, self.error, self.calls, self.made = fail_at, error, 0, []

    def submit(self, ids, sp, **kw):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        s = FakeStream([out("x", True, "stop")])
        s.kw = kw
        self.made.append(s)
        return [s]


SP = SamplingParams()


def test_submit_all_aborts_what_it_sent_when_a_later_prompt_fails():
    tm = FakeManager(fail_at=3)
    with pytest.raises(APIError) as err:
        submit_all(ServerState(tm=tm), [[1], [2], [3]], [SP] * 3)
    assert err.value.status == 503 and "not accepting requests" in err.value.message
    assert len(tm.made) == 2 and all(s.aborted for s in tm.made)


def test_submit_all_passes_rids_and_keeps_the_managers_own_errors():
    tm = FakeManager()
    streams = submit_all(ServerState(tm=tm), [[1], [2]], [SP] * 2, ["a", "b"], return_logprob=True)
    assert [s.kw["rid"] for s in streams] == ["a", "b"] and streams[0].kw["return_logprob"] is True
    tm = FakeManager(fail_at=1, error=APIError("request id 'a' is already running", 400, "rid"))
    with pytest.raises(APIError) as err:
        submit_all(ServerState(tm=tm), [[1]], [SP], ["a"])
    assert (err.value.status, err.value.param) == (400, "rid")


def test_submit_all_refuses_when_the_scheduler_died():
    tm = FakeManager()
    with pytest.raises(APIError) as err:
        submit_all(ServerState(tm=tm, is_alive=lambda: False), [[1]], [SP])
    assert err.value.status == 503 and tm.calls == 0


async def test_merge_interleaves_by_arrival_and_aborts_at_the_end():
    slow = FakeStream([out("s1"), out("s2")], pause=0.05)
    fast = FakeStream([out("f1"), out("f2"), out("f3")], pause=0.01)
    got = [(i, o.text) async for i, o in merge_streams([slow, fast])]
    assert got[:3] == [(1, "f1"), (1, "f2"), (1, "f3")] and sorted(got[3:]) == [(0, "s1"), (0, "s2")]
    assert slow.aborted and fast.aborted


async def test_collect_groups_by_stream_and_turns_a_dead_engine_into_503():
    a, b = FakeStream([out("a"), out("b", True, "stop")]), FakeStream([out("c", True, "length")])
    per = await collect([a, b])
    assert [[o.text for o in outs] for outs in per] == [["a", "b"], ["c"]]
    dead = FakeStream([out("", True, "abort", ENGINE_DIED)])
    with pytest.raises(APIError) as err:
        await collect([dead])
    assert err.value.status == 503


async def test_sse_frames_each_event_then_done_and_aborts():
    s = FakeStream([out("a"), out("b", True, "stop")])

    async def chunks(merged):
        yield {"hello": "wörld"}
        async for i, o in merged:
            yield {"i": i, "text": o.text}

    events = [e async for e in sse_events([s], chunks)]
    assert events[0] == 'data: {"hello": "wörld"}\n\n'
    assert [json.loads(e[len("data: "):]) for e in events[1:-1]] == [{"i": 0, "text": "a"}, {"i": 0, "text": "b"}]
    assert events[-1] == SSE_DONE and s.aborted


async def test_sse_closed_early_aborts_every_stream():
    streams = [FakeStream([out(str(k)) for k in range(50)], pause=0.01) for _ in range(2)]

    async def chunks(merged):
        async for i, o in merged:
            yield {"i": i}

    body = sse_events(streams, chunks)
    await body.__anext__()
    await body.aclose()  # the client went away after one event
    assert all(s.aborted for s in streams)
