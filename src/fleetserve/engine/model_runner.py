"""The model runner: loads one rank's model shard, owns its KV pool, runs forwards.

Contract with the scheduler (ForwardBatch in, float32 logits out):

* ``forward(batch)`` writes every new token's KV to ``batch.out_cache_loc``,
  attends over each request's ``batch.kv_indices``, and returns logits
  ``[B, vocab]`` for each request's last new token, or ``[T, vocab]`` for every
  new token when ``batch.return_all_logits``. An IDLE batch (zero tokens)
  returns ``[0, vocab]`` -- and still runs every layer, so that collective
  operations inside the MoE / FFN layers line up across DP-attention ranks.
* ``allocator`` hands out pool slots; slot 0 is the scratch slot.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE, ParallelState
from fleetserve.core.forward_batch import ForwardBatch
from fleetserve.core.kv_pool import TokenSlotAllocator
from fleetserve.core.forward_context import ForwardContext
from fleetserve.models.config import architecture, is_gguf, load_model_config, resolve_dtype
from fleetserve.models.loader import open_weight_source, run_loaders
from fleetserve.models.registry import default_model_path, model_class

logger = logging.getLogger(__name__)

#: Fraction of available memory given to the KV pool when neither
#: ``max_total_tokens`` nor ``mem_fraction_static`` is set. Small on CPU: the
#: machines are shared and the pool is committed page by page as it fills.
DEFAULT_CPU_KV_FRACTION = 0.1
MAX_AUTO_TOKENS = 1 << 20


def available_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device``: ``cuda.mem_get_info`` on CUDA, ``MemAvailable``
    from ``/proc/meminfo`` on CPU (8 GiB if unreadable)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _eos_ids(config: Any, model_path: str) -> list[int]:
    ids: set[int] = set()

    def add(v: Any) -> None:
        if v is None:
            return
        if isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
        else:
            ids.add(int(v))

    add(getattr(config, "eos_token_id", None))
    if not is_gguf(model_path):
        gen = os.path.join(model_path, "generation_config.json")
        if os.path.isfile(gen):
            import json

            with open(gen) as f:
                add(json.load(f).get("eos_token_id"))
    return sorted(ids)


class ModelRunner:
    """One rank's model, KV pool and slot allocator.

    Args:
        model_path: HF directory or ``.gguf`` file; None = the built-in SmolLM2 GGUF.
        dtype: ``"auto"`` (bf16 where the CPU has AMX, else fp32), ``"float32"``, ``"bfloat16"``.
        max_total_tokens: KV pool size in tokens; None = from ``mem_fraction_static``.
        mem_fraction_static: fraction of free memory (after loading the weights)
            given to the KV pool (default 0.1 on CPU, 0.8 on CUDA).
        pstate: this rank's parallel layout.
        device: ``"cpu"`` or ``"cuda:N"``.
        show_progress: show a tqdm bar while loading weights.

    Attributes: ``model_config`` (the HF config), ``model``, ``vocab_size``,
    ``kv_pool`` (MHAKVPool or MLAKVPool), ``allocator``, ``max_total_tokens``,
    ``max_context_len``, ``dtype``, ``eos_token_ids``, ``kv_bytes_per_token``.
    """

    def __init__(self, model_path: str | None = None, dtype: str | torch.dtype = "auto",
                 max_total_tokens: int | None = None, mem_fraction_static: float | None = None,
                 pstate: ParallelState = SINGLE_RANK_STATE, device: str | torch.device = "cpu", show_progress: bool = True):
        self.model_path = model_path or default_model_path()
        self.device = torch.device(device)
        self.pstate = pstate
        self.dtype = resolve_dtype(dtype)
        self.model_config = load_model_config(self.model_path)
        config = self.model_config
        self.vocab_size = int(config.vocab_size)
        self.eos_token_ids = _eos_ids(config, self.model_path)

        cls = model_class(architecture(config))
        self.model = cls(config, pstate=pstate, dtype=self.dtype)
        source = open_weight_source(self.model_path, config)
        name = os.path.basename(self.model_path.rstrip("/"))
        run_loaders(self.model.weight_loaders(source), desc=f"Loading {name}", show_progress=show_progress)
        source.close()
        self.model.to(self.device).eval()

        self.kv_bytes_per_token = self.model.kv_bytes_per_token(self.dtype)
        if max_total_tokens is None:
            frac = mem_fraction_static
            if frac is None:
                frac = 0.8 if self.device.type == "cuda" else DEFAULT_CPU_KV_FRACTION
            budget = int(available_memory_bytes(self.device) * frac)
            max_total_tokens = max(1, min(MAX_AUTO_TOKENS, budget // self.kv_bytes_per_token))
        self.max_total_tokens = int(max_total_tokens)
        self.max_context_len = min(int(config.max_position_embeddings), self.max_total_tokens)
        self.kv_pool = cls.kv_pool_class(size=self.max_total_tokens, dtype=self.dtype, device=self.device,
                                         **self.model.kv_pool_kwargs())
        self.allocator = TokenSlotAllocator(self.max_total_tokens)
        logger.info(
            "%s on %s (%s, rank tp=%d/%d ep=%d/%d): KV cache %s, %d bytes per token per rank, %d tokens (%.1f MiB)",
            architecture(config), self.device, str(self.dtype).replace("torch.", ""), pstate.tp_rank, pstate.tp_size,
            pstate.ep_rank, pstate.ep_size, type(self.kv_pool).__name__, self.kv_bytes_per_token,
            self.max_total_tokens, self.max_total_tokens * self.kv_bytes_per_token / 2**20)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one batch; returns float32 logits ``[B, vocab]`` (or ``[T, vocab]``
        with ``return_all_logits``; ``[0, vocab]`` for IDLE)."""
        meta = ForwardContext.build(batch, self.device)
        meta.global_num_tokens = batch.global_num_tokens  # DP attention's FFN gather (issue 5)
        hidden = self.model(batch.input_ids.to(self.device), meta, self.kv_pool)
        if not batch.return_all_logits:
            hidden = hidden.index_select(0, meta.last_token_idx)
        return self.model.compute_logits(hidden)
