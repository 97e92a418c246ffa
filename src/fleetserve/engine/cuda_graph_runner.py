"""Decode graphs: one captured forward per (batch size, KV width), replayed with padding.

A decode step of a small batch is dominated by kernel-launch overhead; a CUDA
graph replays the whole forward with one launch. Shapes are fixed at capture,
so :class:`DecodeGraphRunner` keeps one set of static input buffers per *key*
``(bs, seq_len)`` and, at run time, copies the real rows into the smallest key
that fits and fills the rest with padding values:

* ``bs`` (the *bucket*): the smallest captured batch size ``>=`` the step's token
  count. Without DP attention that is this rank's batch size; under DP attention
  it is the largest count over all attention groups
  (``DPStepPlan.max_num_tokens``), so every rank replays the same shape (the FFN
  gather inside the forward then has a fixed size), and an IDLE rank replays the
  bucket with padding rows only.
* ``seq_len``: the width of the padded KV index matrix, the smallest captured
  width ``>=`` the batch's longest sequence. It only shapes this rank's own
  attention (no collective depends on it), so ranks may differ here. A batch
  longer than every captured width still gets the bucket's row padding but runs
  eagerly on copies (:meth:`DecodeGraphRunner.run`), so the collectives keep
  their agreed shapes.

The model runner pads rows so that padding writes its KV only to the pool's
scratch slot 0 and attends only to it (see
:meth:`fleetserve.engine.model_runner.ModelRunner.forward`). The idea, the
bucket spacing and the ``disable_cuda_graph`` / ``cuda_graph_max_bs`` knobs are
SGLang's (``model_executor/cuda_graph_runner.py``).

:class:`EagerDecodeGraphRunner` has the same buffers, padding and bucket choice
but calls the forward eagerly instead of replaying a graph; it runs on CPU, so
tests cover the padding and the DP-attention agreement without a GPU.
"""

from __future__ import annotations

import bisect
from typing import Callable, Sequence

import torch

Key = tuple[int, int]


