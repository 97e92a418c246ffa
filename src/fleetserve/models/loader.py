"""Reading weights: Hugging Face safetensors directories and GGUF files.

A *weight source* answers ``read(name, dim=None, start=None, end=None)`` with
the float tensor named ``name`` (Hugging Face names, e.g.
``model.layers.0.self_attn.q_proj.weight``), or only its slice
``[start, end)`` along ``dim``. Models pull exactly the tensors and slices
their rank holds (a TP shard, the local experts under EP), so a rank never
reads weights it does not serve: safetensors slices are read lazily from the
memory-mapped file, GGUF rows are cut before dequantizing.

Every source records what it read in ``reads`` (name, dim, start, end) so
tests can check what a rank touched.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from fleetserve.models.config import gguf_reader, is_gguf

logger = logging.getLogger(__name__)


class SafetensorsSource:
    """Weights of a Hugging Face directory: ``model.safetensors``, several
    ``*.safetensors`` files, or a sharded set with ``model.safetensors.index.json``.

    Raises FileNotFoundError when the directory holds no safetensors file.
    """

    def __init__(self, model_dir: str):
        from safetensors import safe_open

        self._safe_open = safe_open
        self.model_dir = model_dir
        self.reads: list[tuple[str, int | None, int | None, int | None]] = []
        index = os.path.join(model_dir, "model.safetensors.index.json")
        self._file_of: dict[str, str] = {}
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._file_of = {k: os.path.join(model_dir, v) for k, v in weight_map.items()}
        else:
            files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {model_dir}")
            for path in files:
                with safe_open(path, "pt") as f:
                    for k in f.keys():
                        self._file_of[k] = path
        self._handles: dict[str, Any] = {}

    def names(self) -> list[str]:
        return list(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} not found in {self.model_dir}")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = self._safe_open(path, "pt")
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int | None = None, end: int | None = None) -> torch.Tensor:
        self.reads.append((name, dim, start, end))
        h = self._handle(name)
        if dim is None:
            return h.get_tensor(name)
        index = tuple([slice(None)] * dim + [slice(start, end)])
        return h.get_slice(name)[index]

    def close(self) -> None:
        self._handles.clear()


# GGUF (llama.cpp) tensor names -> Hugging Face names, for the llama architecture.
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face name of a llama GGUF tensor (None when unmapped)."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}"
    return None


def unpermute_qk_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py``).

    llama.cpp stores each head's rows reordered from Hugging Face's half-split
    rotary layout to pairs: HF rows ``[h, pair, i]`` become ``[h, i, pair]``.
    This inverts it: view ``[n_head, d/2, 2, ...]``, swap axes 1 and 2, flatten
    back -- the same transform transformers applies when reading GGUF (K uses
    the KV head count).
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_gguf(data: np.ndarray, qtype: Any) -> torch.Tensor:
    """Dequantize GGUF tensor data to float32 ``[rows, cols]`` (or ``[n]``).

    The block formats SmolLM2-style files use (Q8_0, Q4_0, Q4_1; ggml's
    ``ggml-quants.c``) are unpacked with torch, with the same float32
    arithmetic as ``gguf.quants`` (``d * q`` then ``+ m``), so results are
    identical, only faster; float tensors are converted; every other type goes
    through ``gguf.quants.dequantize``.

    ``data``: the tensor's array from ``GGUFReader`` (rows of raw block bytes
    for quantized types).
    """
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    if qtype in (Q.F32, Q.F16, Q.BF16) or qtype not in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        out = np.asarray(dequantize(data, qtype), dtype=np.float32)
        return torch.from_numpy(out if out.flags.writeable and out.flags.c_contiguous else out.copy())
    raw = torch.from_numpy(np.array(data, copy=True).view(np.uint8))  # a private copy of the packed bytes
    rows = raw.shape[0] if raw.ndim == 2 else 1
    block_bytes = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}[qtype]
    blocks = raw.reshape(-1, block_bytes)
    d = blocks[:, :2].contiguous().view(torch.float16).float()  # [n, 1]
    if qtype == Q.Q8_0:
        out = blocks[:, 2:].contiguous().view(torch.int8).float() * d
    else:
        head = 4 if qtype == Q.Q4_1 else 2
        qs = blocks[:, head:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # low nibbles are elements 0..15, high ones 16..31
        if qtype == Q.Q4_1:
            m = blocks[:, 2:4].contiguous().view(torch.float16).float()
            out = d * q.float() + m
        else:
            out = d * (q.to(torch.int8) - 8).float()
    return out.reshape(rows, -1) if raw.ndim == 2 else out.reshape(-1)


class GGUFSource:
    """Weights of a llama GGUF file, dequantized to float32 with the ``gguf`` package.

    Args:
        path: the ``.gguf`` file.
        num_heads, num_kv_heads: for undoing the Q/K row permutation.
    """

    def __init__(self, path: str, num_heads: int, num_kv_heads: int):
        self.path = path
        self.reader = gguf_reader(path)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.reads: list[tuple[str, int | None, int | None, int | None]] = []
        self._tensors = {}
        for t in self.reader.tensors:
            hf = gguf_to_hf_name(t.name)
            if hf is not None:
                self._tensors[hf] = t

    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(x) for x in reversed(self._tensors[name].shape))

    def read(self, name: str, dim: int | None = None, start: int | None = None, end: int | None = None) -> torch.Tensor:
        self.reads.append((name, dim, start, end))
        if name not in self._tensors:
            raise KeyError(f"tensor {name!r} not found in {self.path}")
        t = self._tensors[name]
        data = t.data
        permuted = name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias"))
        if dim == 0 and not permuted and data.ndim == 2:
            # Rows are stored contiguously: cut them before dequantizing.
            return dequantize_gguf(data[start:end], t.tensor_type)
        out = dequantize_gguf(data, t.tensor_type).reshape(self.shape(name))
        if permuted:
            heads = self.num_heads if ".q_proj." in name else self.num_kv_heads
            out = torch.from_numpy(unpermute_qk_rows(out.numpy(), heads).copy())
        if dim is not None:
            out = out.narrow(dim, start, end - start).contiguous()
        return out

    def close(self) -> None:
        pass


def open_weight_source(model_path: str, config: Any):
    """A weight source for a HF directory or a GGUF file."""
    if is_gguf(model_path):
        return GGUFSource(model_path, config.num_attention_heads, config.num_key_value_heads)
    return SafetensorsSource(model_path)


def run_loaders(loaders: list[tuple[str, Callable[[], None]]], desc: str, show_progress: bool = True) -> None:
    """Run a model's weight-loading steps under a tqdm progress bar.

    ``loaders``: ``(label, fn)`` pairs from a model's ``weight_loaders(source)``.
    """
    bar = tqdm(loaders, desc=desc, unit="tensor group", disable=not show_progress, leave=False)
    with torch.no_grad():
        for label, fn in bar:
            bar.set_postfix_str(label, refresh=False)
            fn()
