"""Calibration pass for ``--quantization int8``: per-channel activation maxima of every linear.

SmoothQuant (:mod:`fleetserve.layers.smooth_quant`) needs ``max|X_j|`` of each linear's input
channels. At load time, before the KV cache exists, the model runs one float32 prefill of
:data:`CALIBRATION_TEXT` (this project's own mixed prose / code / list text, ~190 tokens;
not the text ``benchmarks/quant_quality.py`` scores) through a throwaway KV pool, with a
forward pre-hook on each linear recording ``max |x[:, j]|`` over the tokens. Under tensor
parallelism every rank runs the same prefill (the forward's collectives pair up); the
smoothing step all-reduces the maxima it needs.

A model without a tokenizer (the tiny test models) is calibrated on fixed pseudo-random
token ids (``torch.Generator`` seed 0), the same on every rank.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
from torch import nn

from fleetserve.core.forward_batch import ForwardBatch, ForwardMode
from fleetserve.core.forward_context import ForwardContext

logger = logging.getLogger(__name__)

CALIBRATION_TEXT = (
    "Notes from the workshop, Tuesday. We started with the budget: the new roof costs about 14,000 euros, "
    "and the grant covers 60% of it. Maria asked whether the old beams can stay; the builder says two of "
    "them must go.\n\n"
    "To do:\n1. Order the tiles (grey, not red).\n2. Call the electrician about the lights in the hall.\n"
    "3. Write to the neighbours before the scaffolding goes up.\n\n"
    "def total_cost(items, tax=0.2):\n    \"\"\"Sum of the prices, with tax.\"\"\"\n"
    "    return sum(price for _, price in items) * (1 + tax)\n\n"
    "Q: How long will the work take?\nA: Six weeks if the weather holds, eight if it does not. "
    "The children's room will be finished first, then the kitchen, then the stairs."
)
#: Token count used when the model has no tokenizer (random ids).
RANDOM_TOKENS = 192


def calibration_ids(model_path: str | None, vocab_size: int) -> list[int]:
    """Token ids of :data:`CALIBRATION_TEXT` under ``model_path``'s tokenizer, else fixed random ids."""
    try:
        from fleetserve.models.tokenizer import load_tokenizer

        ids = list(load_tokenizer(model_path).encode(CALIBRATION_TEXT))
        if ids and max(ids) < vocab_size:
            return ids
    except Exception as e:  # no tokenizer files next to a test model
        logger.info("int8 calibration: no tokenizer for %s (%s); using %d fixed random token ids",
                    model_path, type(e).__name__, RANDOM_TOKENS)
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (RANDOM_TOKENS,), generator=g).tolist()


def activation_absmax(model: nn.Module, targets: Sequence[nn.Module], ids: Sequence[int],
                      dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[nn.Module, torch.Tensor]:
    """``{linear: max |x[:, j]|}`` (float32 ``[local in]``) for each of ``targets`` over one prefill of ``ids``.

    ``model``: a decoder with ``kv_pool_class`` / ``kv_pool_kwargs()`` and
    ``forward(input_ids, meta, pool)`` / ``compute_logits(hidden)`` (every token's hidden
    goes through the LM head, so it is calibrated too). Runs the model's current linears.
    """
    stats: dict[nn.Module, torch.Tensor] = {}

    def hook(mod: nn.Module, args: tuple) -> None:
        x = args[0]
        if x.numel() == 0:
            return
        m = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float().cpu()
        stats[mod] = m if mod not in stats else torch.maximum(stats[mod], m)

    n = len(ids)
    pool = model.kv_pool_class(size=n, dtype=dtype, device=device, **model.kv_pool_kwargs())
    t = lambda v: torch.tensor(v, dtype=torch.int64)
    slots = torch.arange(1, n + 1, dtype=torch.int64)
    batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=t(list(ids)), positions=torch.arange(n),
                         out_cache_loc=slots, seq_lens=t([n]), extend_prefix_lens=t([0]), extend_seq_lens=t([n]),
                         kv_indices=[slots.clone()], return_all_logits=True)
    handles = [m.register_forward_pre_hook(hook) for m in targets]
    try:
        with torch.inference_mode():
            meta = ForwardContext.build(batch, device)
            hidden = model(batch.input_ids.to(device), meta, pool)
            model.compute_logits(hidden)
    finally:
        for h in handles:
            h.remove()
    del pool
    return stats


def calibrator(model: nn.Module, model_path: str | None, vocab_size: int, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> Callable[[Sequence[nn.Module]], dict[nn.Module, torch.Tensor]]:
    """The ``calibrate(targets)`` callable :func:`fleetserve.layers.quantization.apply_quantization` takes."""

    def calibrate(targets: Sequence[nn.Module]) -> dict[nn.Module, Any]:
        return activation_absmax(model, targets, calibration_ids(model_path, vocab_size), dtype, device)

    return calibrate
