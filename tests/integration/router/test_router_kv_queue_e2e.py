"""``--router-queue-threshold`` in a real router in front of a ``fleetserve sim-worker``: the router
reads the worker's prefill budget from its ``/get_server_info`` (``chunked_prefill_size``), and
while the worker's queued prefill is over threshold x budget, later requests wait in the router
(counted in ``/metrics``) and are answered once the first request's prefill ended."""

import json
import re
import threading
import time
import urllib.request

import pytest

# a prompt's prefill takes 10 ms a token (0.6 s for these), decode steps 1 ms; 64 prefill tokens per step
SLOW_PREFILL = ["--prefill-per-token-s", "0.01", "--prefill-overhead-s", "0", "--decode-base-s", "0.001",
                "--decode-per-req-s", "0", "--decode-per-ctx-token-s", "0", "--chunked-prefill-size", "64",
                "--tokenizer", "smollm2"]
# distinct from their first token (nothing cached for one another), 62 tokens each (SmolLM2's): over the 32
PROMPTS = [f"Log {i}. " + "The keeper of the lighthouse wrote in his log every night about the ships, the storms "
           "and the gulls that circled the lamp before dawn, and about the supply boat that came on Thursdays "
           "with flour, oil, letters and news from the mainland that was always a week old." for i in range(3)]


def metrics(url):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def value(text, name):
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


@pytest.mark.timeout(120)
def test_requests_wait_in_the_router_while_the_worker_is_over_its_prefill_budget(procs):
    from fleetserve.models.tokenizer import tokenizer_dir

    sim = procs.sim_with_events(*SLOW_PREFILL)
    with urllib.request.urlopen(sim + "/get_server_info", timeout=10) as r:
        assert json.loads(r.read())["chunked_prefill_size"] == 64
    # threshold 0.5: busy over 32 queued prefill tokens (the default budget, 8192, would hold nothing)
    router, rp = procs.router([sim], "--policy", "kv_aware", "--tokenizer-path", tokenizer_dir(),
                              "--router-queue-threshold", "0.5", "--kv-loads-interval-secs", "0")
    deadline = time.monotonic() + 20
    while f'stream_state{{dp_rank="0",state="fallback",worker="{sim}"}}' not in metrics(router):
        assert time.monotonic() < deadline, "no subscription (so no /get_server_info read yet)"
        time.sleep(0.1)
    answers = {}

    def send(i):
        body = {"prompt": PROMPTS[i], "max_tokens": 2, "stream": True}
        req = urllib.request.Request(router + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=60) as r:
            r.readline()
            first = time.monotonic() - t0
            rest = r.read().decode()
            answers[i] = (r.status, first, rest)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    threads[0].start()
    time.sleep(0.3)  # the first is routed: its 62 queued prefill tokens are over the 32 allowed
    for t in threads[1:]:
        t.start()
    time.sleep(0.3)
    waiting = value(metrics(router), "fleetserve_router_kv_router_queue_pending_requests")
    for t in threads:
        t.join(timeout=60)
    assert sorted(answers) == [0, 1, 2]
    assert all(status == 200 and "[DONE]" in rest for status, _, rest in answers.values()), answers
    assert waiting == 2.0  # both later requests waited in the router, not in the engine
    text = metrics(router)
    assert value(text, "fleetserve_router_kv_router_queue_held_total") == 2.0
    assert value(text, "fleetserve_router_kv_router_queue_pending_requests") == 0.0
    assert value(text, "fleetserve_router_kv_router_queue_wait_seconds_total") > 0.5
    # the two that waited were let go one at a time, each once the prefill ahead of it had ended
    later = sorted(answers[i][1] for i in (1, 2))
    assert later[0] > 0.2 and later[1] - later[0] > 0.4, answers
    rp.terminate()
