"""kv_aware in front of a worker that answers loads as vLLM does (``fleetserve sim-worker --loads-api
vllm``: no ``/v1/loads``, vLLM's per-engine gauges on ``/metrics``): the router reads the running
request's KV from those gauges, on the DP rank the route header named, and shows it in its own
``/metrics`` as the engine's load."""

import json
import re
import time
import urllib.error
import urllib.request

import pytest

# 2 DP ranks of 62 pages of 16 tokens; 50 ms decode steps, so a 200-token answer runs for 10 s
SIM = ["--loads-api", "vllm", "--max-total-tokens", "1000", "--page-size", "16",
       "--chunked-prefill-size", "64", "--tokenizer", "smollm2", "--prefill-per-token-s", "0",
       "--prefill-overhead-s", "0", "--decode-base-s", "0.05", "--decode-per-req-s", "0",
       "--decode-per-ctx-token-s", "0"]
PROMPT = ("The keeper of the lighthouse wrote in his log every night about the ships, the storms and the "
          "gulls that circled the lamp before dawn.")


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


@pytest.mark.timeout(120)
def test_the_engine_load_of_a_vllm_worker_comes_from_its_metrics_gauges(procs):
    from fleetserve.models.tokenizer import tokenizer_dir

    sim = procs.sim_with_events(*SIM, dp_size=2)
    with pytest.raises(urllib.error.HTTPError) as e:  # as vLLM: no /v1/loads
        get(sim + "/v1/loads")
    assert e.value.code == 404
    router, rp = procs.router([sim], "--policy", "kv_aware", "--tokenizer-path", tokenizer_dir(), "--dp-aware",
                              "--kv-loads-interval-secs", "0.2")
    body = {"prompt": PROMPT, "max_tokens": 200, "stream": True}
    req = urllib.request.Request(router + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        route = dict(p.split("=", 1) for p in r.headers["x-fleetserve-route"].split("; "))
        rank = int(route["dp_rank"])
        r.readline()  # its first chunk: the request runs on that rank, holding its prompt's pages
        stats = json.loads(get(sim + "/get_server_info"))["scheduler_stats"]
        used = stats[rank]["kv_used_tokens"]
        assert used > 0 and stats[1 - rank]["kv_used_tokens"] == 0
        want = {(str(rank), used), (str(1 - rank), 0)}
        pat = re.compile(r'^fleetserve_router_kv_engine_load_tokens\{dp_rank="(\d)",worker="%s"\} (\S+)$'
                         % re.escape(sim), re.M)
        deadline = time.monotonic() + 10
        while True:
            seen = {(d, int(float(v))) for d, v in pat.findall(get(router + "/metrics"))}
            if seen == want or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert seen == want
        r.read()
    rp.terminate()
