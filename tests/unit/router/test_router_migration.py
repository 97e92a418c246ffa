"""Request migration over real HTTP: a worker dies mid-stream, the router continues on another.

The workers are :class:`helpers.script_worker.ScriptWorker`: they stream a scripted answer
one token per event, continue it from any prefix a continuation request carries (400 for a
prefix that is not the script's), and die after ``k`` events on command.  The client's text
must be exactly the script, in one stream with one id, one finish reason and one ``[DONE]``.
"""

import asyncio
import contextlib
import json
import logging
import re

import aiohttp
import pytest

from helpers.script_worker import ID0, PROMPT, PROMPT_IDS, PROMPT_TOKENS, ScriptWorker


def events(raw: bytes) -> list[str]:
    """The data of every SSE event, in order."""
    return [line[6:] for block in raw.decode().split("\n\n") for line in block.split("\n")
            if line.startswith("data: ")]


async def settled(s: aiohttp.ClientSession, r) -> None:
    """Every worker's in-flight gauge (from /metrics) back to 0 and nothing being handled."""
    loads = {}
    for _ in range(100):
        async with s.get(r.url + "/metrics") as resp:
            text = await resp.text()
        loads = dict(re.findall(r'fleetserve_router_inflight_requests\{worker="([^"]+)"\} (\S+)', text))
        if r.router.handling == 0 and loads and all(float(v) == 0 for v in loads.values()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"in flight did not return to 0: {loads}, handling={r.router.handling}")

SCRIPT = ["Once", " upon", " a", " time", ",", " a", " tiny", " model", " 你好", " ended", "."]
FULL = "".join(SCRIPT)

# name -> (path, body)
KINDS = {
    "generate_text": ("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 50, "temperature": 0.7}}),
    "generate_ids": ("/generate", {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 50,
                                                                                  "temperature": 0.7}}),
    "completions": ("/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": 50, "temperature": 0.7,
                                        "stream_options": {"include_usage": True}}),
    "chat": ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": PROMPT}],
                                      "max_tokens": 50, "temperature": 0.7,
                                      "stream_options": {"include_usage": True}}),
}
DIE_AFTER_TOKENS = 3


def router_cfg(urls, **kw):
    cfg = dict(worker_urls=urls, policy="round_robin", request_timeout_secs=1.0, retry_initial_backoff_ms=1,
               retry_max_backoff_ms=5, retry_max_retries=3, health_check_interval_secs=3600)
    cfg.update(kw)
    return cfg


def die_after_events(kind: str, tokens: int) -> int:
    return tokens + (1 if kind == "chat" else 0)  # chat opens with a role chunk


def read_answer(kind: str, raw: bytes) -> dict:
    """What the client got: text, ids, finish reasons, usage chunks, [DONE] count, error events."""
    evs = events(raw)
    out = {"text": "", "ids": set(), "created": set(), "finish": [], "usage": [], "done": evs.count("[DONE]"),
           "errors": [], "last_is_done": bool(evs) and evs[-1] == "[DONE]", "roles": 0, "output_ids": None}
    for e in evs:
        if e == "[DONE]":
            continue
        obj = json.loads(e)
        if "error" in obj:
            out["errors"].append(obj["error"])
            continue
        if kind.startswith("generate"):
            out["text"] = obj["text"]  # cumulative
            out["output_ids"] = obj["output_ids"]
            meta = obj["meta_info"]
            out["ids"].add(meta["id"])
            if meta["finish_reason"] is not None:
                out["finish"].append(meta["finish_reason"]["type"])
            out["usage"] = [(meta["prompt_tokens"], meta["completion_tokens"])]
            continue
        out["ids"].add(obj["id"])
        out["created"].add(obj["created"])
        for c in obj["choices"]:
            if kind == "chat":
                out["text"] += c["delta"].get("content", "")
                out["roles"] += "role" in c["delta"]
            else:
                out["text"] += c["text"]
            if c["finish_reason"] is not None:
                out["finish"].append(c["finish_reason"])
        if obj.get("usage"):
            u = obj["usage"]
            out["usage"].append((u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]))
    return out



@contextlib.asynccontextmanager
async def fleet(InProcessRouter, names: str, worker_kw: dict | None = None, **cfg):
    """Script workers named by ``names`` (``worker_kw``: ScriptWorker's options) and a round-robin router
    in front of them, its next turn the first worker; yields ``(session, router, workers)`` and closes
    the workers after."""
    ws = [await ScriptWorker(n, SCRIPT, **(worker_kw or {})).start() for n in names]
    try:
        async with aiohttp.ClientSession() as s, InProcessRouter(**router_cfg([w.url for w in ws], **cfg)) as r:
            r.router.policy._next = 0
            yield s, r, ws
    finally:
        for w in ws:
            await w.close()


def run(main) -> None:
    asyncio.run(asyncio.wait_for(main(), 30))

