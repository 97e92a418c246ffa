"""A KV-event publisher written from vLLM's and SGLang's ``ZmqEventPublisher`` layouts, run as its own process.

Run: ``python kv_publisher.py --layout sglang|vllm [--ranks N] [--replay] [--block-size B]``.
It binds a PUB socket per DP rank on ``base + rank`` (and with ``--replay`` a
ROUTER replay socket per rank on ``replay_base + rank``), prints one JSON line
``{"endpoint": "tcp://*:BASE", "replay_endpoint": "tcp://*:RBASE" | null}``,
then takes one JSON command per stdin line and answers ``{"ok": true}`` after
it is published:

* ``{"op": "store", "rank": r, "tokens": [...]}``: BlockStored for the full blocks
  of ``tokens`` the rank does not hold yet (parent = the block before them);
* ``{"op": "remove", "rank": r, "tokens": [...]}``: BlockRemoved for the full blocks held;
* ``{"op": "clear", "rank": r}``: AllBlocksCleared;
* ``{"op": "drop", "rank": r, "n": k}``: the next ``k`` batches are numbered and kept
  for replay but not published (a gap on the live stream);
* ``{"op": "malformed", "rank": r, "n": k}``: ``k`` messages that are not KV-event batches;
* ``{"op": "flood", "rank": r, "n": k}``: ``k`` batches of one stored block of fresh tokens.

Layouts: ``sglang``: msgspec ``array_like`` batches ``[ts, events, rank]`` and
positional events with the tag first, block hashes as signed int64 (Python
``hash`` of the block's tokens and parent, as SGLang's radix cache does);
``vllm``: map batches ``{"ts", "events", "data_parallel_rank"}`` and tagged map
events, block hashes as 32-byte sha256 digests (vLLM's ``ExternalBlockHash``).
"""

import argparse
import hashlib
import json
import socket
import sys
import time

import msgpack
import zmq


def bind_consecutive(ctx, kind, n):
    """``n`` sockets of ``kind`` bound on consecutive free loopback ports; returns (sockets, base)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        socks = []
        try:
            for r in range(n):
                sk = ctx.socket(kind)
                sk.setsockopt(zmq.LINGER, 0)
                socks.append(sk)
                sk.bind(f"tcp://127.0.0.1:{base + r}")
            return socks, base
        except zmq.ZMQError:
            for sk in socks:
                sk.close(0)
    raise RuntimeError("no consecutive free ports")


class Rank:
    def __init__(self, layout, rank, bs, pub, replay):
        self.layout, self.rank, self.bs, self.pub, self.replay = layout, rank, bs, pub, replay
        self.seq = 0
        self.buffer = []
        self.held = {}  # chain of block tuples -> engine hash
        self.drop = 0
        self.fresh = 10_000_000 + rank * 1_000_000

    def block_hash(self, parent, block):
        if self.layout == "sglang":
            return hash((parent, block))  # signed int64, as Python's hash()
        prev = parent if parent is not None else b""
        return hashlib.sha256(prev + repr(block).encode()).digest()

    def event(self, tag, **f):
        if self.layout == "sglang":
            if tag == "BlockStored":
                return [tag, f["block_hashes"], f["parent_block_hash"], f["token_ids"], f["block_size"], None]
            if tag == "BlockRemoved":
                return [tag, f["block_hashes"]]
            return [tag]
        ev = {"type": tag, **f}
        if tag == "BlockStored":
            ev.update(lora_id=None, medium="GPU", lora_name=None, extra_keys=None, group_idx=0,
                      kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None)
        elif tag == "BlockRemoved":
            ev.update(medium="GPU", group_idx=0)
        return ev

    def publish(self, events):
        if self.layout == "sglang":
            payload = msgpack.packb([time.time(), events, self.rank])
        else:
            payload = msgpack.packb({"ts": time.time(), "events": events, "data_parallel_rank": self.rank})
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if self.drop:
            self.drop -= 1
            return
        self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def blocks(self, tokens):
        n = len(tokens) // self.bs
        return [tuple(tokens[:(i + 1) * self.bs]) for i in range(n)]

    def store(self, tokens):
        hashes, new_toks, parent = [], [], None
        for chain in self.blocks(tokens):
            if chain in self.held:
                if not hashes:
                    parent = self.held[chain]
                continue
            prev = self.held.get(chain[:-self.bs]) if len(chain) > self.bs else None
            h = self.block_hash(prev, chain[-self.bs:])
            self.held[chain] = h
            hashes.append(h)
            new_toks.extend(chain[-self.bs:])
        if hashes:
            self.publish([self.event("BlockStored", block_hashes=hashes, parent_block_hash=parent,
                                     token_ids=new_toks, block_size=self.bs)])

    def remove(self, tokens):
        hashes = [self.held.pop(c) for c in self.blocks(tokens) if c in self.held]
        if hashes:
            self.publish([self.event("BlockRemoved", block_hashes=hashes)])

    def serve_replay(self):
        while self.replay is not None and self.replay.poll(0):
            frames = self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            start = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= start:
                    self.replay.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            self.replay.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=("sglang", "vllm"), required=True)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--replay", action="store_true")
    ap.add_argument("--block-size", type=int, default=4)
    a = ap.parse_args()
    ctx = zmq.Context()
    pubs, base = bind_consecutive(ctx, zmq.PUB, a.ranks)
    for p in pubs:
        p.setsockopt(zmq.SNDHWM, 1_000_000)
    reps, rbase = bind_consecutive(ctx, zmq.ROUTER, a.ranks) if a.replay else ([None] * a.ranks, None)
    ranks = [Rank(a.layout, r, a.block_size, pubs[r], reps[r]) for r in range(a.ranks)]
    print(json.dumps({"endpoint": f"tcp://*:{base}",
                      "replay_endpoint": f"tcp://*:{rbase}" if rbase else None}), flush=True)
    poller = zmq.Poller()
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    for r in reps:
        if r is not None:
            poller.register(r, zmq.POLLIN)
    while True:
        ready = dict(poller.poll(50))
        for rk in ranks:
            rk.serve_replay()
        if sys.stdin.fileno() not in ready:
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        rk = ranks[cmd.get("rank", 0)]
        op = cmd["op"]
        if op == "store":
            rk.store(cmd["tokens"])
        elif op == "remove":
            rk.remove(cmd["tokens"])
        elif op == "clear":
            rk.held.clear()
            rk.publish([rk.event("AllBlocksCleared")])
        elif op == "drop":
            rk.drop += cmd["n"]
        elif op == "malformed":
            for i in range(cmd["n"]):
                rk.pub.send_multipart([b"", b"\x00" * 8, b"\xc1garbage"] if i % 2 else [b"only-one-frame"])
        elif op == "flood":
            for _ in range(cmd["n"]):
                rk.fresh += rk.bs
                rk.store(list(range(rk.fresh, rk.fresh + rk.bs)))
        print(json.dumps({"ok": True, "seq": rk.seq}), flush=True)


if __name__ == "__main__":
    main()