def default_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_bs`` (SGLang's spacing, capped)."""
    sizes = [b for b in (1, 2, 4) if b <= max_bs] + list(range(8, max_bs + 1, 8))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(set(sizes))


def default_seq_len_buckets(max_len: int, smallest: int = 256) -> list[int]:
    """KV widths ``smallest, 2 * smallest, ...`` (powers of two), then ``max_len`` itself.

    Args:
        max_len: the longest sequence the runner serves (``max_context_len``); >= 1.

    Returns:
        Sorted widths whose last entry is ``max_len`` (``[max_len]`` when it is <= ``smallest``).
    """
    widths, w = [], smallest
    while w < max_len:
        widths.append(w)
        w *= 2
    return widths + [int(max_len)]


def choose_bucket(num_tokens: int, batch_sizes: Sequence[int]) -> int | None:
    """Smallest captured size ``>= num_tokens`` (``batch_sizes`` sorted); ``None`` if too large.

    ``num_tokens`` is this rank's batch size without DP attention, and the maximum
    over all attention groups with it, so every rank picks the same bucket. Zero
    (every rank IDLE) picks the smallest size.
    """
    i = bisect.bisect_left(batch_sizes, max(1, int(num_tokens)))
    return batch_sizes[i] if i < len(batch_sizes) else None


class DecodeGraphRunner:
    """Captured decode forwards, one per ``(bs, seq_len)`` key (CUDA only).

    Args:
        forward_fn: ``forward_fn(**static_inputs) -> Tensor [bs, ...]``; on CUDA it must run
            only device work on fixed shapes (no host syncs, no allocation sized by data).
        make_static_inputs: ``(bs, seq_len) -> {name: tensor}``, the static buffers of one key;
            every tensor's first dimension is ``bs``.
        pad_values: ``{name: value}`` written wherever the real rows do not reach (default 0).
        batch_sizes: bucket sizes to capture (sorted here).
        seq_len_buckets: KV widths to capture (sorted here).
        warmup: eager runs before each capture (lets kernels pick their algorithms).

    Attributes:
        last_key: the key the last :meth:`run` used (``None`` before the first).

    Raises:
        RuntimeError: CUDA is not available (graphs are CUDA-only; see :class:`EagerDecodeGraphRunner`).
    """

    def __init__(self, forward_fn: Callable[..., torch.Tensor],
                 make_static_inputs: Callable[[int, int], dict[str, torch.Tensor]],
                 pad_values: dict[str, float | int], batch_sizes: Sequence[int],
                 seq_len_buckets: Sequence[int] = (1,), warmup: int = 2):
        self._check_device()
        self.forward_fn = forward_fn
        self.make_static_inputs = make_static_inputs
        self.pad_values = dict(pad_values)
        self.batch_sizes = sorted(set(int(b) for b in batch_sizes))
        self.seq_len_buckets = sorted(set(int(s) for s in seq_len_buckets))
        if not self.batch_sizes or not self.seq_len_buckets:
            raise ValueError("a decode graph runner needs at least one batch size and one KV width")
        self.warmup = warmup
        self.graphs: dict[Key, torch.cuda.CUDAGraph] = {}
        self.inputs: dict[Key, dict[str, torch.Tensor]] = {}
        self.outputs: dict[Key, torch.Tensor] = {}
        self.pool = None
        self.last_key: Key | None = None

    @staticmethod
    def _check_device() -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device; the CPU path runs eagerly")

    def keys(self) -> list[Key]:
        return [(b, s) for b in self.batch_sizes for s in self.seq_len_buckets]

    def capture(self) -> None:
        """Capture every key, largest first so that smaller graphs reuse its memory pool."""
        stream = torch.cuda.Stream()
        for key in sorted(self.keys(), reverse=True):
            inputs = self.make_static_inputs(*key)
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
            self.graphs[key], self.inputs[key], self.outputs[key] = graph, inputs, out
        torch.cuda.synchronize()

    def _launch(self, key: Key) -> torch.Tensor:
        self.graphs[key].replay()
        return self.outputs[key]

    def bucket_for(self, num_tokens: int) -> int | None:
        """The batch-size bucket for ``num_tokens`` rows (:func:`choose_bucket`)."""
        return choose_bucket(num_tokens, self.batch_sizes)

    def run(self, inputs: dict[str, torch.Tensor], bucket: int, seq_len: int) -> torch.Tensor:
        """Copy the real rows into the buffers of ``(bucket, width)``, pad the rest, run.

        Args:
            inputs: ``{name: [n, ...]}`` real rows (``n <= bucket``; ``n == 0`` for IDLE); a
                tensor may be narrower than its buffer in later dimensions too (the KV
                index matrix ``[n, w]`` with ``w <= width``).
            bucket: a captured batch size (:meth:`bucket_for` of the step's token count).
            seq_len: the batch's longest sequence; picks ``width``, the smallest captured
                KV width that holds it. Past every width the same padded rows run eagerly
                on fresh tensors ``seq_len`` wide.

        Returns:
            The first ``n`` rows of the output; a view into a static buffer on the graph
            path (copy it before the next run).
        """
        i = bisect.bisect_left(self.seq_len_buckets, max(1, int(seq_len)))
        n = next(iter(inputs.values())).shape[0] if inputs else 0
        if i == len(self.seq_len_buckets):  # longer than every captured width
            self.last_key = (bucket, int(seq_len))
            padded = {}
            for name, src in inputs.items():  # 2-D inputs are KV index matrices, seq_len wide
                tail = (int(seq_len),) if src.dim() == 2 else tuple(src.shape[1:])
                buf = torch.empty((bucket, *tail), dtype=src.dtype, device=src.device)
                padded[name] = self._padded(buf, src, name)
            return self.forward_fn(**padded)[:n]
        key = (bucket, self.seq_len_buckets[i])
        static = self.inputs[key]
        for name, buf in static.items():
            self._padded(buf, inputs[name], name)
        self.last_key = key
        return self._launch(key)[:n]

    def _padded(self, buf: torch.Tensor, src: torch.Tensor, name: str) -> torch.Tensor:
        region = tuple(slice(0, s) for s in src.shape)
        buf.fill_(self.pad_values.get(name, 0))
        buf[region].copy_(src, non_blocking=True)
        return buf


class EagerDecodeGraphRunner(DecodeGraphRunner):
    """:class:`DecodeGraphRunner` without graphs: same static buffers, padding and key
    choice, but :meth:`run` calls ``forward_fn`` eagerly on the padded buffers.

    Runs anywhere (CPU included); the model runner builds it only when asked to
    (``ModelRunner(eager_graph_stand_in=True)``), for tests of the graph path.
    """

    @staticmethod
    def _check_device() -> None:
        pass

    def capture(self) -> None:
        """Allocate every key's static buffers (nothing is captured)."""
        for key in self.keys():
            self.inputs[key] = self.make_static_inputs(*key)

    def _launch(self, key: Key) -> torch.Tensor:
        self.outputs[key] = self.forward_fn(**self.inputs[key])
        return self.outputs[key]
