"""``fleetserve serve --dp-size 2 --kv-events-config``: each DP rank's process publishes on base port + rank."""

import json
import os
import re
import sys
import time
import urllib.request

import msgpack

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_parallel_serve import _generate, _start  # noqa: E402

from helpers.kv_events_sub import Subscriber, batch_of, free_port_block, replay  # noqa: E402

PROMPTS = [[256, 72, 101, 108, 108], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def test_dp2_ranks_publish_their_own_events(tiny_llama_dir, tmp_path):
    base = free_port_block(4)  # PUB base, base + 1; replay base + 2, base + 3
    cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{base}", "replay_endpoint": f"tcp://*:{base + 2}",
           "topic": "kv@serve"}
    proc, port = _start(tiny_llama_dir, str(tmp_path / "serve.log"), "--dp-size", "2",
                        "--kv-events-config", json.dumps(cfg))
    subs = [Subscriber(f"tcp://127.0.0.1:{base + r}", b"kv@serve") for r in (0, 1)]
    try:
        time.sleep(1.0)  # let the subscriptions reach the ranks' PUB sockets (ZMQ's slow joiner)
        for ids in PROMPTS:  # round robin: the first to DP rank 0, the second to DP rank 1
            _generate(port, ids)
        for r in (0, 1):
            # live stream, or (had the subscription been late) the replay socket: the same batches
            msgs = subs[r].drain(1.0)
            batches = [batch_of(m) for m in msgs] if msgs else [
                msgpack.unpackb(m[2]) for m in replay(f"tcp://127.0.0.1:{base + 2 + r}", 0)[:-1]]
            assert batches and all(b[2] == r for b in batches)
            stored = [e for b in batches for e in b[1] if e["type"] == "BlockStored"]
            assert stored[0]["token_ids"] == PROMPTS[r] and stored[0]["parent_block_hash"] is None
            assert stored[0]["medium"] == "GPU" and stored[0]["block_size"] == 1
            if msgs:
                assert [int.from_bytes(m[1], "big") for m in msgs] == list(range(len(msgs)))  # seq from 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        published = float(re.search(r"^fleetserve:kv_events_published_total\{[^}]*\} (\S+)$", text, re.M).group(1))
        dropped = float(re.search(r"^fleetserve:kv_events_dropped_total\{[^}]*\} (\S+)$", text, re.M).group(1))
        assert published >= 4 and dropped == 0  # at least prompt + finish on each rank
    finally:
        for s in subs:
            s.close()
        proc.terminate()
        proc.wait(20)