async def post(s, url, path, body):
    async with s.post(url + path, json={**body, "stream": True}) as resp:
        return resp.status, await resp.read()


def no_failure_lines(caplog) -> list[str]:
    """The router's log lines, after checking that none charged a worker with a failure."""
    msgs = [rec.getMessage() for rec in caplog.records if rec.name == "fleetserve.router"]
    assert not [m for m in msgs if "failed a request" in m], msgs
    return msgs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["reset", "close", "error", "stall"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_stream_survives_a_dying_worker(kind, how, InProcessRouter):
    path, body = KINDS[kind]

    async def main():
        async with fleet(InProcessRouter, "ab") as (s, r, (a, b)):  # a first
            a.die(after=die_after_events(kind, DIE_AFTER_TOKENS), how=how)
            status, raw = await post(s, r.url, path, body)
            assert status == 200, raw
            got = read_answer(kind, raw)
            assert got["errors"] == [] and got["text"] == FULL, (got, raw.decode())
            assert got["done"] == 1 and got["last_is_done"], raw.decode()
            assert got["finish"] == ["stop"], got
            assert got["ids"] == {"a-1"}, got  # every chunk carries the first worker's id
            if kind.startswith("generate"):
                assert got["output_ids"] == [ID0 + j for j in range(len(SCRIPT))]
                assert got["usage"] == [(PROMPT_TOKENS, len(SCRIPT))]
            else:
                assert got["created"] == {1700000001}, got
                assert got["usage"] == [(PROMPT_TOKENS, len(SCRIPT), PROMPT_TOKENS + len(SCRIPT))], got
            if kind == "chat":
                assert got["roles"] == 1
            # what the second worker was asked
            assert [p for p, _ in b.bodies] == [path]
            cont = b.bodies[0][1]
            prefix = "".join(SCRIPT[:DIE_AFTER_TOKENS])
            if kind == "generate_ids":
                assert cont["input_ids"] == PROMPT_IDS + [ID0 + j for j in range(DIE_AFTER_TOKENS)]
            elif kind == "generate_text":
                assert cont["text"] == PROMPT + prefix
            elif kind == "completions":
                assert cont["prompt"] == PROMPT + prefix
            else:
                assert cont["messages"] == body["messages"] + [{"role": "assistant", "content": prefix}]
                assert cont["continue_final_message"] is True and cont["add_generation_prompt"] is False
            if kind.startswith("generate"):
                assert cont["sampling_params"] == {"max_new_tokens": 50 - DIE_AFTER_TOKENS, "temperature": 0.7}
            else:
                assert cont["max_tokens"] == 50 - DIE_AFTER_TOKENS and cont["temperature"] == 0.7
            assert cont["stream"] is True
            assert r.router.stats.migrations == 1
            await settled(s, r)

    run(main)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["completions", "chat", "generate_ids"])
def test_a_migrated_answers_cached_tokens_never_exceed_its_prompt(kind, InProcessRouter):
    """The continuation's prompt is the original plus the answer so far, and its worker counts its cached
    tokens over that; the client's usage names the original prompt, so its cached tokens are capped there
    (a user trial saw ``prompt_tokens`` 101 next to ``cached_tokens`` 307)."""
    path, body = KINDS[kind]

    async def main():
        async with fleet(InProcessRouter, "ab") as (s, r, (a, b)):
            a.die(after=die_after_events(kind, DIE_AFTER_TOKENS), how="reset")
            status, raw = await post(s, r.url, path, body)
            assert status == 200, raw
            assert b.bodies, "no continuation"
            last_usage = None
            for e in events(raw):
                if e == "[DONE]":
                    continue
                obj = json.loads(e)
                if kind.startswith("generate"):
                    last_usage = (obj["meta_info"]["prompt_tokens"], obj["meta_info"]["cached_tokens"])
                elif obj.get("usage"):
                    u = obj["usage"]
                    last_usage = (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])
            assert last_usage == (PROMPT_TOKENS, PROMPT_TOKENS), last_usage  # b reported PROMPT_TOKENS + 3
            await settled(s, r)

    run(main)


@pytest.mark.timeout(60)
def test_a_generate_answer_cut_by_its_budget_names_the_whole_length(InProcessRouter):
    """/generate with max_new_tokens 5: a dies after 3 tokens, b continues with a budget of 2 and ends on
    it.  The client's last meta_info says ``{"type": "length", "length": 5}``, the answer's, not b's 2
    (a user trial saw the continuation's own figure, next to a completion_tokens of the whole)."""
    path = "/generate"
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": DIE_AFTER_TOKENS + 2}}

    async def main():
        async with fleet(InProcessRouter, "ab") as (s, r, (a, b)):
            a.die(after=die_after_events("generate_text", DIE_AFTER_TOKENS), how="reset")
            status, raw = await post(s, r.url, path, body)
            assert status == 200, raw
            last = json.loads(events(raw)[-2])  # the event before [DONE]
            assert last["meta_info"]["completion_tokens"] == DIE_AFTER_TOKENS + 2
            assert last["meta_info"]["finish_reason"] == {"type": "length", "length": DIE_AFTER_TOKENS + 2}
            assert b.bodies[0][1]["sampling_params"]["max_new_tokens"] == 2
            await settled(s, r)

    run(main)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["generate_text", "chat"])
