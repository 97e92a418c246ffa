"""``fleetserve bench --workload multi_turn`` sends the model's own answers back: a recording
fake worker checks that each turn's request holds the previous turn's request, then the text
the worker answered to it, then the new question."""

import json

import pytest
from aiohttp import web

from fleetserve.bench import cli as bench_cli
from fleetserve.bench.client import run_requests
from fleetserve.bench.workloads import multi_turn


class RecordingWorker:
    """Answers ``reply-<n>`` (n counts the requests it got, so no answer is guessable) on
    both OpenAI routes, streaming or not; keeps every body it received. A question whose
    first word is in ``fail_on`` gets a 500."""

    def __init__(self, fail_on: tuple[str, ...] = ()):
        self.bodies: list[dict] = []
        self.fail_on = fail_on
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.handle)
        self.app.router.add_post("/v1/completions", self.handle)

    async def handle(self, req: web.Request) -> web.StreamResponse:
        body = await req.json()
        self.bodies.append(body)
        last = body["messages"][-1]["content"] if "messages" in body else body["prompt"].split("\n\n")[-1]
        if last.split()[0] in self.fail_on:
            return web.json_response({"error": {"message": "boom", "type": "internal_server_error"}}, status=500)
        answer = f"reply-{len(self.bodies)} to {last.split()[0]}"
        chat = "messages" in body
        usage = {"prompt_tokens": 10, "completion_tokens": 2}
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": answer}} if chat else \
                {"index": 0, "text": answer}
            return web.json_response({"choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for piece in (answer[:6], answer[6:]):  # two chunks: the client must join them
            delta = {"delta": {"content": piece}} if chat else {"text": piece}
            await resp.write(b"data: " + json.dumps({"choices": [{"index": 0, **delta}]}).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        return resp


async def _serve(worker):
    runner = web.AppRunner(worker.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [True, False])
async def test_each_turn_carries_the_previous_real_answer(stream):
    w = RecordingWorker()
    runner, url = await _serve(w)
    reqs = multi_turn(num_conversations=3, num_turns=3, question_len=4, output_len=5, seed=2, replies="real")
    try:
        results, _ = await run_requests(url, reqs, stream=stream, progress=False, timeout_s=30)
    finally:
        await runner.cleanup()
    assert [r.success for r in results] == [True] * 9
    answers = {r.rid: r.text for r in results}  # what the client read back
    assert sorted(answers.values()) == sorted(
        f"reply-{n} to {b['messages'][-1]['content'].split()[0]}" for n, b in enumerate(w.bodies, 1))
    sent = {}
    for b in w.bodies:  # map each received body to its request by its last question
        q = b["messages"][-1]["content"]
        sent[next(r.rid for r in reqs if r.messages[-1]["content"] == q)] = b["messages"]
    synthetic = {r.rid: r for r in multi_turn(num_conversations=3, num_turns=3, question_len=4, output_len=5, seed=2)}
    for c in range(3):
        assert sent[f"c{c}-t0"] == synthetic[f"c{c}-t0"].messages
        for t in (1, 2):
            prev, cur = f"c{c}-t{t - 1}", f"c{c}-t{t}"
            assert answers[prev].startswith("reply-")
            assert sent[cur] == [*sent[prev], {"role": "assistant", "content": answers[prev]},
                                 synthetic[cur].messages[-1]]  # same questions as the synthetic mode


@pytest.mark.timeout(60)
async def test_completions_api_prompt_holds_the_previous_answer():
    w = RecordingWorker()
    runner, url = await _serve(w)
    reqs = multi_turn(num_conversations=1, num_turns=2, question_len=4, output_len=5, seed=3, replies="real")
    try:
        results, _ = await run_requests(url, reqs, api="completions", progress=False, timeout_s=30)
    finally:
        await runner.cleanup()
    first, second = w.bodies
    assert second["prompt"] == "\n\n".join([first["prompt"], results[0].text, reqs[1].messages[0]["content"]])
    assert results[0].text == f"reply-1 to {reqs[0].messages[0]['content'].split()[0]}"


@pytest.mark.timeout(60)
async def test_failed_turn_ends_its_conversation_only():
    reqs = multi_turn(num_conversations=2, num_turns=3, question_len=4, output_len=5, seed=4, replies="real")
    bad = next(r for r in reqs if r.rid == "c0-t1").messages[-1]["content"].split()[0]
    assert all(r.messages[-1]["content"].split()[0] != bad for r in reqs if r.rid != "c0-t1")
    w = RecordingWorker(fail_on=(bad,))
    runner, url = await _serve(w)
    try:
        results, _ = await run_requests(url, reqs, progress=False, timeout_s=30)
    finally:
        await runner.cleanup()
    by = {r.rid: r for r in results}
    assert by["c0-t1"].status == 500 and not by["c0-t1"].success
    assert by["c0-t2"].error == "previous turn c0-t1 failed" and by["c0-t2"].status == 0
    assert all(by[f"c1-t{t}"].success for t in range(3))
    assert len(w.bodies) == 5  # c0-t2 was never sent


@pytest.mark.timeout(60)
async def test_cli_default_is_real_and_synthetic_stays_available():
    w = RecordingWorker()
    runner, url = await _serve(w)
    common = ["--base-url", url, "--workload", "multi_turn", "--num-conversations", "1", "--num-turns", "2",
              "--question-len", "3", "--output-len", "4", "--disable-tqdm"]
    try:
        summary, _ = await bench_cli.run_bench(bench_cli.build_parser().parse_args(common))
        assert summary["meta"]["multi_turn_replies"] == "real"
        assert w.bodies[1]["messages"][1]["content"].startswith("reply-1 to ")
        w.bodies.clear()
        args = bench_cli.build_parser().parse_args(common + ["--multi-turn-replies", "synthetic"])
        summary, _ = await bench_cli.run_bench(args)
        assert summary["meta"]["multi_turn_replies"] == "synthetic"
        answer = w.bodies[1]["messages"][1]["content"]
        assert not answer.startswith("reply-") and len(answer.split()) == 4  # --output-len words from the seed
    finally:
        await runner.cleanup()
