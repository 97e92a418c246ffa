"""Model configuration: the Hugging Face config of a model path, the serving
dtype, and which architecture class serves it.

A model path is either a Hugging Face directory (``config.json`` plus
safetensors) or a ``.gguf`` file. For GGUF we build the transformers config
ourselves from the file's metadata (llama.cpp's key names, e.g.
``llama.attention.head_count``), which is much faster than
``AutoConfig.from_pretrained(gguf_file=...)`` because the file is parsed once
and shared with the weight reader.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch


def is_gguf(model_path: str) -> bool:
    return os.path.isfile(model_path) and model_path.lower().endswith(".gguf")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"auto"`` -> bfloat16 on CUDA, float32 on CPU; ``"float32"`` / ``"bfloat16"`` / ``"float16"`` as named.

    On CPU ``auto`` stays float32 even where the CPU has AMX: on an AMX Xeon (2 cores,
    2026-12-02) the whole model in bfloat16 decoded 1.7x float32's tokens/s at 32 requests
    and was no faster at one, while ``--quantization bf16_linear`` (bfloat16 linears only,
    the rest float32) reached 1.9x (docs/benchmarks.md, "bf16 linears on AMX"); both
    change the greedy tokens, so neither is a default. (This function used to look for
    ``"AMX"`` in ``torch.backends.cpu.get_cpu_capability()``, which never says it: it
    reports ``"AVX512"`` on those Xeons, so ``auto`` was float32 there already.)
    Raises ValueError on other names.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.lower()
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, float32 or bfloat16")
    return table[name]


@functools.lru_cache(maxsize=2)
def gguf_reader(path: str):
    """A memory-mapped ``gguf.GGUFReader`` of ``path`` (parsed once per process).

    The same reader with one change: the file's ``np.memmap`` is held as a plain ``np.ndarray``
    view of the same mapping (no copy; tensor data still pages in from the file on use).
    ``GGUFReader`` slices its data a few hundred thousand times while it parses the metadata
    (every entry of the tokenizer's string arrays: SmolLM2's 49152 tokens and ~49k merges), and
    each memmap slice pays numpy's subclass hooks: 5.3 s of CPU per parse, against 1.3 s on plain
    views (gguf 0.19, AMD EPYC; every ``fleetserve serve`` start and model load pays it).
    Fields and tensors are equal to the stock reader's (``tests/unit/models/test_gguf_reader.py``)."""
    import gguf
    import numpy as np

    class _PlainViewReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped):  # GGUFReader.__init__ assigns its np.memmap here
            self._plain = mapped.view(np.ndarray)

    return _PlainViewReader(path)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def gguf_config(path: str):
    """A ``transformers.LlamaConfig`` from a GGUF file's metadata.

    Raises ValueError for architectures other than ``llama``.
    """
    from transformers import LlamaConfig

    r = gguf_reader(path)
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only llama)")
    heads = int(_field(r, f"{arch}.attention.head_count"))
    hidden = int(_field(r, f"{arch}.embedding_length"))
    kv_heads = int(_field(r, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(r, f"{arch}.attention.key_length", hidden // heads))
    tensor_names = {t.name for t in r.tensors}
    vocab = _field(r, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    rope = {"rope_type": "default", "rope_theta": float(_field(r, f"{arch}.rope.freq_base", 10000.0))}
    scaling = _field(r, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(_field(r, f"{arch}.rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    bos = _field(r, "tokenizer.ggml.bos_token_id")
    pad = _field(r, "tokenizer.ggml.padding_token_id")
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(r, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(r, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(_field(r, f"{arch}.context_length", 4096)),
        rms_norm_eps=float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        pad_token_id=None if pad is None else int(pad),
        architectures=["LlamaForCausalLM"],
    )


def load_model_config(model_path: str):
    """The transformers config of a HF directory or GGUF file (no network)."""
    if is_gguf(model_path):
        return gguf_config(model_path)
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model path {model_path!r} is neither a directory nor a .gguf file")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path, local_files_only=True)


def architecture(config: Any) -> str:
    """The serving class name: the config's first ``architectures`` entry, or
    one derived from ``model_type``."""
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0]
    by_type = {"llama": "LlamaForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM"}
    return by_type.get(getattr(config, "model_type", ""), "")
