"""Compiled decode steps: the CPU counterpart of decode CUDA graphs (``--enable-torch-compile``).

:class:`CompiledDecodeRunner` keeps the buckets, static buffers and padding of
:class:`~fleetserve.engine.cuda_graph_runner.DecodeGraphRunner` (a DECODE batch,
or under DP attention every rank's agreed DECODE / IDLE step, is padded to the
smallest batch-size bucket that holds it) and runs the padded forward through
``torch.compile`` (inductor's C++/OpenMP back-end on CPU) instead of replaying a
CUDA graph. SGLang does the same on CPU (``--enable-torch-compile``,
``--torch-compile-max-bs``; its ``cpu_graph_runner`` compiles one graph per
batch size with ``dynamic=False``).

Shapes: the batch size is static (one compiled graph per bucket, as SGLang);
the KV width (``kv_idx``'s second dimension) is dynamic, so one graph serves
every width and the step attends over the batch's longest sequence, as eager
does (not over a padded bucket width: a CUDA graph needs fixed buffers, a
compiled step does not). Start-up compiles ``len(batch_sizes)`` graphs.

Start-up: :meth:`capture` runs each bucket once eagerly (lazy state such as the
RoPE tables' device is settled before tracing), then once compiled, which
compiles it. Inside the graph every linear's gemm is one opaque custom op
(``fleetserve::gemm``, :mod:`fleetserve.layers.opaque_gemm`) that runs the layer's
eager kernel (oneDNN-packed float32, MKL, or the ``--quantization`` kernel), and
every collective is one too (:mod:`fleetserve.distributed.traceable`), so under
TP / DP attention / EP the graph does not split at each all-reduce and the gloo
calls are the eager ones. Inductor compiles what lies between them. Compile time
grows with the model's layers; on SmolLM2 it is minutes on a small shared
machine (see docs/benchmarks.md). Under several ranks the compile runs inside the
first compiled call, so a rank that compiles faster waits for the others in the
first collective: the process group's timeout must cover the difference.

Modules that read data on the host in their forward (``cuda_graph_safe = False``,
e.g. the DeepSeek MoE, which sizes each expert's matmul by ``bincount().tolist()``)
are run eagerly inside the compiled step (``torch.compiler.disable`` on that
module's forward), so the graph splits around them instead of recompiling for
every routing.

The results are not bit-identical to eager (inductor fuses and reorders float
arithmetic, order 1e-6 relative in float32); tests check greedy tokens.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch

from fleetserve.engine.cuda_graph_runner import EagerDecodeGraphRunner

logger = logging.getLogger(__name__)

#: Narrowest KV index matrix the compiled step is run with: dynamo specialises a dimension of
#: size 0 or 1, so width 1 (a batch of one-token sequences, an IDLE rank) would compile a
#: second graph; such batches get one more padding column (masked: it is past ``seq_lens``).
MIN_WIDTH = 2

#: Inductor options of the compiled step. ``freezing`` is left off: it folds the weights into
#: constants per graph (one more weight copy per bucket), and its one use here, oneDNN-packed
#: linears, is had without it (the gemms run their eager kernels as opaque ops).
COMPILE_OPTIONS: dict[str, object] = {}

#: Run the compiled step with ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: dynamo then
#: checks only the guards that tell its cache entries apart (here the bucket's input shapes) instead
#: of every guard (each parameter's and KV buffer's metadata, the modules' attributes), which cost
#: a few ms of CPU per SmolLM2 step at one thread. Safe as used here: after :meth:`capture` nothing
#: the graph specialised on changes (weights are updated in place, the gemm kernels are reached through
#: the opaque op's handle table, not traced); a process that flips :data:`fleetserve.core.fast_path.ENABLED`
#: keeps the compiled step's trace-time choice.
SKIP_GUARD_EVAL = True


def run_host_syncing_modules_eagerly(model: torch.nn.Module) -> list[str]:
    """Wrap the forward of every module with ``cuda_graph_safe = False`` in
    ``torch.compiler.disable`` (instance attribute; eager calls are unchanged).

    Returns the wrapped modules' class names (sorted, unique)."""
    names = set()
    for m in model.modules():
        if not getattr(m, "cuda_graph_safe", True) and not getattr(m, "_fleetserve_compile_disabled", False):
            m.forward = torch.compiler.disable(m.forward)
            m._fleetserve_compile_disabled = True
            names.add(type(m).__name__)
    return sorted(names)


