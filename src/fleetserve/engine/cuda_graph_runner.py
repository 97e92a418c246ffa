"""Decode CUDA graphs: capture once per batch size, replay with padding (CUDA only).

A decode step of a small batch is dominated by kernel-launch overhead; a CUDA
graph replays the whole forward with one launch. Shapes are fixed at capture,
so :class:`DecodeGraphRunner` captures one graph per batch size in
``batch_sizes`` over static input buffers, and at run time pads the real batch
up to the smallest captured size that fits (the *bucket*).

Under DP attention every rank must replay the *same* shape (the FFN gather
inside the graph has a fixed size), so the bucket comes from the largest
token count over all attention groups (``DPStepPlan.max_num_tokens``), and a
graph is used only when the all-reduce(MIN) said every rank is DECODE or IDLE
(``ForwardBatch.can_run_graph``). An IDLE rank replays the bucket with padding
rows only. Padding rows write their KV to the scratch slot 0 of the pool.

On CPU there are no CUDA graphs; :func:`choose_bucket` and
:func:`default_batch_sizes` are plain functions and are tested there.
"""

from __future__ import annotations

import bisect
from typing import Callable

import torch


def default_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_bs`` (SGLang's spacing, capped)."""
    sizes = [b for b in (1, 2, 4) if b <= max_bs] + list(range(8, max_bs + 1, 8))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(set(sizes))


def choose_bucket(num_tokens: int, batch_sizes: list[int]) -> int | None:
    """Smallest captured size ``>= num_tokens`` (``batch_sizes`` sorted); ``None`` if too large.

    ``num_tokens`` is this rank's batch size without DP attention, and the maximum
    over all attention groups with it, so every rank picks the same bucket.
    """
    i = bisect.bisect_left(batch_sizes, max(1, int(num_tokens)))
    return batch_sizes[i] if i < len(batch_sizes) else None


class DecodeGraphRunner:
    """Captured decode forwards, one per batch size.

    Args:
        forward_fn: ``forward_fn(**static_inputs) -> Tensor`` of shape ``[bs, ...]``; must run
            only CUDA work on fixed shapes (no host syncs, no allocation that depends on data).
        make_static_inputs: ``bs -> {name: tensor}``, the static buffers for size ``bs``
            (first dimension ``bs``), already filled with valid padding values.
        pad_values: ``{name: value}`` written to the rows past the real batch on each replay.
        batch_sizes: sizes to capture (sorted ascending).
        warmup: eager runs before each capture (lets kernels pick algorithms).

    Raises:
        RuntimeError: CUDA is not available (graphs are CUDA-only).
    """

    def __init__(self, forward_fn: Callable[..., torch.Tensor],
                 make_static_inputs: Callable[[int], dict[str, torch.Tensor]],
                 pad_values: dict[str, float | int], batch_sizes: list[int], warmup: int = 2):
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device; the CPU path runs eagerly")
        self.forward_fn = forward_fn
        self.make_static_inputs = make_static_inputs
        self.pad_values = dict(pad_values)
        self.batch_sizes = sorted(batch_sizes)
        self.warmup = warmup
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def capture(self) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool."""
        stream = torch.cuda.Stream()
        for bs in reversed(self.batch_sizes):
            inputs = self.make_static_inputs(bs)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(self.warmup):
                    self.forward_fn(**inputs)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self.forward_fn(**inputs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs], self.inputs[bs], self.outputs[bs] = graph, inputs, out
        torch.cuda.synchronize()

    def bucket_for(self, num_tokens: int) -> int | None:
        return choose_bucket(num_tokens, self.batch_sizes)

    def replay(self, inputs: dict[str, torch.Tensor], bucket: int) -> torch.Tensor:
        """Copy the real rows into bucket ``bucket``'s buffers, pad the rest, replay.

        Args:
            inputs: ``{name: [n, ...]}`` real rows (``n <= bucket``; ``n == 0`` for IDLE).
            bucket: a captured size (from :meth:`bucket_for` of the instance-wide maximum).

        Returns:
            The first ``n`` rows of the captured output (a view into the static buffer:
            copy it before the next replay).
        """
        static = self.inputs[bucket]
        n = None
        for name, buf in static.items():
            src = inputs[name]
            n = src.shape[0] if n is None else n
            buf[: src.shape[0]].copy_(src, non_blocking=True)
            if src.shape[0] < bucket:
                buf[src.shape[0]:].fill_(self.pad_values.get(name, 0))
        self.graphs[bucket].replay()
        return self.outputs[bucket][: (n or 0)]