def test_max_migrations_zero_gives_the_error_event(kind, InProcessRouter):
    path, body = KINDS[kind]

    async def main():
        a = await ScriptWorker("a", SCRIPT).start()
        b = await ScriptWorker("b", SCRIPT).start()
        try:
            async with aiohttp.ClientSession() as s, InProcessRouter(**router_cfg([a.url, b.url],
                                                                                  max_migrations=0)) as r:
                r.router.policy._next = 0
                a.die(after=die_after_events(kind, DIE_AFTER_TOKENS))
                status, raw = await post(s, r.url, path, body)
                got = read_answer(kind, raw)
                assert status == 200 and got["done"] == 0
                assert got["text"] == "".join(SCRIPT[:DIE_AFTER_TOKENS])
                assert [e["code"] for e in got["errors"]] == ["upstream_error"], got
                assert b.bodies == [] and r.router.stats.migrations == 0
                await settled(s, r)
        finally:
            await a.close()
            await b.close()

    run(main)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["generate_ids", "completions", "chat"])
def test_both_workers_dying_ends_with_an_error_event(kind, InProcessRouter):
    path, body = KINDS[kind]

    async def main():
        async with fleet(InProcessRouter, "ab") as (s, r, (a, b)):
            a.die(after=die_after_events(kind, DIE_AFTER_TOKENS))
            b.die(after=die_after_events(kind, 2))  # two more tokens, then b dies too
            status, raw = await post(s, r.url, path, body)
            got = read_answer(kind, raw)
            assert status == 200 and got["done"] == 0, raw.decode()
            # no text lost or repeated up to the second failure
            assert got["text"] == "".join(SCRIPT[:DIE_AFTER_TOKENS + 2]), got
            assert len(got["errors"]) == 1 and got["errors"][0]["code"] == "upstream_error"
            assert len(got["ids"]) == 1 and r.router.stats.migrations == 1
            await settled(s, r)

    run(main)


@pytest.mark.timeout(60)
def test_two_migrations_over_three_workers(InProcessRouter):
    path, body = KINDS["chat"]

    async def main():
        async with fleet(InProcessRouter, "abc", max_migrations=2) as (s, r, ws):
            # round robin on a retry: a's continuation goes to c (turn 1 of [b, c]), c's to b
            ws[0].die(after=die_after_events("chat", 3))
            ws[2].die(after=die_after_events("chat", 4))
            status, raw = await post(s, r.url, path, body)
            got = read_answer("chat", raw)
            assert got["text"] == FULL and got["done"] == 1 and got["errors"] == [], raw.decode()
            assert got["usage"] == [(PROMPT_TOKENS, len(SCRIPT), PROMPT_TOKENS + len(SCRIPT))]
            assert ws[2].bodies[0][1]["messages"][-1]["content"] == "".join(SCRIPT[:3])
            assert ws[1].bodies[0][1]["messages"][-1]["content"] == "".join(SCRIPT[:7])
            assert ws[1].bodies[0][1]["max_tokens"] == 50 - 7
            assert r.router.stats.migrations == 2 and len(got["ids"]) == 1
            await settled(s, r)

    run(main)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("honors", [True, False])
@pytest.mark.parametrize("kind", ["generate_ids", "completions", "chat"])
def test_failure_after_the_last_token_is_ended_by_the_router(kind, honors, InProcessRouter):
    """The limit was reached (5 tokens) before the worker could send its finish: nothing to continue.
    ``honors``: whether the worker sends the usage in every chunk the router asks for."""
    path, body = KINDS[kind]
    body = dict(body)
    if kind.startswith("generate"):
        body["sampling_params"] = {"max_new_tokens": 5}
    else:
        body["max_tokens"] = 5

    async def main():
        async with fleet(InProcessRouter, "ab", {"honors_continuous_usage": honors}) as (s, r, (a, b)):
            # generate / completions carry the finish in the 5th token's event: die before it
            a.die(after=die_after_events(kind, 5 if kind == "chat" else 4))
            status, raw = await post(s, r.url, path, body)
            got = read_answer(kind, raw)
            if kind == "chat":  # all 5 tokens arrived; the router ends the stream itself
                assert got["text"] == "".join(SCRIPT[:5]) and got["finish"] == ["length"], got
                assert b.bodies == [] and got["done"] == 1
                if honors:  # the usage in the chunks: the router's ending reports it, exact
                    assert got["usage"] == [(PROMPT_TOKENS, 5, PROMPT_TOKENS + 5)], got
                else:
                    assert got["usage"] == [], got  # prompt tokens never reported: no made-up usage
            else:  # one token left: b is asked for exactly one
                assert got["text"] == "".join(SCRIPT[:5]) and got["finish"] == ["length"], got
                cont = b.bodies[0][1]
                limit = cont["sampling_params"]["max_new_tokens"] if kind.startswith("gen") else cont["max_tokens"]
                assert limit == 1 and got["done"] == 1
            await settled(s, r)

    run(main)


