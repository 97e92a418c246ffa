"""The text each request body is routed by."""

from fleetserve.router.routing_text import chat_text, ids_text, routing_text


def test_chat_turn_n_is_prefix_of_turn_n_plus_1():
    turn1 = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 你好 😀"}]
    turn2 = turn1 + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"}]
    t1, t2 = chat_text(turn1), chat_text(turn2)
    assert t2.startswith(t1) and len(t2) > len(t1)
    assert "system" in t1 and "You are terse." in t1 and "😀" in t1
    # roles matter: same content, different role -> different text
    assert chat_text([{"role": "user", "content": "x"}]) != chat_text([{"role": "assistant", "content": "x"}])


def test_chat_content_parts_keep_text_in_order():
    msg = [{"role": "user", "content": [{"type": "text", "text": "look at "},
                                        {"type": "image_url", "image_url": {"url": "http://x"}},
                                        {"type": "text", "text": "this"}]}]
    t = routing_text("/v1/chat/completions", {"messages": msg})
    assert t.index("look at ") < t.index("<image_url>") < t.index("this")


def test_completions_prompt_forms():
    assert routing_text("/v1/completions", {"prompt": "abc"}) == "abc"
    assert routing_text("/v1/completions", {"prompt": ["abc", "def"]}) == "abc\ndef"
    ids = routing_text("/v1/completions", {"prompt": [1, 2, 3]})
    assert ids == ids_text([1, 2, 3]) and len(ids) == 4
    assert ids_text([1, 2]) != ids_text([12])
    assert ids_text([5, 6, 7]).startswith(ids_text([5, 6]))
    assert routing_text("/v1/completions", {"prompt": [[1, 2], [3]]}) == ids_text([1, 2]) + "\n" + ids_text([3])
    assert routing_text("/v1/completions", {}) == ""


def test_generate_text_or_input_ids_and_huge_ids():
    assert routing_text("/generate", {"text": "hello"}) == "hello"
    assert routing_text("/generate", {"input_ids": [7, 8]}) == ids_text([7, 8])
    big = ids_text([2**40, 3])
    assert big.startswith("\x1d") and "1099511627776" in big
    assert routing_text("/generate", {"text": 5}) == ""


def test_ids_text_is_one_character_per_id_at_every_edge():
    # ids_text builds the string through a 4-byte array and UTF-32: the same string as chr() per id,
    # surrogate code points included; beyond 0x10FFFF, negative or non-int ids, the decimal form
    for ids in ([0, 1, 65], [0xD7FF, 0xD800, 0xDBFF, 0xDC00, 0xDFFF, 0xE000], [0x10FFFF], list(range(49152))[::97]):
        assert ids_text(ids) == "\x1d" + "".join(chr(i) for i in ids)
    assert ids_text([0x110000, 5]) == "\x1d1114112 5 "
    assert ids_text([-1, 5]) == "\x1d-1 5 "
    assert ids_text([True, 2]) == "\x1d\x01\x02"


WORDS = ["hi", "hello", "thanks", "yes", "no", "why", "ok", "bye"]


def _common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_one_word_chats_share_only_their_content_prefix():
    """Issue 15: no structural prefix (role marker) common to every conversation."""
    texts = {w: chat_text([{"role": "user", "content": w}]) for w in WORDS}
    for a in WORDS:
        for b in WORDS:
            if a != b:
                assert _common(texts[a], texts[b]) == _common(a, b), (a, b)


def test_one_word_chats_spread_and_long_conversations_still_stick():
    from fleetserve.router.policies import CacheAwarePolicy
    from fleetserve.router.workers import Worker

    ws = [Worker(f"http://w{i}") for i in range(4)]
    p = CacheAwarePolicy()  # sglang-router defaults: a hit needs more than 30% of the text matched
    homes = [p.select(ws, routing_text("/v1/chat/completions", {"messages": [{"role": "user", "content": w}]})).url
             for w in WORDS]
    assert len(set(homes)) == 4 and max(homes.count(u) for u in set(homes)) == 2, homes
    assert p.hits == 0 and p.misses == 8
    conv = [{"role": "system", "content": "You are a terse assistant for the fleet."},
            {"role": "user", "content": "How many workers are there in the fleet right now?"}]
    home = p.select(ws, chat_text(conv)).url
    for turn in range(3):
        conv += [{"role": "assistant", "content": f"Answer {turn}."}, {"role": "user", "content": f"And {turn}?"}]
        assert p.select(ws, chat_text(conv)).url == home
    assert p.hits == 3
