"""Incremental detokenization and stop-string hold-back over arbitrary chunkings.

Uses a byte-level toy tokenizer (every token is a byte string, as in GPT-2 style
BPE) so that hypothesis can split multi-byte characters anywhere.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.entrypoints.detokenizer import IncrementalDetokenizer, StopStringChecker, TextStream

EOS = 1000


class ByteTokenizer:
    """ids 0..255: one byte each; 256+: multi-byte pieces; EOS: a special token."""

    def __init__(self):
        pieces = ["你", "好", "世界", "😀", "é", " hello", " wor", "ld", "\n\n", "ab", "abc", "STOP"]
        self.vocab: dict[int, bytes] = {i: bytes([i]) for i in range(256)}
        for j, p in enumerate(pieces):
            self.vocab[256 + j] = p.encode("utf-8")
        # pieces that cut characters in the middle
        self.vocab[300] = "你".encode()[:2]
        self.vocab[301] = "你".encode()[2:] + "好".encode()[:1]
        self.vocab[302] = "😀".encode()[:3]
        self.vocab[303] = "😀".encode()[3:]
        self.vocab[EOS] = b"<eos>"

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        out = b"".join(self.vocab[i] for i in ids if not (skip_special_tokens and i == EOS))
        return out.decode("utf-8", errors="replace")

    def encode_bytes(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


TOK = ByteTokenizer()
token_ids = st.lists(st.sampled_from(sorted(TOK.vocab)), min_size=0, max_size=40)
texts = st.lists(st.sampled_from(list("ab cé你好世界😀🎉\n") + ["STOP"]), max_size=30).map("".join)


def chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts})
    out, prev = [], 0
    for p in points + [len(ids)]:
        out.append(ids[prev:p])
        prev = p
    return out


@settings(max_examples=300, deadline=None)
@given(ids=token_ids, cuts=st.lists(st.integers(0, 60), max_size=10))
def test_deltas_concatenate_to_full_decode(ids, cuts):
    d = IncrementalDetokenizer(TOK)
    deltas = [d.add(c) for c in chunked(ids, cuts)]
    deltas.append(d.flush())
    assert "".join(deltas) == TOK.decode(ids)


@settings(max_examples=300, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(0, 200), max_size=12))
def test_valid_utf8_never_emits_replacement_char(text, cuts):
    """Byte-by-byte tokens of valid text: no delta ever holds U+FFFD or half a character."""
    ids = TOK.encode_bytes(text)
    d = IncrementalDetokenizer(TOK)
    deltas = [d.add(c) for c in chunked(ids, cuts)]
    deltas.append(d.flush())
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == text


def test_split_emoji_is_held_then_emitted_once():
    d = IncrementalDetokenizer(TOK)
    assert d.add([302]) == ""  # first 3 bytes of the emoji
    assert d.add([303]) == "😀"
    assert d.add([256]) == "你"
    assert d.text == "😀你"


def test_real_invalid_bytes_do_produce_replacement_char():
    d = IncrementalDetokenizer(TOK)
    out = d.add([0xFF]) + d.add([ord("a")]) + d.flush()
    assert out == "\ufffda"


def test_incomplete_tail_flushed_at_end():
    d = IncrementalDetokenizer(TOK)
    assert d.add([ord("x")]) == "x"
    assert d.add([300]) == ""
    assert d.flush() == "\ufffd"


def test_special_tokens_skipped_or_kept():
    assert IncrementalDetokenizer(TOK).add([ord("a"), EOS]) == "a"
    d = IncrementalDetokenizer(TOK, skip_special_tokens=False)
    assert d.add([ord("a"), EOS]) + d.flush() == "a<eos>"


# ---------------------------------------------------------------- stop strings


def reference_cut(text_by_token: list[str], stops: list[str]) -> str:
    """Cut after the first token whose cumulative text contains a stop, at the earliest stop start."""
    acc = ""
    for piece in text_by_token:
        acc += piece
        hits = [acc.find(s) for s in stops if s in acc]
        if hits:
            return acc[: min(hits)]
    return acc


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="abcxy😀", max_size=4), max_size=15),
    stops=st.lists(st.text(alphabet="abcxy😀", min_size=1, max_size=4), max_size=3),
)
def test_stop_checker_matches_reference(pieces, stops):
    c = StopStringChecker(stops)
    out = "".join(c.feed(p) for p in pieces) + c.flush()
    assert out == reference_cut(pieces, stops)
    if c.matched is None:
        assert not any(s in out for s in stops)


def test_stop_across_pieces_is_held_back_and_removed():
    c = StopStringChecker(["STOP"])
    assert c.feed("hello ST") == "hello "
    assert c.feed("O") == ""
    assert c.feed("Px") == ""
    assert c.matched == "STOP"
    c2 = StopStringChecker(["STOP"])
    assert c2.feed("ST") == "" and c2.feed("ay") == "STay"


@settings(max_examples=300, deadline=None)
@given(
    ids=token_ids,
    cuts=st.lists(st.integers(0, 60), max_size=10),
    stops=st.lists(st.sampled_from(["STOP", "ab", "你好", "😀", "ld\n", "c"]), max_size=2),
)
def test_text_stream_streamed_equals_one_shot(ids, cuts, stops):
    one = TextStream(TOK, stops)
    one_step = one.add(ids)
    full = one_step.text + one.finish()

    s = TextStream(TOK, stops)
    streamed, consumed = "", 0
    for c in chunked(ids, cuts):
        step = s.add(c)
        streamed += step.text
        consumed += step.consumed
        if step.stopped:
            break
    streamed += s.finish()
    assert streamed == full
    assert s.matched == one.matched
    assert consumed == one_step.consumed
    if one.matched is None:
        assert full == TOK.decode(ids)
    else:
        assert one.matched not in full


@settings(max_examples=200, deadline=None)
@given(ids=token_ids, cuts=st.lists(st.integers(0, 60), max_size=10))
def test_text_stream_whole_messages_equal_per_token(ids, cuts):
    """Without stop strings a message is detokenized at once: same text as token by token."""
    a, b = TextStream(TOK, per_token=True), TextStream(TOK, per_token=False)
    ta = "".join(a.add(c).text for c in chunked(ids, cuts)) + a.finish()
    tb = "".join(b.add(c).text for c in chunked(ids, cuts)) + b.finish()
    assert ta == tb == TOK.decode(ids)
