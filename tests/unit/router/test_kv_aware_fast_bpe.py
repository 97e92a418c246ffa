"""The router's fast byte-level BPE encoder gives exactly the ids of ``tokenizers.Tokenizer.encode``."""

import json
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from fleetserve.models.registry import default_model_path
from fleetserve.models.tokenizer import load_tokenizer, tokenizer_cache_dir
from fleetserve.router.kv_events.fast_bpe import BLOCK_CHARS, ByteLevelBPE, _no_segments, bytes_to_unicode

# ASCII with every whitespace kind, the contraction letters, digits and punctuation: the segment path's edge cases
ASCII = " " * 8 + "\t\n\r\x0b\x0c\x1c\x1f" + "abcdestvlmSTDLV'" + "0123456789" + ".,;:!?-_()[]{}<>\"/\\#@" + "XYZ"
# Llama 3's pre-tokenizer regex (its tokenizer.json), as a second supported pattern
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
UNICODE = ASCII + "éÀßΩ你好世界🙂😀\u00a0\u2003\u3000\u0085\u200b①½٣"


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_path()
    load_tokenizer(path)  # converts the GGUF's tokenizer once (cached)
    tok_file = os.path.join(tokenizer_cache_dir(path), "tokenizer.json")
    with open(tok_file, encoding="utf-8") as f:
        spec = json.load(f)
    tok = Tokenizer.from_file(tok_file)
    fast = ByteLevelBPE.from_tokenizer(tok, spec)
    assert fast is not None, "SmolLM2's tokenizer is byte-level BPE: the fast encoder must accept it"
    return tok, spec, fast


def _same(tok, fast, text):
    for special in (True, False):
        assert fast.encode(text, special) == tok.encode(text, add_special_tokens=special).ids, repr(text)


def test_bytes_to_unicode_is_gpt2s_map():
    m = bytes_to_unicode()
    assert len(m) == 256 and len(set(m.values())) == 256
    # golden values from GPT-2's encoder.py: printable bytes map to themselves, space is U+0120, newline U+010A
    assert m[ord("a")] == "a" and m[ord("!")] == "!" and m[0xFF] == "ÿ"
    assert m[ord(" ")] == "\u0120" and m[ord("\n")] == "\u010a" and m[0] == "\u0100" and m[0xAD] == "\u0143"


def test_known_ids_and_special_tokens(smollm2):
    tok, _, fast = smollm2
    # SmolLM2's special tokens: <|im_start|> = 1, <|im_end|> = 2, <|endoftext|> = 0
    ids = fast.encode("<|im_start|>user\nhi<|im_end|>\n", False)
    assert ids[0] == 1 and 2 in ids and ids == tok.encode("<|im_start|>user\nhi<|im_end|>\n",
                                                          add_special_tokens=False).ids
    for text in ("", " ", "  ", "a", "<|endoftext|>", "<|im_end|><|im_end|>", "x<|im_start|>", "Hello world",
                 "it's 12345 o'clock", " leading", "trailing ", "tab\t after", "a \nb", "a\n b", "a  b   c"):
        _same(tok, fast, text)
    assert fast.fallbacks == 0


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=ASCII, max_size=200))
def test_ascii_texts_match_the_library(smollm2, text):
    tok, _, fast = smollm2
    _same(tok, fast, text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=UNICODE, max_size=200))
def test_unicode_texts_match_the_library(smollm2, text):
    tok, _, fast = smollm2
    _same(tok, fast, text)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["the", "cat's", "1,024", "x=1;", "<|im_start|>", "<|im_end|>", "\n", " ", "  ",
                                 "é", "你好", "\t", "don't", "'ll"]), max_size=60))
def test_word_mixes_with_special_tokens_match_the_library(smollm2, words):
    tok, _, fast = smollm2
    _same(tok, fast, " ".join(words))
    _same(tok, fast, "".join(words))


def test_stick_like_prompts_repeat_exactly_and_caches_stay_bounded(smollm2):
    tok, spec, _ = smollm2
    fast = ByteLevelBPE.from_tokenizer(tok, spec, max_words=50)
    rng = random.Random(7)
    words = "the of and to router cache prefix token worker 42 3.14 don't (x) [context 3]".split(" ")
    texts = [" ".join(rng.choices(words, k=rng.randint(50, 300))) for _ in range(40)]
    first = [fast.encode(t) for t in texts]
    assert first == [tok.encode(t).ids for t in texts]
    assert [fast.encode(t) for t in texts] == first  # from the caches, the same ids
    assert len(fast.words) <= 50 and len(fast.segments) <= 50 and len(fast.heads) <= 50
    assert fast.segments  # the ASCII segment path was taken


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=ASCII, min_size=BLOCK_CHARS // 2, max_size=BLOCK_CHARS),
       st.lists(st.text(alphabet=ASCII, min_size=1, max_size=3 * BLOCK_CHARS), min_size=2, max_size=4))
