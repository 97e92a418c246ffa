"""Incremental detokenization and stop strings: the detokenizing side of a request.

The scheduler ends a request on EOS, a stop token id, its length or an abort;
it never decodes text. Stop strings are found here, and only here, for the
HTTP server (:mod:`fleetserve.entrypoints.tokenizer_manager`) and the offline
``fleetserve.Engine`` (:mod:`fleetserve.entrypoints.engine`) alike: both feed
every scheduler message of a request through one :class:`RequestDetokenizer`.

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

from fleetserve.engine.io_struct import ReqOutput
from fleetserve.engine.sampling_params import SamplingParams

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
    def decoded_len(self) -> int:
        """Characters detokenized so far, emitted or still held back."""
        return self._decoded_len

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


@dataclass
class DetokenizedStep:
    """What the detokenizing side makes of one scheduler message.

    Attributes:
        text: text to deliver now (UTF-8 complete; a stop string and what follows it removed).
        token_ids: the message's tokens the client gets: all of them, or those up to and
            including the one that completed a stop string.
        token_offsets: per delivered token, the length of the output text before it.
        output_logprobs / output_top_logprobs: the message's, cut to ``token_ids`` (None when not asked).
        finished: the client's last step.
        finish_reason: when finished, in the scheduler's form: ``{"type": "stop", "matched": <stop
            string>}`` when a stop string ended the output, else the scheduler's own reason.
        abort_scheduler: a stop string ended the output while the scheduler is still generating:
            the caller must abort the request there (this frees its KV at once).
        completion_tokens: tokens delivered so far (the usage count the client sees).
    """

    text: str
    token_ids: list[int]
    token_offsets: list[int]
    output_logprobs: list[tuple[float, int]] | None
    output_top_logprobs: list[list[tuple[float, int]]] | None
    finished: bool
    finish_reason: dict[str, Any] | None
    abort_scheduler: bool
    completion_tokens: int


class RequestDetokenizer:
    """One request's scheduler messages in, the client's text, tokens and finish out.

    Args:
        tokenizer: as for :class:`IncrementalDetokenizer`; ``None`` (``--skip-tokenizer-init``)
            delivers tokens only: no text, and stop strings are not checked.
        sampling: the request's parameters (``stop``, ``skip_special_tokens``).
        per_token: detokenize token by token even without stop strings (needed for per-token
            text offsets).
        trim_stop_token: leave the text of a matched stop token id out of the text (the token
            itself is still delivered and counted). The offline Engine does; the HTTP server
            does not.
    """

    def __init__(self, tokenizer: Any, sampling: SamplingParams, per_token: bool = False,
                 trim_stop_token: bool = False):
        self.stream = (TextStream(tokenizer, sampling.stop, sampling.skip_special_tokens, per_token=per_token)
                       if tokenizer is not None else None)
        self.trim_stop_token = trim_stop_token
        self.completion_tokens = 0
        self.finished = False

    @property
    def text(self) -> str:
        """All text delivered so far."""
        return self.stream.text if self.stream is not None else ""

    @property
    def matched(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self.stream.matched if self.stream is not None else None

    def feed(self, out: ReqOutput) -> DetokenizedStep:
        """Turn the next scheduler message of this request into the client's step.

        Messages arriving after the request finished here (the scheduler's answer to the
        abort) give an empty finished step.
        """
        ids = [int(t) for t in out.new_token_ids]
        if self.finished:
            return DetokenizedStep("", [], [], None, None, True, None, False, self.completion_tokens)
        if self.stream is None:
            text, consumed, stopped = "", len(ids), False
            offsets = [0] * len(ids)
        else:
            fr = out.finish_reason or {}
            trim = (self.trim_stop_token and out.finished and bool(ids)
                    and isinstance(fr.get("matched"), int) and ids[-1] == fr["matched"])
            step = self.stream.add(ids[:-1] if trim else ids)
            text, consumed, stopped, offsets = step.text, step.consumed, step.stopped, list(step.token_offsets)
            if trim and not stopped:  # the stop token is delivered, its text is not
                consumed += 1
                offsets.append(self.stream.decoded_len)
        self.completion_tokens += consumed
        finished = out.finished or stopped
        finish_reason = None
        if finished:
            self.finished = True
            if stopped:
                finish_reason = {"type": "stop", "matched": self.stream.matched}
            else:
                if self.stream is not None:
                    text += self.stream.finish()
                finish_reason = out.finish_reason
        return DetokenizedStep(
            text=text,
            token_ids=ids[:consumed],
            token_offsets=offsets,
            output_logprobs=out.output_logprobs[:consumed] if out.output_logprobs is not None else None,
            output_top_logprobs=(out.output_top_logprobs[:consumed]
                                 if out.output_top_logprobs is not None else None),
            finished=finished,
            finish_reason=finish_reason,
            abort_scheduler=stopped and not out.finished,
            completion_tokens=self.completion_tokens,
        )
