"""The trust state machine of one subscription, fed messages directly (no socket)."""

import msgpack

from fleetserve.router.kv_events.index import BlockIndex
from fleetserve.router.kv_events.subscriber import Subscription

URL = "http://w:1"


def msg(seq, *events, rank=0):
    return [b"", seq.to_bytes(8, "big"), msgpack.packb([1.0, list(events), rank])]


def stored(h, tokens, parent=None):
    return ["BlockStored", [h], parent, tokens, len(tokens), None]


def sub():
    ix = BlockIndex()
    return Subscription(URL, 0, "tcp://127.0.0.1:1", ix), ix


def test_joined_mid_stream_is_degraded_until_a_clear():
    s, ix = sub()
    assert s.state == "fallback"  # nothing received yet
    s.on_message(msg(5, stored(1, [1, 2])))
    assert s.state == "degraded" and ix.blocks_of((URL, 0)) == 1
    s.on_message(msg(6, ["AllBlocksCleared"], stored(2, [3, 4])))
    assert s.state == "exact" and ix.blocks_of((URL, 0)) == 1


def test_gap_without_replay_drops_and_falls_back():
    s, ix = sub()
    s.on_message(msg(0, stored(1, [1, 2])))
    assert s.state == "exact"
    s.on_message(msg(3, stored(2, [3, 4])))
    assert (s.state, s.gaps, s.last_seq) == ("fallback", 1, 3)
    assert ix.blocks_of((URL, 0)) == 1  # only the block after the gap
    s.on_message(msg(4, stored(3, [5, 6])))
    assert s.state == "fallback"  # still not clean


def test_duplicates_skipped_and_restart_starts_over():
    s, ix = sub()
    s.on_message(msg(0, stored(1, [1, 2])))
    s.on_message(msg(1, stored(2, [3, 4], parent=1)))
    s.on_message(msg(1, stored(9, [9, 9])))  # duplicate: skipped
    assert ix.blocks_of((URL, 0)) == 2 and s.batches == 2
    s.on_message(msg(0, stored(5, [7, 7])))  # the engine restarted
    assert s.state == "exact" and ix.blocks_of((URL, 0)) == 1 and s.last_seq == 0


def test_malformed_messages_are_counted_and_change_nothing():
    s, ix = sub()
    s.on_message(msg(0, stored(1, [1, 2])))
    for bad in ([b"x"], [b"", b"\x00" * 8, b"\xc1"], [b"", b"\x00" * 8, msgpack.packb([1.0, [["Bad"]]])]):
        s.on_message(bad)
    assert s.malformed == 3 and s.state == "exact" and s.last_seq == 0 and ix.blocks_of((URL, 0)) == 1
    s.on_message(msg(1, stored(2, [3, 4], parent=1)))
    assert s.last_seq == 1 and s.gaps == 0


def test_a_lost_connection_drops_the_entries_and_exact_turns_degraded():
    told = []
    ix = BlockIndex()
    s = Subscription(URL, 0, "tcp://127.0.0.1:1", ix, on_lost=told.append)
    s.on_message(msg(0, stored(1, [1, 2]), stored(2, [3, 4], parent=1)))
    assert (s.state, ix.blocks_of((URL, 0))) == ("exact", 2)
    s.lost()
    assert (s.state, ix.blocks_of((URL, 0)), s.disconnects, told) == ("degraded", 0, 1, [(URL, 0)])
    s.on_message(msg(1, stored(3, [5, 6])))  # it lived on: the stream goes on, still a subset
    assert (s.state, ix.blocks_of((URL, 0))) == ("degraded", 1)
    s.on_message(msg(0, stored(4, [7, 8])))  # it had restarted: a clean state from seq 0
    assert (s.state, ix.blocks_of((URL, 0))) == ("exact", 1)
    f = Subscription(URL, 1, "tcp://127.0.0.1:1", ix)  # nothing received yet: stays fallback
    f.lost()
    assert f.state == "fallback"