def test_prefix_blocks_give_the_library_ids_on_shared_prefixes(smollm2, head, tails):
    """Texts longer than a block share a prefix: the later ones reuse its cached blocks, with the same ids.

    The alphabet has every whitespace kind, so block cuts land next to double spaces, tabs and newlines.
    """
    tok, spec, _ = smollm2
    fast = ByteLevelBPE.from_tokenizer(tok, spec)
    shared = (head + " ") * 3
    for tail in tails:
        _same(tok, fast, shared + tail)
        _same(tok, fast, shared + tail)  # the second time every block of it is cached
    assert fast.fallbacks == 0


def test_prefix_blocks_are_reused_exactly_and_stay_bounded(smollm2):
    tok, spec, _ = smollm2
    fast = ByteLevelBPE.from_tokenizer(tok, spec)
    rng = random.Random(11)
    words = "the of and to router cache prefix token worker 42 3.14 don't (x) [context 3]\n a\tb".split(" ")
    preamble = " ".join(rng.choices(words, k=120))  # about 3 blocks
    assert len(preamble) > 2 * BLOCK_CHARS
    texts = [preamble + " " + " ".join(rng.choices(words, k=rng.randint(1, 80))) for _ in range(12)]
    for t in texts:
        assert fast.encode(t) == tok.encode(t).ids
    assert fast.block_hits >= 2 * (len(texts) - 1)  # every later text found the preamble's first blocks
    small = ByteLevelBPE.from_tokenizer(tok, spec, max_blocks=5)
    assert [small.encode(t) for t in texts * 2] == [tok.encode(t).ids for t in texts * 2]
    assert 0 < len(small.blocks) <= 5 and small.block_hits > 0
    misses = fast.block_misses
    hits = fast.block_hits
    assert fast.encode(texts[-1]) == tok.encode(texts[-1]).ids
    assert fast.block_misses == misses and fast.block_hits > hits  # all of it from the cache
    # spaces after whitespace are no cut: the block runs on to the next space after a non-space
    for ws in "\n\t\r\x0b\x0c ":
        head = "\r" + "0" * (BLOCK_CHARS // 2 - 2) + ws
        for text in ((head + " ") * 5 + "0", (head + " x") * 5):
            _same(tok, fast, text)
            _same(tok, fast, text)
    # a text without any cut is encoded, but its one long block is not remembered
    solid = "x" * (20 * BLOCK_CHARS)
    n = len(fast.blocks)
    assert fast.encode(solid) == tok.encode(solid).ids and len(fast.blocks) == n
    # a block cache of 0 turns the blocks off: the same ids
    off = ByteLevelBPE.from_tokenizer(tok, spec, max_blocks=0)
    assert [off.encode(t) for t in texts] == [tok.encode(t).ids for t in texts] and off.blocks == {}


def test_encode_chars_gives_the_ids_and_their_characters_from_the_blocks(smollm2):
    """encode_chars: the ids of encode, and for a text that goes through the block chain whole (ASCII,
    longer than a block, no added token) the ids as characters, joined from the blocks' own, first
    seen or cached, with and without the special tokens; None for other texts.  The router's
    tokenizer and kv_aware's prepare pass them on: a key's tree text is the ids' text form."""
    import asyncio

    from fleetserve.router.kv_events.policy import KvAwarePolicy
    from fleetserve.router.kv_events.tokenize import RouterTokenizer
    from fleetserve.router.routing_text import ids_text

    tok, spec, _ = smollm2
    fast = ByteLevelBPE.from_tokenizer(tok, spec)
    rng = random.Random(5)
    words = "the of and to router cache prefix token worker 42 3.14 don't (x) [context 3]\n a\tb  c".split(" ")
    preamble = " ".join(rng.choices(words, k=120))
    texts = [preamble + " " + " ".join(rng.choices(words, k=rng.randint(1, 200))) for _ in range(10)]
    texts += ["short text", "x" * (20 * BLOCK_CHARS), preamble + " 你好", preamble + "<|im_start|>" + preamble]
    for text in texts * 2:
        for special in (True, False):
            ids, chars = fast.encode_chars(text, special)
            assert ids == tok.encode(text, add_special_tokens=special).ids
            through_blocks = text.isascii() and len(text) > BLOCK_CHARS and "<|" not in text
            assert (chars is not None) == through_blocks, text[:40]
            if chars is not None:
                assert chars == "".join(map(chr, ids))
    rt = RouterTokenizer(tokenizer_cache_dir(default_model_path()))
    for body in ({"prompt": texts[0]}, {"prompt": [texts[1]]}, {"prompt": "hi"}, {"prompt": [1, 2, 3]}):
        ids, chars = rt.request_ids_chars("/v1/completions", body)
        assert ids == rt.request_ids("/v1/completions", body)
        assert chars is None or chars == "".join(map(chr, ids))
    policy = KvAwarePolicy(tokenizer=rt)
    try:
        for text in texts[:3]:
            key = asyncio.run(policy.prepare("/v1/completions", {"prompt": text}, text))
            assert key._chars is not None and key.tree_text() == ids_text(key.tokens)
    finally:
        policy.close()


def test_no_segments_finds_every_whitespace_before_a_space():
    for ws in " \t\n\r\x0b\x0c":
        assert _no_segments("abc" + ws + " d") and _no_segments(ws + " ")
    for ok in ("a b c", "a\nb\tc", "a \n", "a\x1c b", "", " a", "a "):
        assert not _no_segments(ok), repr(ok)


def test_unsupported_tokenizers_get_no_fast_encoder(smollm2):
    tok, spec, _ = smollm2
    for change in ({"normalizer": {"type": "NFC"}}, {"pre_tokenizer": {"type": "Whitespace"}},
                   {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}},
                   {"model": dict(spec["model"], dropout=0.1)}, {"truncation": {"max_length": 8}}):
        assert ByteLevelBPE.from_tokenizer(tok, dict(spec, **change)) is None, change
    lstrip = [dict(t, lstrip=True) for t in spec["added_tokens"]]
    assert ByteLevelBPE.from_tokenizer(tok, dict(spec, added_tokens=lstrip)) is None