@pytest.mark.timeout(60)
def test_removed_worker_hands_its_stream_over(InProcessRouter):
    path, body = KINDS["completions"]

    async def main():
        a = await ScriptWorker("a", SCRIPT, delay_s=0.1).start()
        b = await ScriptWorker("b", SCRIPT).start()
        try:
            async with aiohttp.ClientSession() as s, InProcessRouter(**router_cfg([a.url, b.url],
                                                                                  request_timeout_secs=10)) as r:
                r.router.policy._next = 0
                task = asyncio.ensure_future(post(s, r.url, path, body))
                while a.sent_events < 3:
                    await asyncio.sleep(0.01)
                async with s.post(r.url + "/remove_worker", params={"url": a.url}) as resp:
                    assert resp.status == 200, await resp.text()
                status, raw = await task
                got = read_answer("completions", raw)
                assert got["text"] == FULL and got["done"] == 1 and got["errors"] == [], raw.decode()
                assert 3 <= a.sent_events < len(SCRIPT) and len(b.bodies) == 1
                assert got["usage"] == [(PROMPT_TOKENS, len(SCRIPT), PROMPT_TOKENS + len(SCRIPT))]
        finally:
            await a.close()
            await b.close()

    run(main)


LONG_SCRIPT = [f" w{i}" for i in range(40)]  # 40 events 0.05 s apart: 2 s on each worker


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(KINDS))
def test_removing_a_worker_aborts_its_moved_stream(kind, InProcessRouter, caplog):
    """A worker removed mid-stream: the stream goes on on the other worker, and the removed worker's
    request is aborted at once (its connection closed), not left generating until the answer ends
    elsewhere; the removal is no failure of the worker (counts, circuit breaker, warnings)."""
    path, body = KINDS[kind]

    async def main():
        a = await ScriptWorker("a", LONG_SCRIPT, delay_s=0.05).start()
        b = await ScriptWorker("b", LONG_SCRIPT, delay_s=0.05).start()
        loop = asyncio.get_running_loop()
        try:
            async with aiohttp.ClientSession() as s, InProcessRouter(**router_cfg([a.url, b.url],
                                                                                  request_timeout_secs=10)) as r:
                r.router.policy._next = 0
                wa = r.router.registry.get(a.url)
                task = asyncio.ensure_future(post(s, r.url, path, body))
                while a.sent_events < 3:
                    await asyncio.sleep(0.01)
                removed_at = loop.time()
                async with s.post(r.url + "/remove_worker", params={"url": a.url}) as resp:
                    assert resp.status == 200, await resp.text()
                status, raw = await task
                answered_at = loop.time()
                got = read_answer(kind, raw)
                # (a) the client's answer is whole, finished by b
                assert status == 200 and got["errors"] == [] and got["done"] == 1, raw.decode()
                assert got["text"] == "".join(LONG_SCRIPT) and got["finish"] == ["stop"], got
                assert len(b.bodies) == 1 and r.router.stats.migrations == 1
                # (b) a's request was aborted right after the removal, long before b ended the answer
                assert len(a.aborted) == 1, a.aborted
                assert a.aborted[0] - removed_at < 0.5 < answered_at - a.aborted[0], \
                    (a.aborted[0] - removed_at, answered_at - a.aborted[0])
                assert a.sent_events < 10 and a.answer_connections() == 0  # it stopped; its connection is gone
                # (c) the removal is not a's failure
                assert (wa.failures, wa.failed_in_row, wa.breaker.state) == (0, 0, "closed")
                await settled(s, r)
        finally:
            await a.close()
            await b.close()

    with caplog.at_level(logging.INFO, "fleetserve.router"):
        run(main)
    # (d) no failure warning for a; an info line for the removal instead
    msgs = [(rec.levelno, rec.getMessage()) for rec in caplog.records if rec.name == "fleetserve.router"]
    assert not [m for _, m in msgs if "failed a request" in m or "circuit breaker" in m], msgs
    assert [lv for lv, m in msgs if "was removed mid-stream" in m] == [logging.INFO], msgs


