"""``fleetserve serve --dp-size 2 --page-size 16 --kv-events-config``, read by a subscriber in this
(another) process over real ZMQ, at the endpoints a router derives from ``/get_server_info``.

* ``BlockStored`` carries exactly the prompt's whole 16-token pages after the
  prefill, then the whole pages of prompt + output at the end; ``block_size``
  16; the hashes are SGLang's chained page hash of those tokens;
* a request routed to a DP rank (``routed_dp_rank`` in the body, vLLM's
  ``X-data-parallel-rank`` header) shows up only on that rank's stream, with
  that ``data_parallel_rank`` in every batch;
* ``/flush_cache`` gives ``AllBlocksCleared`` on every rank.
"""

import json
import os
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_parallel_serve import _start  # noqa: E402

from fleetserve.engine.page_hash import page_hashes  # noqa: E402
from fleetserve.router.kv_events.sources import endpoints_from_info  # noqa: E402
from helpers.kv_events_sub import Subscriber, batch_of, free_port_block, seq_of  # noqa: E402

PS = 16
N_NEW = 30
PROMPTS = {1: [256] + [(7 * i) % 200 + 10 for i in range(39)],  # 40 tokens: 2 whole pages + 8
           0: [256] + [(11 * i) % 200 + 3 for i in range(20)]}  # 21 tokens: 1 whole page + 5


def _generate(base, ids, rank, how):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}}
    headers = {}
    if how == "body":
        body["routed_dp_rank"] = rank
    else:
        headers["X-data-parallel-rank"] = str(rank)
    deadline = time.monotonic() + 5
    while True:
        r = httpx.post(f"{base}/generate", json=body, headers=headers, timeout=60)
        if r.status_code != 503 or time.monotonic() > deadline:  # the relay may still be connecting
            assert r.status_code == 200, r.text
            return r.json()["output_ids"]
        time.sleep(0.05)


def _batches(sub, quiet_s=1.0):
    return [(seq_of(m), batch_of(m)) for m in sub.drain(quiet_s)]


def _flush_until_heard(base, subs, timeout_s=30.0):
    """POST /flush_cache until every subscriber has an AllBlocksCleared (ZMQ's slow joiner)."""
    deadline = time.monotonic() + timeout_s
    heard = set()
    while len(heard) < len(subs):
        assert time.monotonic() < deadline, f"subscribers {set(range(len(subs))) - heard} heard nothing"
        assert httpx.post(f"{base}/flush_cache", timeout=10).status_code == 200
        for r, s in enumerate(subs):
            m = s.recv(0.2)
            if m is not None:
                assert batch_of(m)[1] == [{"type": "AllBlocksCleared"}] and batch_of(m)[2] == r
                heard.add(r)
    time.sleep(0.3)
    for s in subs:
        s.drain(0.3)


def test_paged_events_per_routed_rank_and_flush(tiny_llama_dir, tmp_path):
    ev = free_port_block(4)  # PUB ev, ev + 1; replay ev + 2, ev + 3
    cfg = json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{ev + 2}",
                      "topic": "kv@p16"})
    proc, port = _start(tiny_llama_dir, str(tmp_path / "serve.log"), "--dp-size", "2", "--page-size", str(PS),
                        "--kv-events-config", cfg)
    base = f"http://127.0.0.1:{port}"
    subs = []
    try:
        info = httpx.get(f"{base}/get_server_info", timeout=10).json()
        assert info["kv_events_config"] == cfg  # the flag's JSON text, as SGLang reports it
        assert info["page_size"] == PS and info["dp_size"] == 2
        eps = endpoints_from_info(info, base)
        assert eps == [(0, f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{ev + 2}", "kv@p16"),
                       (1, f"tcp://127.0.0.1:{ev + 1}", f"tcp://127.0.0.1:{ev + 3}", "kv@p16")]
        subs = [Subscriber(ep, topic.encode()) for _, ep, _, topic in eps]
        _flush_until_heard(base, subs)

        for rank, how in ((1, "body"), (0, "header")):
            prompt = PROMPTS[rank]
            out = _generate(base, prompt, rank, how)
            assert len(out) == N_NEW
            mine = _batches(subs[rank])
            other = _batches(subs[1 - rank], 0.2)
            assert other == [], f"rank {1 - rank} published for a request routed to rank {rank}"
            seqs = [s for s, _ in mine]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap
            assert all(b[2] == rank for _, b in mine)  # data_parallel_rank
            stored = [e for _, b in mine for e in b[1]]
            assert all(e["type"] == "BlockStored" and e["block_size"] == PS for e in stored), stored
            whole = len(prompt) // PS * PS
            first = stored[0]
            assert first["token_ids"] == prompt[:whole] and first["parent_block_hash"] is None
            assert first["block_hashes"] == page_hashes(prompt[:whole], PS)
            # at the end: the whole pages of prompt + output[:-1] (the last output has no KV yet)
            computed = prompt + out[:-1]
            full = len(computed) // PS * PS
            assert [t for e in stored for t in e["token_ids"]] == computed[:full]
            assert [h for e in stored for h in e["block_hashes"]] == page_hashes(computed[:full], PS)
            for a, b in zip(stored, stored[1:]):
                assert b["parent_block_hash"] == a["block_hashes"][-1]

        assert httpx.post(f"{base}/flush_cache", timeout=10).status_code == 200
        for rank, s in enumerate(subs):
            got = _batches(s)
            assert [b[1] for _, b in got] == [[{"type": "AllBlocksCleared"}]] and got[0][1][2] == rank
    finally:
        for s in subs:
            s.close()
        proc.terminate()
        proc.wait(20)
