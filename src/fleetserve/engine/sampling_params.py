"""Per-request sampling parameters, validated before a request enters the engine.

Field names and defaults follow SGLang's ``SamplingParams`` (and OpenAI's
meaning where they overlap).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

# Largest top_k accepted (the sampler holds it in an int64 tensor; any value past the
# vocabulary size already means "no limit").
MAX_TOP_K = 2**31 - 1
# Seeds go to torch.Generator.manual_seed (64-bit); sample i of n uses seed + i.
SEED_LIMIT = 2**63


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range. ``param`` names the offending field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
        max_new_tokens: upper bound on generated tokens (``None``: up to the context limit).
        temperature: 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) disables.
        min_p: drop tokens whose probability is below ``min_p * p_max``; 0 disables.
        seed: per-request RNG seed; the same seed gives the same samples.
        repetition_penalty: CTRL-style (Keskar et al. 2019) divisor for logits of
            tokens already in prompt or output; 1 disables.
        frequency_penalty / presence_penalty: OpenAI's additive penalties over the
            output tokens so far, in [-2, 2].
        stop: stop strings (the matched string is not part of the returned text). Only the
            detokenizing side reads them; the scheduler ignores this field.
        stop_token_ids: extra token ids that end generation.
        ignore_eos: keep generating past the model's EOS.
        n: parallel samples sharing one prefill.
        skip_special_tokens: drop special tokens when detokenizing.
        json_schema / regex / ebnf: constrained decoding (SGLang's names; at most one):
            a JSON schema as JSON text, a regular expression the whole output
            matches, or a GBNF / Lark grammar (:mod:`fleetserve.engine.grammar`).
    """

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Build from a plain dict (SGLang's ``sampling_params``); unknown keys raise."""
        d = dict(d or {})
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if d.get("stop") is None:
            d.pop("stop", None)
        if d.get("stop_token_ids") is None:
            d.pop("stop_token_ids", None)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise SamplingParamsError(f"unknown sampling parameter(s): {', '.join(unknown)}", unknown[0])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def verify(self, vocab_size: int) -> None:
        """Check ranges. Raises :class:`SamplingParamsError` naming the bad field."""

        def bad(msg: str, param: str) -> None:
            raise SamplingParamsError(msg, param)

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: Any) -> bool:  # NaN and infinities are no sampling values
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if self.max_new_tokens is not None and (not is_int(self.max_new_tokens) or self.max_new_tokens < 0):
            bad(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}", "max_new_tokens")
        if not is_num(self.temperature) or self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature!r}", "temperature")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (-1, 0)) or self.top_k > MAX_TOP_K:
            bad(f"top_k must be -1 (disabled) or in [1, {MAX_TOP_K}], got {self.top_k!r}", "top_k")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if self.seed is not None and (not is_int(self.seed) or not -SEED_LIMIT <= self.seed < SEED_LIMIT):
            bad(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}", "seed")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}", "repetition_penalty")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                bad(f"{name} must be in [-2, 2], got {v!r}", name)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be a string or a list of non-empty strings", "stop")
        if not isinstance(self.stop_token_ids, list):
            bad(f"stop_token_ids must be a list of integers in [0, {vocab_size})", "stop_token_ids")
        for i, t in enumerate(self.stop_token_ids):
            if not is_int(t) or not 0 <= t < vocab_size:
                bad(f"stop_token_ids[{i}] = {t!r} is not a token id: ids must be integers in [0, {vocab_size})",
                    "stop_token_ids")
        if not is_int(self.n) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}", "n")
        if self.json_schema is not None or self.regex is not None or self.ebnf is not None:
            from fleetserve.engine.grammar.spec import GrammarError, check_grammar

            try:
                check_grammar(self)
            except GrammarError as e:
                bad(str(e), e.param)

    @property
    def has_grammar(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None