@pytest.mark.timeout(60)
def test_a_continuation_whose_worker_is_removed_moves_again(InProcessRouter, caplog):
    """``--max-migrations 2``: the first worker removed, then the one continuing the stream: each
    removed worker's request is aborted, the third ends the answer, and no removal is a failure."""
    path, body = KINDS["completions"]

    async def main():
        ws = [await ScriptWorker(n, LONG_SCRIPT, delay_s=0.05).start() for n in "abc"]
        try:
            async with aiohttp.ClientSession() as s, InProcessRouter(**router_cfg(
                    [w.url for w in ws], request_timeout_secs=10, max_migrations=2)) as r:
                r.router.policy._next = 0
                objs = [r.router.registry.get(w.url) for w in ws]
                task = asyncio.ensure_future(post(s, r.url, path, body))
                removed = []
                for _ in range(2):
                    while not [w for w in ws if w.bodies and w not in removed]:  # the stream's next worker
                        await asyncio.sleep(0.01)
                    w = next(w for w in ws if w.bodies and w not in removed)
                    while w.sent_events < 3:
                        await asyncio.sleep(0.01)
                    async with s.post(r.url + "/remove_worker", params={"url": w.url}) as resp:
                        assert resp.status == 200, await resp.text()
                    removed.append(w)
                    while not w.aborted:
                        await asyncio.sleep(0.01)
                status, raw = await task
                got = read_answer("completions", raw)
                assert got["text"] == "".join(LONG_SCRIPT) and got["done"] == 1 and got["errors"] == [], raw.decode()
                last = next(w for w in ws if w not in removed)
                assert r.router.stats.migrations == 2 and len(last.bodies) == 1 and last.aborted == []
                assert [len(w.aborted) for w in removed] == [1, 1]
                assert all(w.answer_connections() == 0 for w in removed)
                assert [(o.failures, o.breaker.state) for o in objs] == [(0, "closed")] * 3
                await settled(s, r)
        finally:
            for w in ws:
                await w.close()

    with caplog.at_level(logging.INFO, "fleetserve.router"):
        run(main)
    msgs = no_failure_lines(caplog)
    assert len([m for m in msgs if "was removed mid-stream" in m]) == 2, msgs


@pytest.mark.timeout(60)
def test_a_stream_that_cannot_move_finishes_on_its_removed_worker(InProcessRouter, caplog):
    """The only worker removed mid-stream: no other worker to move to, so the stream finishes there
    (as a non-streamed request does) rather than ending with an error event."""
    path, body = KINDS["chat"]

    async def main():
        a = await ScriptWorker("a", SCRIPT, delay_s=0.05).start()
        try:
            async with aiohttp.ClientSession() as s, InProcessRouter(**router_cfg([a.url],
                                                                                  request_timeout_secs=10)) as r:
                wa = r.router.registry.get(a.url)
                task = asyncio.ensure_future(post(s, r.url, path, body))
                while a.sent_events < 3:
                    await asyncio.sleep(0.01)
                async with s.post(r.url + "/remove_worker", params={"url": a.url}) as resp:
                    assert resp.status == 200, await resp.text()
                status, raw = await task
                got = read_answer("chat", raw)
                assert got["text"] == FULL and got["done"] == 1 and got["errors"] == [], raw.decode()
                assert a.aborted == [] and r.router.stats.migrations == 0
                assert (wa.failures, wa.breaker.state) == (0, "closed")
                for _ in range(100):  # its connection is closed once the answer ended, not kept in the pool
                    if a.answer_connections() == 0:
                        break
                    await asyncio.sleep(0.01)
                assert a.answer_connections() == 0
        finally:
            await a.close()

    with caplog.at_level(logging.INFO, "fleetserve.router"):
        run(main)
    msgs = no_failure_lines(caplog)
    assert len([m for m in msgs if "cannot move to another worker" in m]) == 1, msgs


@pytest.mark.timeout(60)
def test_batch_requests_are_not_migrated(InProcessRouter):
    """n > 1 cannot be continued as one answer: today's error event."""
    path, body = KINDS["completions"]

    async def main():
        async with fleet(InProcessRouter, "ab") as (s, r, (a, b)):
            a.die(after=2)
            status, raw = await post(s, r.url, path, {**body, "n": 2})
            got = read_answer("completions", raw)
            assert got["done"] == 0 and len(got["errors"]) == 1 and b.bodies == []
            await settled(s, r)

    run(main)


def test_max_migrations_flag(capsys):
    from fleetserve.router.config import parse_args

    assert parse_args([]).max_migrations == 1
    assert parse_args(["--migration-limit", "3"]).max_migrations == 3  # Dynamo's name
    with pytest.raises(SystemExit) as e:
        parse_args(["--max-migrations", "-1"])
    assert e.value.code == 2
    assert "--max-migrations must be >= 0" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_failure_after_done_needs_no_worker(InProcessRouter):
    path, body = KINDS["chat"]

    async def main():
        async with fleet(InProcessRouter, "ab") as (s, r, (a, b)):
            a.die(after=1000)  # [DONE], then a reset before the body's last chunk
            status, raw = await post(s, r.url, path, body)
            got = read_answer("chat", raw)
            assert got["text"] == FULL and got["done"] == 1 and got["last_is_done"], raw.decode()
            assert got["errors"] == [] and len(got["usage"]) == 1 and b.bodies == []
            assert r.router.stats.migrations == 0
            await settled(s, r)

    run(main)


