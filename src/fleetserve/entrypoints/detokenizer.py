"""Incremental detokenization and stop-string hold-back (HTTP process side).

Two small state machines, combined per request by :class:`TextStream`:

* :class:`IncrementalDetokenizer` turns a growing list of token ids into text
  deltas. It decodes a short *window* (the tokens since the last emitted
  boundary) and emits the part of the window's text past what was already
  emitted. When the window text ends with U+FFFD the last token(s) stopped in
  the middle of a multi-byte UTF-8 character, so nothing is emitted until a
  later token completes it. The window therefore always starts on a character
  boundary, the deltas never split or repeat a character, and U+FFFD only comes
  out when the bytes are really invalid (or at :meth:`flush`, when the output
  ended in the middle of a character). The offsets technique is the one used by
  Hugging Face's ``TextStreamer`` and vLLM; decoding is always done with
  ``clean_up_tokenization_spaces=False`` so that text does not depend on where
  the windows fall.
* :class:`StopStringChecker` holds back the longest tail of the text that could
  still grow into a stop string, and cuts the text at the start of a stop string
  once one appears (OpenAI semantics: the stop string is not returned).

:class:`TextStream` feeds tokens one at a time through both, whatever the
chunking of the scheduler's messages, so the streamed deltas concatenate to
exactly the text a non-streamed request returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Token ids in, UTF-8-safe text deltas out.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=...)``
            (a transformers tokenizer).
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: a character boundary
        self.read_offset = 0  # tokens before this are fully emitted
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly complete text (possibly empty)."""
        self.ids.extend(int(t) for t in token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is still held back (the output ended): may contain U+FFFD."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        done = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        if not final and (len(window) <= len(done) or window.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing new, or a character is still incomplete
        if window.startswith(done):
            delta = window[len(done) :]
        else:  # a tokenizer that rewrites earlier text when more follows: emit the changed tail
            common = 0
            for a, b in zip(window, done):
                if a != b:
                    break
                common += 1
            delta = window[max(common, len(done)) :] if len(window) > len(done) else ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


class StopStringChecker:
    """Hold back text that may still become a stop string; cut at the first one found.

    Args:
        stops: stop strings (non-empty). With none, text passes through unchanged.
    """

    def __init__(self, stops: Sequence[str] | None):
        self.stops = [s for s in (stops or []) if s]
        self.max_hold = max((len(s) for s in self.stops), default=0)
        self.pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add text; return what is safe to emit. After a match, returns '' forever."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buf = self.pending + text
        best_pos, best_stop = -1, None
        for s in self.stops:
            pos = buf.find(s)
            if pos != -1 and (best_pos == -1 or pos < best_pos):
                best_pos, best_stop = pos, s
        if best_stop is not None:
            self.matched = best_stop
            self.pending = ""
            return buf[:best_pos]
        hold = self._partial_tail(buf)
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self.max_hold - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """The output ended without a match: release the held-back tail."""
        if self.matched is not None:
            return ""
        out, self.pending = self.pending, ""
        return out


@dataclass
class StreamStep:
    """What :meth:`TextStream.add` produced.

    Attributes:
        text: text to send now.
        consumed: how many of the offered tokens were used (fewer than offered
            when a stop string ended the output in the middle of a chunk).
        stopped: a stop string was found; ``TextStream.matched`` names it.
        token_offsets: for each consumed token, the length of the emitted text
            before that token's own characters (OpenAI's ``text_offset``; relative
            to the start of the output).
    """

    text: str
    consumed: int
    stopped: bool
    token_offsets: list[int] = field(default_factory=list)


class TextStream:
    """Per-request text state: detokenizer followed by stop-string hold-back.

    With stop strings (or ``per_token=True``, needed for per-token text offsets)
    tokens are processed one by one, so where a stop string cuts the output does
    not depend on how the scheduler grouped tokens into messages. Without them a
    whole message is detokenized at once, which gives the same text (the
    detokenizer's output does not depend on chunking) for fewer decode calls.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] | None = None, skip_special_tokens: bool = True,
                 per_token: bool = True):
        self.per_token = per_token or bool(stops)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = StopStringChecker(stops)
        self.text = ""  # emitted text
        self._decoded_len = 0  # detokenized characters so far (emitted or held)

    @property
    def matched(self) -> str | None:
        return self.stop.matched

    @property
    def finished(self) -> bool:
        return self.stop.matched is not None

    def add(self, token_ids: Sequence[int]) -> StreamStep:
        if not self.per_token:
            offsets = [self._decoded_len] * len(token_ids)
            delta = self.detok.add(token_ids)
            self._decoded_len += len(delta)
            self.text += delta
            return StreamStep(delta, len(token_ids), False, offsets)
        out: list[str] = []
        offsets: list[int] = []
        consumed = 0
        for t in token_ids:
            if self.finished:
                break
            offsets.append(self._decoded_len)
            delta = self.detok.add([t])
            self._decoded_len += len(delta)
            out.append(self.stop.feed(delta))
            consumed += 1
        text = "".join(out)
        self.text += text
        return StreamStep(text, consumed, self.finished, offsets)

    def finish(self) -> str:
        """The request ended: flush held bytes and held stop-string candidates."""
        if self.finished:
            return ""
        tail = self.detok.flush()
        self._decoded_len += len(tail)
        text = self.stop.feed(tail)
        text += self.stop.flush()
        self.text += text
        return text