class CompiledDecodeRunner(EagerDecodeGraphRunner):
    """Decode through ``torch.compile``, one graph per batch-size bucket (any device torch compiles for).

    Args: as :class:`~fleetserve.engine.cuda_graph_runner.DecodeGraphRunner`; ``forward_fn``
    must not read tensors on the host (the model runner's static decode forward does not).
    ``seq_len_buckets`` only sets the KV width each bucket is compiled at (the smallest, at
    least :data:`MIN_WIDTH`): at run time the width is the batch's longest sequence, as eager.

    ``regions`` (``--torch-compile-region layer``): compile these modules (the decoder layers)
    instead of the whole step; ``forward_fn`` then runs eagerly around them. Shapes there are
    dynamo's automatic dynamic ones (a dimension seen at two sizes becomes symbolic), so
    :meth:`capture` runs each bucket at two KV widths.

    Attributes:
        compiled: the ``torch.compile``-d ``forward_fn`` (``forward_fn`` itself with ``regions``).
        compile_seconds: ``{bucket: seconds}`` spent compiling each bucket in :meth:`capture`.
        last_key: ``(bucket, KV width)`` of the last :meth:`run`.
    """

    def __init__(self, forward_fn: Callable[..., torch.Tensor],
                 make_static_inputs: Callable[[int, int], dict[str, torch.Tensor]],
                 pad_values: dict[str, float | int], batch_sizes: Sequence[int],
                 seq_len_buckets: Sequence[int] = (MIN_WIDTH,), warmup: int = 1,
                 regions: Sequence[torch.nn.Module] | None = None):
        super().__init__(forward_fn, make_static_inputs, pad_values, batch_sizes, seq_len_buckets, warmup)
        self.regions = list(regions or [])
        if self.regions:
            # Regional compilation: each repeated block's forward is compiled (``Module.compile``)
            # and the step around them runs eagerly. Blocks could share a graph only if nothing
            # per-block were guarded; today each block's integer attributes (gemm handle, layer_id)
            # are, so every block gets its own graph (rc16-regional in docs/benchmarks.md).
            for m in self.regions:
                m.compile(dynamic=None, options=dict(COMPILE_OPTIONS))
            self.compiled = forward_fn
        else:
            self.compiled = torch.compile(forward_fn, dynamic=False, options=dict(COMPILE_OPTIONS))
        self.compile_seconds: dict[int, float] = {}
        self.capture_width = max(MIN_WIDTH, self.seq_len_buckets[0])

    def capture(self) -> None:
        """Run each bucket eagerly, then compiled (which compiles it), at the capture width."""
        import torch._dynamo.config as dynamo_config

        # One graph per bucket and runner (widths share it), more where the graph splits around
        # eager modules; past the limit dynamo would silently run the step eagerly.
        need = 64 + 4 * len(self.batch_sizes)
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, need)
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 16 * need)
        with torch.inference_mode():
            for bs in self.batch_sizes:
                inputs = self.make_static_inputs(bs, self.capture_width)
                for _ in range(self.warmup):
                    self.forward_fn(**inputs)
                if not self.regions:  # (regions: the mask is built eagerly from it; automatic dynamic)
                    torch._dynamo.mark_dynamic(inputs["kv_idx"], 1)
                t0 = time.perf_counter()
                self.compiled(**inputs)
                if self.regions:  # a second width, so automatic dynamic makes the KV width dynamic now
                    self.compiled(**self.make_static_inputs(bs, self.capture_width + 1))
                self.compile_seconds[bs] = time.perf_counter() - t0
        logger.info("compiled decode for batch sizes %s in %.1f s (KV width dynamic)",
                    self.batch_sizes, sum(self.compile_seconds.values()))

    def run(self, inputs: dict[str, torch.Tensor], bucket: int, seq_len: int) -> torch.Tensor:
        """Pad the real rows to ``bucket`` rows and the KV index matrix to ``max(seq_len, MIN_WIDTH)``
        columns (fresh tensors), run the compiled step; returns the first ``n`` rows (a new tensor)."""
        width = max(MIN_WIDTH, int(seq_len))
        padded = {}
        for name, src in inputs.items():  # 2-D inputs are KV index matrices
            tail = (width,) if src.dim() == 2 else tuple(src.shape[1:])
            buf = torch.empty((bucket, *tail), dtype=src.dtype, device=src.device)
            padded[name] = self._padded(buf, src, name)
        n = next(iter(inputs.values())).shape[0] if inputs else 0
        self.last_key = (bucket, width)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=SKIP_GUARD_EVAL):
            return self.compiled(**padded)[:n]
