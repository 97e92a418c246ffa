"""A faster exact encoder for byte-level BPE tokenizers (GPT-2, SmolLM2, Llama 3, Qwen2 shapes).

Why: ``tokenizers.Tokenizer.encode`` of a 1-2 KB prompt costs about 0.3-1 ms
of CPU on the 2-core bench machine, most of it in the pre-tokenizer's regex
split and in building the ``Encoding`` (offsets, masks, words) the router does
not need.  The router only needs the ids, so for tokenizers of one known shape
it does the same steps itself:

1. split the text on the added tokens (longest first, matched on the raw text,
   as ``tokenizers`` does when none of them has ``lstrip`` / ``rstrip`` /
   ``single_word`` and there is no normalizer);
2. split each stretch between them with the pre-tokenizer's regex (the
   ``regex`` module, which knows ``\\p{L}`` / ``\\p{N}`` as Oniguruma does; for
   an all-ASCII stretch and the GPT-2 pattern, the standard ``re`` with the
   ASCII classes written out, about twice as fast);
3. map each piece's UTF-8 bytes to the byte-level alphabet (GPT-2's
   ``bytes_to_unicode``) and run the tokenizer's own BPE model on it
   (``Tokenizer.model.tokenize``), remembering the ids per piece in a bounded
   word cache (:data:`DEFAULT_MAX_WORDS` pieces; the cache is emptied when full);
   ASCII text under the GPT-2 pattern skips the regex where it can: it is cut
   at spaces into segments that are provably piece-aligned, each cached with
   its ids (:meth:`ByteLevelBPE._segments`);
4. ASCII text longer than :data:`BLOCK_CHARS` under the GPT-2 pattern is first cut
   into blocks of about that many characters, each cut before a space that follows
   a non-space (a piece boundary, see ``_segments``), and each block's ids are
   remembered keyed by (the block before it, its text): a prompt whose opening
   blocks were seen before (a shared system prompt, document or few-shot
   preamble, a conversation's earlier turns) gets their ids in one dict look-up
   per block and encodes only the rest (:meth:`ByteLevelBPE._blocks`; at most
   ``max_blocks`` blocks, the cache is emptied when full).  Each block also keeps its ids
   as characters (``chr(id)`` each), so :meth:`ByteLevelBPE.encode_chars` gives a text
   made of blocks the ids' character form (``routing_text.ids_text``'s) by joining strings;
5. add the post-processor's constant special tokens when asked.

Exactness: :meth:`ByteLevelBPE.from_tokenizer` returns None (the caller then
uses ``Tokenizer.encode``) unless the ``tokenizer.json`` is of that shape, and
unless the fast encoder gives the library's ids on :data:`PROBES`.  At run time
a text whose regex pieces do not cover it exactly is encoded by the library.
"""

from __future__ import annotations

import re
from itertools import chain, count, islice

import regex

DEFAULT_MAX_WORDS = 1 << 16  # entries in each of the two caches (pieces, segments; about 5-10 MB each at most)
DEFAULT_MAX_BLOCKS = 1 << 15  # entries in the prefix block cache (about 1 KB each: 32 MB at most)
BLOCK_CHARS = 256  # a block is cut at the first such space at least this many characters into it
_BLOCK_MAX_CHARS = 8 * BLOCK_CHARS  # a longer block (a long run without a cut) is encoded but not remembered

# The ByteLevel pre-tokenizer's own regex (tokenizers, pre_tokenizers/byte_level.rs; GPT-2's encoder.py)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same on ASCII-only text, with \p{L} / \p{N} / \s spelled out for the standard re module
_WS = r"\t\n\x0b\x0c\r "
GPT2_ASCII_PATTERN = (rf"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+"""
                      rf"""|[{_WS}]+(?![^{_WS}])|[{_WS}]+""")

_WS_CHARS = frozenset("\t\n\x0b\x0c\r ")  # the characters _WS spells out for the regex


def _no_segments(text: str) -> bool:
    """True when ``text`` has a double space or other whitespace before a space (then no ``_segments``).

    A one-character ``in`` first: CPython finds a single character with memchr, while a two-character
    needle ending in a space is slow on text full of spaces (the skip table keys on that space).
    """
    if "  " in text:
        return True
    for c in "\n\t\r\x0b\x0c":
        if c in text and c + " " in text:
            return True
    return False


