"""The grammar library behind structured outputs: llguidance.

Why llguidance and not xgrammar: see docs/structured_outputs.md and the
``grammar-backends`` table of docs/benchmarks.md (``benchmarks/grammar_backends.py``).

One :class:`GrammarBackend` per scheduler holds llguidance's view of the
tokenizer (built once, ~2-3 s for a 49k vocabulary, so lazily and off the
scheduler step); matchers are per request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fleetserve.engine.grammar.bitmask import allocate_bitmask
from fleetserve.engine.grammar.spec import GrammarError, GrammarKey, to_library_grammar


class GrammarBackend:
    """llguidance over one tokenizer.

    Args:
        hf_tokenizer: a ``transformers`` fast tokenizer.
        vocab_size: the model's vocabulary (logit width; may exceed the tokenizer's).
        eos_token_ids: the ids that end generation; a finished grammar allows exactly these.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        eos = [int(t) for t in eos_token_ids] or None
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size

    def compile(self, key: GrammarKey) -> str:
        """The library's grammar definition for ``key``. Raises :class:`GrammarError`."""
        return to_library_grammar(key)

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher (``llguidance.LLMatcher``) at the grammar's start.

        Raises:
            GrammarError: the grammar fails against this tokenizer.
        """
        m = self._llg.LLMatcher(self.tokenizer, grammar)
        if m.is_error():
            raise GrammarError(f"grammar rejected: {m.get_error()}", "grammar")
        return m


def fill_bitmask(matchers: Sequence[Any], vocab_size: int) -> torch.Tensor:
    """The next-token bitmask of each matcher: int32 ``[len(matchers), ceil(V / 32)]``."""
    mask = allocate_bitmask(len(matchers), vocab_size)
    for j, m in enumerate(matchers):
        row = mask[j]
        m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
    return mask


def accept_token(matcher: Any, token: int) -> bool:
    """Advance ``matcher`` by the sampled ``token``; False when the grammar forbids it."""
    return bool(matcher.consume_token(int(token)))


def is_finished(matcher: Any) -> bool:
    """The grammar allows no further token (it consumed an EOS, or it is complete with nothing to add)."""
    return bool(matcher.is_stopped())


BackendFactory = Callable[[], GrammarBackend]