@pytest.mark.timeout(60)
def test_a_refused_continuation_is_retried_without_counting(InProcessRouter):
    path, body = KINDS["generate_ids"]

    async def main():
        ws = [await ScriptWorker(n, SCRIPT).start() for n in "abc"]
        try:
            async with aiohttp.ClientSession() as s, InProcessRouter(**router_cfg([w.url for w in ws])) as r:
                r.router.policy._next = 0
                ws[0].die(after=DIE_AFTER_TOKENS)
                await ws[2].close()  # the policy's first choice for the continuation (turn 1 of [b, c]) is gone
                status, raw = await post(s, r.url, path, body)
                got = read_answer("generate_ids", raw)
                assert got["text"] == FULL and got["done"] == 1 and got["errors"] == [], raw.decode()
                assert len(ws[1].bodies) == 1 and r.router.stats.migrations == 1
                await settled(s, r)
        finally:
            for w in ws[:2]:
                await w.close()

    run(main)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["generate_ids", "chat"])
def test_dp_aware_continuation_carries_the_rank_the_policy_chose_on_the_new_worker(kind, InProcessRouter):
    """kv_aware --dp-aware: the first attempt goes to a's rank 0; a dies; the continuation goes to b with
    the rank kv_aware picks there (1: b's rank 0 is busy), in the body and the header, not a's rank or none."""
    from helpers.fake_kv_stream import two_ranks

    path, body = KINDS[kind]

    async def main():
        a = await ScriptWorker("a", SCRIPT).start()
        b = await ScriptWorker("b", SCRIPT).start()
        try:
            cfg = router_cfg([a.url, b.url], policy="kv_aware", dp_aware=True, kv_loads_interval_secs=0)
            async with aiohttp.ClientSession() as s, InProcessRouter(**cfg) as r:
                pol = r.router.policy
                two_ranks(pol, (a.url, b.url))
                pol.load_tokens[(b.url, 0)] = 10_000  # b's rank 0 is busy: a rank 0 first, then b rank 1
                a.die(after=die_after_events(kind, DIE_AFTER_TOKENS))
                status, raw = await post(s, r.url, path, body)
                assert status == 200, raw
                got = read_answer(kind, raw)
                assert got["errors"] == [] and got["text"] == FULL, (got, raw.decode())
                assert a.bodies[0][1]["routed_dp_rank"] == 0
                assert [p for p, _ in b.bodies] == [path]
                cont = b.bodies[0][1]
                assert cont["routed_dp_rank"] == 1 and cont["stream"] is True
                assert list(cont)[0] == "routed_dp_rank"  # put first: a client's own value would come later
                assert b.headers[0].get("x-data-parallel-rank") == "1"
                assert r.router.stats.migrations == 1
                await settled(s, r)
                assert pol.load_tokens == {(b.url, 0): 10_000}  # the continuation's charge came off too
        finally:
            await a.close()
            await b.close()

    run(main)


@pytest.mark.timeout(60)
def test_a_migrated_stream_moves_its_session_and_records_the_new_route(InProcessRouter, caplog):
    """--sticky-sessions: the session of a stream migrated from a to b points at b afterwards (its next
    request goes to b, a being healthy); the new route is logged, and b's prediction is judged."""
    import logging

    path, body = KINDS["completions"]
    key = {"x-smg-routing-key": "conv-7_t1"}
    urls = []

    async def main():
        async with fleet(InProcessRouter, "ab", sticky_sessions=True, policy="cache_aware") as (s, r, (a, b)):
            urls.extend([a.url, b.url])
            a.die(after=die_after_events("completions", DIE_AFTER_TOKENS))
            async with s.post(r.url + path, json={**body, "stream": True}, headers=key) as resp:
                assert resp.status == 200
                assert resp.headers["x-fleetserve-route"].startswith(f"target={a.url};")  # sent before a died
                raw = await resp.read()
            assert read_answer("completions", raw)["text"] == FULL
            assert [p for p, _ in b.bodies] == [path] and r.router.stats.migrations == 1
            assert r.router.sessions.lookup("conv-7") == b.url  # was a's
            async with s.post(r.url + path, json={**body, "stream": True}, headers={"x-smg-routing-key": "conv-7_t2"}) \
                    as resp:
                assert resp.status == 200
                assert resp.headers["x-fleetserve-route"].startswith(f"target={b.url};")
                assert "branch=session" in resp.headers["x-fleetserve-route"]
                await resp.read()
            assert len(a.bodies) == 1 and len(b.bodies) == 2
            preds = r.router.predictions.by_worker
            # b's continuation was judged (against the cached tokens the script worker reports), a's cut stream not
            assert (preds[b.url].count, preds[b.url].unreported) == (1, 0) and a.url not in preds
            await settled(s, r)

    with caplog.at_level(logging.INFO, "fleetserve.router"):
        run(main)
    moved = [rec.getMessage() for rec in caplog.records if "migration: stream moved" in rec.getMessage()]
    assert len(moved) == 1, moved
    m = re.fullmatch(r"migration: stream moved from (\S+) to (\S+) \(migration 1\); route: (.*)", moved[0])
    assert m, moved[0]
    assert m.groups()[:2] == tuple(urls)
    route = m.group(3)  # cache_aware's route of b: its branch and predicted cached tokens
    assert re.fullmatch(rf"target={re.escape(urls[1])}; dp_rank=-; branch=(hit|miss|balanced); cached_tokens=\d+; "
                        rf"prompt_tokens=\d+", route), route


