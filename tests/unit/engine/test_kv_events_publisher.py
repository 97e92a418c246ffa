"""The publisher over real ZMQ: frames, sequence numbers, topics, replay, dropping, stalled subscribers, shutdown.

Subscribers have their own ZMQ context; the publisher sends from its own thread.
"""

import json
import threading
import time

import msgpack
import pytest
import zmq

from fleetserve.engine.kv_events.config import parse_kv_events_config
from fleetserve.engine.kv_events.publisher import KVEventPublisher, make_publisher
from helpers.kv_events_sub import END_SEQ, Subscriber, batch_of, free_port_block, replay, seq_of, wait_connected


def _cfg(**kw):
    kw.setdefault("publisher", "zmq")
    return parse_kv_events_config(json.dumps(kw))


@pytest.fixture
def ports():
    p = free_port_block(2)
    return p, p + 1


@pytest.fixture
def pubs():
    made = []
    yield made
    for p in made:
        p.shutdown()


def _store(pub, i):
    pub.block_stored([100 + i], None if i == 0 else 99 + i, [i], 1)


def test_frames_sequence_numbers_and_replay_from_zero(ports, pubs):
    pub = KVEventPublisher(_cfg(endpoint=f"tcp://*:{ports[0]}", replay_endpoint=f"tcp://*:{ports[1]}",
                                topic="kv@w0"), data_parallel_rank=0)
    pubs.append(pub)
    sub = Subscriber(f"tcp://127.0.0.1:{ports[0]}", b"kv@w0")
    try:
        first = wait_connected(pub, sub)
        assert first >= 1
        assert pub.end_step() is None and pub.next_seq == first  # a step without events sends nothing
        for i in range(3):
            _store(pub, i)
            if i == 2:
                pub.block_removed([100])
            assert pub.end_step() == first + i
        got = [sub.recv() for _ in range(3)]
        assert all(m is not None and len(m) == 3 for m in got)
        assert [m[0] for m in got] == [b"kv@w0"] * 3
        assert [m[1] for m in got] == [(first + i).to_bytes(8, "big") for i in range(3)]
        ts, events, rank = batch_of(got[2])
        assert abs(ts - time.time()) < 60 and rank == 0
        assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved"]
        assert events[0]["block_hashes"] == [102] and events[0]["parent_block_hash"] == 101
        assert events[1]["block_hashes"] == [100]
        # replay from 0: the warm-up batches 0 .. first-1 and ours, same payloads, then the end marker
        ans = replay(f"tcp://127.0.0.1:{ports[1]}", 0)
        assert [m[0] for m in ans] == [b""] * len(ans)
        assert [int.from_bytes(m[1], "big") for m in ans[:-1]] == list(range(first + 3))
        assert [m[2] for m in ans[first:-1]] == [m[2] for m in got]
        assert ans[-1] == [b"", END_SEQ, b""] and int.from_bytes(END_SEQ, "big", signed=True) == -1
        # from the middle, and from past the end (only the marker)
        assert [seq_of(m) for m in replay(f"tcp://127.0.0.1:{ports[1]}", first + 1)[:-1]] == [first + 1, first + 2]
        assert replay(f"tcp://127.0.0.1:{ports[1]}", 10_000) == [[b"", END_SEQ, b""]]
    finally:
        sub.close()


def test_replay_keeps_buffer_steps_and_ignores_malformed_requests(ports, pubs):
    pub = KVEventPublisher(_cfg(endpoint=f"tcp://*:{ports[0]}", replay_endpoint=f"tcp://*:{ports[1]}",
                                buffer_steps=3))
    pubs.append(pub)
    for i in range(6):
        _store(pub, i)
        pub.end_step()
    deadline = time.monotonic() + 10
    while pub.published < 6:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://127.0.0.1:{ports[1]}")
        dealer.send_multipart([b"", b"\x00" * 8, b"extra"])  # 4 frames at the ROUTER: ignored
        assert not dealer.poll(300)
        assert [seq_of(m) for m in replay(f"tcp://127.0.0.1:{ports[1]}", 0)[:-1]] == [3, 4, 5]
        # vLLM's example subscriber uses REQ: it sends the bare start seq and reads [seq, payload]
        req.connect(f"tcp://127.0.0.1:{ports[1]}")
        req.send((4).to_bytes(8, "big"))
        assert req.poll(5000)
        seq, payload = req.recv_multipart()
        assert int.from_bytes(seq, "big") == 4 and msgpack.unpackb(payload)[1][0]["block_hashes"] == [104]
    finally:
        dealer.close(0)
        req.close(0)
        ctx.term()


def test_topic_filtering(ports, pubs):
    pub = KVEventPublisher(_cfg(endpoint=f"tcp://*:{ports[0]}", topic="kv@a"))
    pubs.append(pub)
    yes = Subscriber(f"tcp://127.0.0.1:{ports[0]}", b"kv@a")
    no = Subscriber(f"tcp://127.0.0.1:{ports[0]}", b"kv@b")
    try:
        wait_connected(pub, yes)
        for i in range(5):
            _store(pub, i)
            pub.end_step()
        assert [seq_of(m) for m in yes.drain()] == list(range(pub.next_seq - 5, pub.next_seq))
        assert no.drain() == []
        no.sock.setsockopt(zmq.SUBSCRIBE, b"kv@")  # now a prefix of the topic: the same socket receives
        after = wait_connected(pub, no)
        _store(pub, 9)
        pub.end_step()
        m = no.recv()
        assert m[0] == b"kv@a" and seq_of(m) == after
    finally:
        yes.close()
        no.close()