# Texts the fast encoder must encode as the library does before it is used
PROBES = (
    "Hello world! It's 2026; we'll see.  Two  spaces,\ttab\nnew line\r\n\n  trailing   ",
    "Réponds en français: 你好世界 🙂😀 ÀÉÎõü ß ﬁ Ω ① ½ ٣ 𝔘𝔫𝔦",
    "".join(chr(c) for c in range(0, 128)) + "  \x1c\x1f \x0b\x0c  ",
    "".join(chr(c) for c in range(0, 128)) + " \x85\xa0\u1680\u2000\u2028\u3000\u200b\ufeff x",
    "x = [1, 22, 333, 4444]  # code\n\tif a<=b: return {'k': \"v\"}\n",
    "'S 'T 'RE 'Ve 'LL 'D don't I'm you're they've we'll he'd",
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (``encoder.py``, also tokenizers' ByteLevel)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


# latin-1 decoding turns byte b into chr(b); this table then maps chr(b) to its byte-level character
_BYTE_LEVEL = str.maketrans({chr(b): c for b, c in bytes_to_unicode().items()})


def _split_pattern(spec: dict) -> str | None:
    """The pre-tokenizer's regex when it is of a supported shape, else None."""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") is False and pre.get("use_regex", True) is True:
            return GPT2_PATTERN
        return None
    if pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers") or []
        if len(parts) != 2:
            return None
        split, byte_level = parts
        if (split.get("type") == "Split" and split.get("behavior") == "Isolated" and split.get("invert") is False
                and isinstance((split.get("pattern") or {}).get("Regex"), str)
                and byte_level.get("type") == "ByteLevel" and byte_level.get("add_prefix_space") is False
                and byte_level.get("use_regex") is False):
            return split["pattern"]["Regex"]
    return None


class ByteLevelBPE:
    """Exact ids of a byte-level BPE ``tokenizers.Tokenizer``, faster (see the module docstring).

    Use :meth:`from_tokenizer`; ``encode(text, add_special_tokens)`` returns ``list[int]``.
    Safe to call from several threads (the word cache is a dict; a lost insert only costs a recompute).
    """

    def __init__(self, tokenizer, pattern: str, added: dict[str, int], pre: list[int], post: list[int],
                 max_words: int = DEFAULT_MAX_WORDS, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.tokenizer = tokenizer
        self.model = tokenizer.model
        self.split = regex.compile(pattern).findall
        self.ascii_split = re.compile(GPT2_ASCII_PATTERN).findall if pattern == GPT2_PATTERN else None
        self.added = added
        self.added_split = (regex.compile("|".join(regex.escape(t) for t in sorted(added, key=len, reverse=True)))
                            if added else None)
        self.added_firsts = tuple(sorted({t[0] for t in added}))  # the first characters of the added tokens
        self.pre, self.post = pre, post
        self.pre_chars, self.post_chars = _as_chars(pre), _as_chars(post)
        self.max_words = max_words
        # _untracked: every cached id sequence is a tuple of ints, never a list.  The cyclic GC stops
        # tracking such a tuple at its first pass, where a list stays tracked for good; the caches hold
        # up to ~160k entries, and as lists a full collection walked them all, stopping every thread
        # (the event loop too) for ~100 ms at a time while new text was being tokenized.
        self.words: dict[str, tuple[int, ...]] = {}  # regex piece -> its BPE ids
        self.segments: dict[str, tuple[int, ...]] = {}  # ASCII chunk ("word,") -> ids of " word," (see _segments)
        self.heads: dict[str, tuple[int, ...]] = {}  # ASCII chunk that starts a text -> its ids
        self.max_blocks = max_blocks
        # (parent node, block) -> (node, ids, the ids as characters or None: _as_chars)
        self.blocks: dict[tuple[int, str], tuple[int, tuple[int, ...], str | None]] = {}
        self._nodes = count(1)  # block node ids (0: a text's start); next() on a count is atomic under the GIL
        self.block_hits = self.block_misses = 0
        self.fallbacks = 0  # texts the library encoded because the pieces did not cover them

    @classmethod
    def from_tokenizer(cls, tokenizer, spec: dict, max_words: int = DEFAULT_MAX_WORDS,
                       max_blocks: int = DEFAULT_MAX_BLOCKS) -> "ByteLevelBPE | None":
        """The fast encoder for ``tokenizer`` (``spec``: its parsed tokenizer.json), or None when unsupported."""
        if spec.get("normalizer") is not None or spec.get("truncation") or spec.get("padding"):
            return None
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
            return None
        if getattr(tokenizer, "encode_special_tokens", False):
            return None
        pattern = _split_pattern(spec)
        if pattern is None:
            return None
        added = {}
        for t in spec.get("added_tokens") or []:
            if t.get("lstrip") or t.get("rstrip") or t.get("single_word") or not t.get("content"):
                return None
            added[t["content"]] = t["id"]
        try:
            pre, post = _post_tokens(tokenizer)
            fast = cls(tokenizer, pattern, added, pre, post, max_words, max_blocks)
        except (regex.error, re.error, ValueError):
            return None
        sample = list(PROBES) + [PROBES[0] + c + PROBES[3] for c in list(added)[:8]]
        sample.append((PROBES[0] + PROBES[2] + PROBES[4] + PROBES[5]) * 3)  # ASCII, several blocks (step 4)
        for text in sample:
            for special in (True, False):
                if fast.encode(text, special) != tokenizer.encode(text, add_special_tokens=special).ids:
                    return None
        fast.words.clear()
        fast.segments.clear()
        fast.heads.clear()
        fast.blocks.clear()
        fast.block_hits = fast.block_misses = 0
        return fast

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = list(self.pre) if add_special_tokens else []
        if self.added_split is None or not any(map(text.__contains__, self.added_firsts)):
            ok = self._plain(text, out)  # no added token can be in it (one memchr per first character)
        else:
            ok, at = True, 0
            for m in self.added_split.finditer(text):
                if m.start() > at:
                    ok = ok and self._plain(text[at:m.start()], out)
                out.append(self.added[m.group()])
                at = m.end()
            if ok and at < len(text):
                ok = self._plain(text[at:], out)
        if not ok:
            self.fallbacks += 1
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            out += self.post
        return out

    def encode_chars(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], str | None]:
        """``(encode(text, add_special_tokens), chars)``: ``chars`` is ``"".join(map(chr, ids))`` joined from
        the blocks' own (step 4 of the module docstring) when the whole text went through the block chain,
        else None (the caller converts the ids itself where it needs them)."""
        if (self.ascii_split is None or not self.max_blocks or len(text) <= BLOCK_CHARS or not text.isascii()
                or (self.added_split is not None and any(map(text.__contains__, self.added_firsts)))):
            return self.encode(text, add_special_tokens), None  # not (only) the block chain: see encode / _plain
        out = list(self.pre) if add_special_tokens else []
        pieces = [self.pre_chars] if add_special_tokens else []
        if not self._blocks(text, out, pieces):
            self.fallbacks += 1
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids, None
        if add_special_tokens:
            out += self.post
            pieces.append(self.post_chars)
        return out, None if None in pieces else "".join(pieces)

    def _plain(self, text: str, out: list[int]) -> bool:
        """Append the ids of ``text`` (no added tokens in it) to ``out``; False when the split misses a character."""
        if self.ascii_split is not None and text.isascii():
            if len(text) > BLOCK_CHARS and self.max_blocks:
                return self._blocks(text, out)
            if not _no_segments(text):
                return self._segments(text, out)
        return self._pieces(text, out)

    def _blocks(self, text: str, out: list[int], chars: list | None = None) -> bool:
        """ASCII text under the GPT-2 pattern, as a chain of cached blocks (step 4 of the module docstring).

        A block ends before the first space at least :data:`BLOCK_CHARS` characters into it whose
        previous character is not whitespace (as in ``_segments``, such a space opens a piece and
        ends the one before, so the text's ids are the concatenation of its blocks' own ids); the
        last block runs to the end.  A block's cache key is (the node id of the block chain before
        it, its text): node ids are unique (a counter), so a hit means the whole text up to the
        block's end was seen, and the match is exact (dict keys compare the text itself).
        ``chars``: a list to append each block's ids as characters to (None where they are not all
        characters), when given.
        """
        blocks = self.blocks
        get, find = blocks.get, text.find
        n = len(text)
        node = start = hits = 0
        while start < n:
            cut = find(" ", start + BLOCK_CHARS)
            while cut > 0 and text[cut - 1] in _WS_CHARS:
                cut = find(" ", cut + 1)
            if cut < 0:
                cut = n
            block = text[start:cut]
            hit = get((node, block)) if node >= 0 else None
            if hit is not None:
                node, ids, piece = hit
                hits += 1
            else:
                self.block_misses += 1
                ids = []
                if not (self._pieces(block, ids) if _no_segments(block) else self._segments(block, ids)):
                    self.block_hits += hits
                    return False
                piece = _as_chars(ids)
                if node >= 0 and cut - start <= _BLOCK_MAX_CHARS:
                    if len(blocks) >= self.max_blocks:
                        blocks.clear()  # the node ids in hand stay unique: later look-ups of them just miss
                    child = next(self._nodes)
                    blocks[(node, block)] = (child, tuple(ids), piece)  # tuples: see _untracked
                    node = child
                else:
                    node = -1  # a block not remembered: the rest of the text is encoded but not remembered
            out += ids
            if chars is not None:
                chars.append(piece)
            start = cut
        self.block_hits += hits
        return True

    def _segments(self, text: str, out: list[int]) -> bool:
        """ASCII text under the GPT-2 pattern, cut before every space that follows a non-space.

        No GPT-2 piece holds a non-space followed by a space (a space only ever opens a piece or
        sits in an all-whitespace one), so such a cut is a piece boundary and the pieces on
        either side are those of each part alone: the ids are the concatenation of each
        segment's own ids, cached per segment (``" word,"``, keyed by ``"word,"``).  The caller checked that the
        text has no double space and no whitespace before a space, so every space is such a cut.
        """
        chunks = text.split(" ")
        first = chunks[0]
        spaced = self.segments  # chunk -> ids of " " + chunk
        start = len(out)
        try:  # every segment seen before: the ids are joined in C
            if first:
                out += self.heads[first]
            out += chain.from_iterable(map(spaced.__getitem__, islice(chunks, 1, None)))
            return True
        except KeyError:
            del out[start:]
        for i, chunk in enumerate(chunks):
            if i == 0 and not chunk:
                continue
            cache = spaced if i else self.heads
            ids = cache.get(chunk)
            if ids is None:
                ids = []
                if not self._pieces(" " + chunk if i else chunk, ids):
                    return False
                if len(cache) >= self.max_words:
                    cache.clear()
                cache[chunk] = tuple(ids)  # see _untracked
            out += ids
        return True

    def _pieces(self, text: str, out: list[int]) -> bool:
        """Append the ids of ``text`` split by the pre-tokenizer's regex, BPE per piece (cached)."""
        pieces = self.ascii_split(text) if self.ascii_split is not None and text.isascii() else self.split(text)
        if sum(map(len, pieces)) != len(text):
            return False
        words = self.words
        start = len(out)
        try:  # every piece seen before: the ids are joined in C
            out += chain.from_iterable(map(words.__getitem__, pieces))
            return True
        except KeyError:
            del out[start:]
        for piece in pieces:
            ids = words.get(piece)
            if ids is None:
                mapped = piece.encode("utf-8").decode("latin-1").translate(_BYTE_LEVEL)
                ids = tuple([t.id for t in self.model.tokenize(mapped)])  # see _untracked
                if len(words) >= self.max_words:
                    words.clear()
                words[piece] = ids
            out += ids
        return True


def _as_chars(ids: list[int]) -> str | None:
    """The ids as one character each (``chr(id)``); None when one is no code point (past 0x10FFFF)."""
    try:
        return "".join(map(chr, ids))
    except (ValueError, OverflowError, TypeError):
        return None


def _post_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the post-processor adds before and after a single text; ValueError when not constant."""
    found = None
    for probe in ("a", "Hello world, 123"):
        full = tokenizer.encode(probe).ids
        bare = tokenizer.encode(probe, add_special_tokens=False).ids
        for i in range(len(full) - len(bare) + 1):
            if full[i:i + len(bare)] == bare:
                cut = (full[:i], full[i + len(bare):])
                break
        else:
            raise ValueError("the post-processor changes the text's ids")
        if found is not None and cut != found:
            raise ValueError("the post-processor's tokens are not constant")
        found = cut
    return found