@pytest.mark.timeout(60)
def test_a_migration_moves_the_requests_load_and_queued_prefill_at_once(InProcessRouter):
    """kv_aware: a dies after 3 tokens of /generate (ids [5, 6, 7], max_new_tokens 50).  At the moment
    the continuation is sent, a holds nothing of it (token load, queued prefill, in-flight count)
    and b counts its whole prefill as queued: 3 prompt + 3 generated tokens, none predicted cached
    there; its load is that plus the 47 tokens left to decode.  b's first event clears the queued
    prefill; the answer's end clears the rest."""
    path, body = KINDS["generate_ids"]

    async def main():
        a = await ScriptWorker("a", SCRIPT).start()
        b = await ScriptWorker("b", SCRIPT, delay_s=0.05).start()
        try:
            cfg = router_cfg([a.url, b.url], policy="kv_aware", kv_loads_interval_secs=0)
            async with aiohttp.ClientSession() as s, InProcessRouter(**cfg) as r:
                pol, reg, pool = r.router.policy, r.router.registry, r.router.pool
                seen = {}
                post0 = pool.post

                async def post(url, *args, **kw):
                    if url == b.url:  # the continuation leaves now: the state at the moment of migration
                        seen["sent"] = (dict(pol.load_tokens), dict(pol.queued_tokens),
                                        reg.get(a.url).load, reg.get(b.url).load)
                    return await post0(url, *args, **kw)

                pool.post = post
                a.die(after=die_after_events("generate_ids", DIE_AFTER_TOKENS))
                async with s.post(r.url + path, json={**body, "stream": True}) as resp:
                    raw = b""
                    while b"data: [DONE]" not in raw:
                        raw += await resp.content.readany()
                        if "mid" not in seen and raw.count(b"data: ") >= DIE_AFTER_TOKENS + 2 \
                                and b"data: [DONE]" not in raw:
                            # b's events stream (one every 50 ms): its prefill is over, its decode is not
                            seen["mid"] = (dict(pol.load_tokens), dict(pol.queued_tokens),
                                           reg.get(a.url).load, reg.get(b.url).load)
                assert read_answer("generate_ids", raw)["text"] == FULL
                assert [p for p, _ in b.bodies] == [path] and r.router.stats.migrations == 1
                assert seen["sent"] == ({(b.url, None): 6 + 47}, {(b.url, None): 6}, 0, 1)
                assert seen["mid"] == ({(b.url, None): 6 + 47}, {}, 0, 1)
                await settled(s, r)
                assert (pol.load_tokens, pol.queued_tokens, pol.inflight) == ({}, {}, {})
        finally:
            await a.close()
            await b.close()

    run(main)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_chunk_of_several_tokens_is_counted_from_the_usage(kind, InProcessRouter):
    """Workers stream two tokens per chunk (an engine's ``--stream-interval 2``) and the client asks for
    7 tokens.  ``a`` dies after two chunks (4 tokens): the continuation must ask for 3 more, and the
    client gets exactly 7 tokens with ``completion_tokens`` 7.  Counting one token per chunk (the old
    way) asked ``b`` for 5 and gave the client 9 (a user trial saw ``completion_tokens`` above
    ``max_tokens`` on a migrated stream)."""
    path, body = KINDS[kind]
    body = {**body, "max_tokens": 7}

    async def main():
        async with fleet(InProcessRouter, "ab", {"tokens_per_chunk": 2}) as (s, r, (a, b)):
            a.die(after=die_after_events(kind, 2))
            status, raw = await post(s, r.url, path, body)
            assert status == 200, raw
            got = read_answer(kind, raw)
            assert got["errors"] == [] and got["text"] == "".join(SCRIPT[:7]), got
            assert got["finish"] == ["length"] and got["done"] == 1, got
            assert got["usage"] == [(PROMPT_TOKENS, 7, PROMPT_TOKENS + 7)], got
            assert b.bodies[0][1]["max_tokens"] == 3
            # both workers were asked for the usage in every chunk
            for w in (a, b):
                assert w.bodies[0][1]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
            await settled(s, r)

    run(main)