def test_full_queue_drops_counts_and_leaves_a_seq_gap(ports, pubs):
    pub = KVEventPublisher(_cfg(endpoint=f"tcp://*:{ports[0]}", max_queue_size=2))
    pubs.append(pub)
    sub = Subscriber(f"tcp://127.0.0.1:{ports[0]}")
    try:
        s0 = wait_connected(pub, sub)
        gate, inside = threading.Event(), threading.Event()
        send = pub._send

        def stuck_send(*a):  # the publisher thread stalls on this batch (as on a slow network)
            inside.set()
            assert gate.wait(10)
            send(*a)

        pub._send = stuck_send
        _store(pub, 0)
        pub.end_step()  # s0: taken by the thread, which then waits
        assert inside.wait(10)
        for i in range(1, 6):  # s0+1, s0+2 fill the queue; s0+3 .. s0+5 are dropped, without waiting
            _store(pub, i)
            assert pub.end_step() == s0 + i
        assert pub.dropped == 3 and pub.stats()["queued"] == 2
        pub._send = send
        gate.set()
        deadline = time.monotonic() + 10
        while pub.stats()["queued"]:  # the thread catches up with the queue
            assert time.monotonic() < deadline
            time.sleep(0.01)
        _store(pub, 6)
        assert pub.end_step() == s0 + 6
        got = [seq_of(m) for m in sub.drain(0.5)]
        assert got == [s0, s0 + 1, s0 + 2, s0 + 6]  # the subscriber sees the gap
        assert pub.stats() == {"published": s0 + 4, "dropped": 3, "queued": 0, "next_seq": s0 + 7}
    finally:
        sub.close()


def test_stalled_and_vanished_subscribers_do_not_hold_the_publisher(ports, pubs):
    pub = KVEventPublisher(_cfg(endpoint=f"tcp://*:{ports[0]}", hwm=10, max_queue_size=100_000))
    pubs.append(pub)
    stalled = Subscriber(f"tcp://127.0.0.1:{ports[0]}", rcvhwm=1)  # connected, never reads
    gone = Subscriber(f"tcp://127.0.0.1:{ports[0]}")
    live = Subscriber(f"tcp://127.0.0.1:{ports[0]}")
    try:
        wait_connected(pub, stalled, gone, live)
        gone.close()
        n = 3000
        for i in range(n):
            pub.block_stored([i], None, list(range(256)), 1)  # ~1 KiB a batch: far past any socket buffer
            pub.end_step()
        deadline = time.monotonic() + 60
        while pub.published < pub.next_seq:
            assert time.monotonic() < deadline, f"publisher stuck at {pub.stats()}"
            time.sleep(0.02)
        assert pub.dropped == 0
        _store(pub, 1)
        last = pub.end_step()
        seqs = [seq_of(m) for m in live.drain(1.0)]
        assert seqs and seqs[-1] == last  # the live subscriber still gets the newest batch
    finally:
        stalled.close()
        live.close()


def test_shutdown_joins_closes_and_frees_the_port(ports):
    pub = KVEventPublisher(_cfg(endpoint=f"tcp://*:{ports[0]}", replay_endpoint=f"tcp://*:{ports[1]}"))
    _store(pub, 0)
    pub.end_step()
    pub.shutdown()
    assert not pub._thread.is_alive() and pub.published == 1
    pub.shutdown()  # idempotent
    _store(pub, 1)
    assert pub.end_step() is None
    again = KVEventPublisher(_cfg(endpoint=f"tcp://*:{ports[0]}", replay_endpoint=f"tcp://*:{ports[1]}"))
    again.shutdown()


def test_null_publisher_and_connect_mode(ports):
    assert make_publisher(parse_kv_events_config('{"publisher": "null"}')) is None
    assert make_publisher(None) is None
    # a named host connects (to a collector that binds); a PULL-less collector here is a bound SUB
    ctx = zmq.Context()
    coll = ctx.socket(zmq.SUB)
    coll.setsockopt(zmq.LINGER, 0)
    coll.setsockopt(zmq.SUBSCRIBE, b"")
    coll.bind(f"tcp://127.0.0.1:{ports[0]}")
    pub = make_publisher(_cfg(endpoint=f"tcp://127.0.0.1:{ports[0]}", encoding="array"), data_parallel_rank=0)
    try:
        deadline = time.monotonic() + 20
        while not coll.poll(50):
            assert time.monotonic() < deadline
            pub.all_blocks_cleared()
            pub.end_step()
        frames = coll.recv_multipart()
        assert frames[0] == b"" and msgpack.unpackb(frames[2])[1] == [["AllBlocksCleared"]]
    finally:
        pub.shutdown()
        coll.close(0)
        ctx.term()