def test_split_then_byte_level_sequence_is_supported(smollm2):
    """The Llama 3 / Qwen2 shape: a Split regex (here Llama 3's), then ByteLevel without its own regex."""
    _, spec, _ = smollm2
    seq = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    spec2 = dict(spec, pre_tokenizer=seq)
    tok2 = Tokenizer.from_str(json.dumps(spec2))
    fast = ByteLevelBPE.from_tokenizer(tok2, spec2)
    assert fast is not None and fast.ascii_split is None  # the regex path only
    assert fast.encode("1234567") == tok2.encode("1234567").ids and len(fast.encode("1234567")) >= 3  # \p{N}{1,3}
    rng = random.Random(3)
    for _ in range(200):
        text = "".join(rng.choices(UNICODE, k=rng.randint(0, 120)))
        _same(tok2, fast, text)


def test_router_tokenizer_uses_it_and_env_turns_it_off(smollm2, monkeypatch):
    from fleetserve.router.kv_events.tokenize import INLINE_MAX_CHARS, RouterTokenizer

    folder = tokenizer_cache_dir(default_model_path())
    rt = RouterTokenizer(folder)
    assert rt.fast is not None
    s = "Once upon a time, in a land far away"
    assert rt.inline("/v1/completions", {"prompt": s})
    assert not rt.inline("/v1/completions", {"prompt": "x" * (INLINE_MAX_CHARS + 1)})
    assert rt.inline("/v1/chat/completions", {"messages": [{"role": "user", "content": s}]})
    assert not rt.inline("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    monkeypatch.setenv("FLEETSERVE_ROUTER_FAST_TOKENIZE", "0")
    slow = RouterTokenizer(folder)
    assert slow.fast is None and not slow.inline("/v1/completions", {"prompt": s})
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": s + " 你好"}]}
    assert rt.request_ids("/v1/chat/completions", chat) == slow.request_ids("/v1/chat/completions", chat)
    assert rt.request_ids("/v1/completions", {"prompt": s}) == slow.request_ids("/v1/completions", {"prompt": s})


async def test_prepare_tokenizes_short_prompts_inline_and_long_ones_on_the_pool(smollm2):
    from fleetserve.router.kv_events.policy import KvAwarePolicy
    from fleetserve.router.kv_events.tokenize import INLINE_MAX_CHARS, RouterTokenizer

    tok, _, _ = smollm2
    policy = KvAwarePolicy(tokenizer=RouterTokenizer(tokenizer_cache_dir(default_model_path())))
    try:
        short = "The quick brown fox jumps over the lazy dog. " * 10
        long = "The quick brown fox jumps over the lazy dog, 你好. " * (INLINE_MAX_CHARS // 40)
        assert policy.tokenizer.inline("/v1/completions", {"prompt": short})
        assert not policy.tokenizer.inline("/v1/completions", {"prompt": long})
        for prompt in (short, long):
            key = await policy.prepare("/v1/completions", {"prompt": prompt, "max_tokens": 7}, prompt)
            assert key.tokens == tok.encode(prompt).ids and key.prompt_tokens == len(key.tokens)
            assert key.decode_tokens == 7
            assert key.tree_text() is key.tree_text()  # built once
    finally:
        policy.close()


def test_l0_cache_gives_the_uncached_ids_and_stays_bounded():
    from fleetserve.router.kv_events.tokenize import RouterTokenizer

    folder = tokenizer_cache_dir(default_model_path())
    plain, cached = RouterTokenizer(folder), RouterTokenizer(folder, l0_max_entries=3)
    texts = [f"prompt {i}: the router cache" for i in range(5)]
    for t in texts:
        for special in (True, False):
            for _ in range(2):  # a miss, then a hit
                ids = cached.encode(t, special)
                assert ids == plain.encode(t, special)
                ids.append(-1)  # the caller owns the list: the cache is not changed through it
    assert len(cached.l0) == 3 and cached.l0_hits == 10 and cached.l0_misses == 10
    assert (texts[0], True) not in cached.l0 and (texts[-1], False) in cached.l0  # the oldest went first
    assert cached.encode(texts[-1]) == plain.encode(texts[-1])
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert cached.request_ids("/v1/chat/completions", chat) == plain.request_ids("/v1/chat/completions", chat)
    hits = cached.l0_hits
    assert cached.request_ids("/v1/chat/completions", chat) == plain.request_ids("/v1/chat/completions", chat)
    assert cached.l0_hits == hits + 1  # the rendered chat text is the key
    assert plain.l0 == {} and plain.l0_hits == 0  # off by default, as sglang-router's


def test_l0_flags_are_sglang_routers_and_reach_the_tokenizer():
    import subprocess
    import sys

    from fleetserve.router.config import parse_args
    from fleetserve.router.kv_events.flags import make_kv_aware

    folder = tokenizer_cache_dir(default_model_path())
    cfg = parse_args(["--policy", "kv_aware", "--tokenizer-path", folder, "--tokenizer-cache-enable-l0",
                      "--tokenizer-cache-l0-max-entries", "7"])
    policy = make_kv_aware(cfg)
    try:
        assert policy.tokenizer.l0_max_entries == 7
    finally:
        policy.close()
    policy = make_kv_aware(parse_args(["--policy", "kv_aware", "--tokenizer-path", folder,
                                       "--tokenizer-cache-l0-max-entries", "7"]))
    try:
        assert policy.tokenizer.l0_max_entries == 0  # not enabled
    finally:
        policy.close()
    out = subprocess.run([sys.executable, "-m", "fleetserve.cli", "router", "--policy", "kv_aware",
                          "--tokenizer-path", folder, "--tokenizer-cache-l0-max-entries", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--tokenizer-cache-l0-max-entries" in out.stderr.strip().splitlines()[-1]


def test_cached_ids_leave_the_cyclic_gc_after_one_pass(smollm2):
    """Every cache entry holds its ids as a tuple of ints, which the cyclic GC stops tracking once it has
    looked at it (a list stays tracked): with lists, a full collection walked ~160k cached lists while
    new text was tokenized and stopped the event loop for ~100 ms at a time.  (A block's entry, a tuple
    holding its ids' tuple, is let go one pass after its ids: hence two passes here.)"""
    import gc

    tok, _, fast = smollm2
    rnd = random.Random(7)
    text = " ".join("".join(rnd.choice("abcdefghijklmnopqrstuvwxyzé") for _ in range(rnd.randint(2, 9)))
                    for _ in range(3000))
    assert fast.encode(text) == tok.encode(text).ids  # ASCII blocks, unicode pieces: every cache filled
    ascii_text = text.replace("é", "e")
    ids, chars = fast.encode_chars(ascii_text)
    assert ids == tok.encode(ascii_text).ids and chars == "".join(map(chr, ids))
    caches = {"words": fast.words, "segments": fast.segments, "heads": fast.heads}
    assert all(caches.values()) and fast.blocks
    gc.collect()
    gc.collect()
    for name, cache in caches.items():
        assert all(type(v) is tuple and not gc.is_tracked(v) for v in cache.values()), name
    assert all(type(v[1]) is tuple and not gc.is_tracked(v) for v in fast.blocks.values())
    assert fast.encode(text) == tok.encode(text).ids  # and served from them, the same ids
