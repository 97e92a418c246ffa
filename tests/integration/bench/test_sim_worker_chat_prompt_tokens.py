"""A sim-worker's chat prompt is the engine's: ``--tokenizer smollm2`` gives the ids (and
``usage.prompt_tokens``) the router's tokenizer gives, whatever ``add_generation_prompt``,
``continue_final_message`` and ``chat_template_kwargs`` say.

Before, the sim always rendered with the generation prompt: a ``continue_final_message``
request counted 6 tokens more than the engine, and a kv_aware router took the worker for one
with another tokenizer (``fleetserve_router_kv_tokenizer_mismatch``); a migrated chat stream,
which continues with ``continue_final_message``, reported 6 prompt tokens too many.
"""

import asyncio
import socket

import aiohttp
import pytest

from fleetserve.bench import sim_worker
from fleetserve.bench.sim_tokenizer import make_tokenizer
from fleetserve.entrypoints.openai_protocol import ChatCompletionRequest
from fleetserve.entrypoints.request_parse import parse_model

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
TALK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue is"}]
BODIES = {
    "plain": {"messages": USER},
    "no generation prompt": {"messages": USER, "add_generation_prompt": False},
    "continue a user message": {"messages": USER, "continue_final_message": True, "add_generation_prompt": False},
    "continue an assistant message": {"messages": TALK, "continue_final_message": True,
                                      "add_generation_prompt": False},
    "continue, generation prompt left on": {"messages": TALK, "continue_final_message": True},
    "chat_template_kwargs": {"messages": TALK[:2], "chat_template_kwargs": {"enable_thinking": False}},
}


@pytest.fixture(scope="module")
def router_tokenizer():
    from fleetserve.models.tokenizer import tokenizer_dir
    from fleetserve.router.kv_events.tokenize import RouterTokenizer

    return RouterTokenizer(tokenizer_dir())


@pytest.fixture(scope="module")
def smollm2():
    return make_tokenizer("smollm2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sim_ids(tok, body: dict) -> list[int]:
    return sim_worker.chat_prompt_ids(tok, parse_model(ChatCompletionRequest, body))


@pytest.mark.parametrize("name", list(BODIES))
def test_sim_chat_ids_are_the_router_tokenizers(smollm2, router_tokenizer, name):
    body = BODIES[name]
    ours = sim_ids(smollm2, body)
    assert ours == router_tokenizer.request_ids(CHAT, body) and len(ours) > 5


def test_a_continued_answer_counts_as_its_prompt_plus_the_answer(smollm2):
    """What a migration sends: the answer so far as a final assistant message to continue."""
    answer = " time year people"
    cont = {"messages": [*USER, {"role": "assistant", "content": answer}], "continue_final_message": True,
            "add_generation_prompt": False}
    assert len(sim_ids(smollm2, cont)) == len(sim_ids(smollm2, BODIES["plain"])) + len(smollm2.encode(answer))
    word = make_tokenizer("word")  # the word tokenizer: the continuation extends the prompt's ids exactly
    assert sim_ids(word, cont) == sim_ids(word, BODIES["plain"]) + word.encode(answer)


@pytest.mark.timeout(120)
async def test_sim_worker_smollm2_reports_the_router_tokenizers_prompt_tokens(router_tokenizer):
    port = free_port()
    args = sim_worker.build_parser().parse_args([
        "--port", str(port), "--num-workers", "1", "--tokenizer", "smollm2",
        "--prefill-per-token-s", "0", "--prefill-overhead-s", "0", "--decode-base-s", "0.001",
        "--decode-per-req-s", "0", "--decode-per-ctx-token-s", "0"])
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(sim_worker.serve(args, ready, stop))
    try:
        await asyncio.wait_for(ready.wait(), 90)
        got, want = {}, {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            for name, body in BODIES.items():
                async with s.post(f"http://127.0.0.1:{port}{CHAT}", json={**body, "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
                    got[name] = (await r.json())["usage"]["prompt_tokens"]
                want[name] = len(router_tokenizer.request_ids(CHAT, body))
        assert got == want
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