def _usage_shapes(raw: bytes) -> tuple[int, int, list]:
    """(chunks with choices that carry a usage, chunks with choices, usage of the usage-only chunks)."""
    with_usage = with_choices = 0
    alone = []
    for e in events(raw):
        if e == "[DONE]":
            continue
        obj = json.loads(e)
        if obj.get("choices"):
            with_choices += 1
            with_usage += "usage" in obj
        else:
            u = obj["usage"]
            alone.append((u["prompt_tokens"], u["completion_tokens"]))
    return with_usage, with_choices, alone


@pytest.mark.timeout(60)
@pytest.mark.parametrize("migrates", [False, True])
@pytest.mark.parametrize("asked", ["nothing", "include_usage", "continuous"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_the_client_gets_only_the_usage_it_asked_for(kind, asked, migrates, InProcessRouter):
    """The router asks every worker for the usage in every chunk; the client sees what it asked for:
    nothing (no ``usage`` anywhere, no usage-only chunk), the last chunk (``include_usage``), or the
    usage in every chunk too (``continuous_usage_stats``), with and without a migration."""
    path, body = KINDS[kind]
    body = {k: v for k, v in body.items() if k != "stream_options"}
    if asked == "include_usage":
        body["stream_options"] = {"include_usage": True}
    elif asked == "continuous":
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}

    async def main():
        async with fleet(InProcessRouter, "ab") as (s, r, (a, b)):
            if migrates:
                a.die(after=die_after_events(kind, DIE_AFTER_TOKENS))
            status, raw = await post(s, r.url, path, body)
            assert status == 200, raw
            got = read_answer(kind, raw)
            assert got["text"] == FULL and got["errors"] == [], got
            with_usage, with_choices, alone = _usage_shapes(raw)
            assert with_usage == (with_choices if asked == "continuous" else 0), raw.decode()
            assert alone == ([] if asked == "nothing" else [(PROMPT_TOKENS, len(SCRIPT))]), raw.decode()
            assert a.bodies[0][1]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
            assert bool(b.bodies) == migrates
            await settled(s, r)

    run(main)


ASKED = {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("raw, expect", [
    # no stream_options: put first, the rest byte for byte (an integer past 64 bits is not rounded)
    (b'{"model":"m","prompt":"hi","stream":true,"seed":123456789012345678901234567890}',
     b'{"stream_options":{"include_usage":true,"continuous_usage_stats":true},"model":"m","prompt":"hi",'
     b'"stream":true,"seed":123456789012345678901234567890}'),
    (b' {"prompt":"hi"} ', b' {"stream_options":{"include_usage":true,"continuous_usage_stats":true},"prompt":"hi"} '),
])
def test_the_first_workers_body_keeps_the_clients_bytes(raw, expect):
    from fleetserve.router.migration import Migration

    body = json.loads(raw)
    mig = Migration(None, "/v1/completions", body, None, b"", 1)
    out = mig.upstream_body(raw)
    assert out == expect
    assert json.loads(out) == {**body, "stream_options": ASKED}


@pytest.mark.parametrize("so, sent", [
    (None, ASKED),  # null: written anew, so no later null wins over it
    ({"include_usage": True}, ASKED),
    ({"include_usage": False, "continuous_usage_stats": True}, ASKED),
    ({"include_usage": True, "extra": 1}, {**ASKED, "extra": 1}),
    ({"include_usage": True, "continuous_usage_stats": True}, "as is"),  # the client asked for it all
    ("x", "as is"), ([], "as is"), ({"include_usage": 1}, "as is"),  # the worker's 400 is the client's answer
    ({"include_usage": True, "continuous_usage_stats": "true"}, "as is"),
])
def test_the_clients_stream_options_are_added_to_or_left_for_the_worker_to_refuse(so, sent):
    """A user trial saw ``stream_options: "x"`` answered 200 through the router (the options replaced) where
    the worker answers 400: a value the worker would refuse is now sent as the client wrote it."""
    from fleetserve.router.migration import Migration

    for path in ("/v1/completions", "/v1/chat/completions"):
        body = {"model": "m", "stream": True, "stream_options": so}
        raw = json.dumps(body).encode()
        out = Migration(None, path, body, None, b"", 1).upstream_body(raw)
        if sent == "as is":
            assert out is None
        else:
            assert json.loads(out) == {**body, "stream_options": sent}
    body = {"text": "hi", "stream": True}
    assert Migration(None, "/generate", body, None, b"", 1).upstream_body(json.dumps(body).encode()) is None


@pytest.mark.timeout(60)
def test_a_stream_options_the_worker_would_refuse_reaches_it_unchanged(InProcessRouter):
    path, body = KINDS["completions"]
    body = {**body, "stream_options": {"include_usage": 1}}

    async def main():
        async with fleet(InProcessRouter, "a") as (s, r, (a,)):
            status, raw = await post(s, r.url, path, body)
            assert a.bodies[0][1]["stream_options"] == {"include_usage": 1}
            await settled(s, r)

    run(main)
