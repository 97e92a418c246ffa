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
the KV width (``kv_idx``'s second dimension) is marked dynamic, so one graph
serves every width of a bucket and start-up compiles ``len(batch_sizes)``
graphs, not ``len(batch_sizes) * len(seq_len_buckets)``.

Start-up: :meth:`capture` runs each bucket once eagerly (lazy state such as the
RoPE tables' device is settled before tracing), then once compiled, which
compiles it. Inside the graph the linears are plain ``F.linear``
(:class:`~fleetserve.layers.cpu_gemm.PackedLinear` steps aside while tracing). Compile time grows with the
model's layers; on SmolLM2 it is minutes on a small shared machine (see
docs/benchmarks.md).

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

from fleetserve.engine.cuda_graph_runner import EagerDecodeGraphRunner, Key

logger = logging.getLogger(__name__)

#: Inductor options of the compiled step. ``freezing`` is left off: it folds the weights into
#: constants per graph (one more weight copy per bucket) and gave no measured gain here.
COMPILE_OPTIONS: dict[str, object] = {}


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

    Attributes:
        compiled: the ``torch.compile``-d ``forward_fn``.
        compile_seconds: ``{bucket: seconds}`` spent compiling each bucket in :meth:`capture`.
    """

    def __init__(self, forward_fn: Callable[..., torch.Tensor],
                 make_static_inputs: Callable[[int, int], dict[str, torch.Tensor]],
                 pad_values: dict[str, float | int], batch_sizes: Sequence[int],
                 seq_len_buckets: Sequence[int] = (1,), warmup: int = 1):
        super().__init__(forward_fn, make_static_inputs, pad_values, batch_sizes, seq_len_buckets, warmup)
        self.compiled = torch.compile(forward_fn, dynamic=False, options=dict(COMPILE_OPTIONS))
        self.compile_seconds: dict[int, float] = {}

    def capture(self) -> None:
        """Allocate every key's buffers, then run and compile each bucket (smallest width)."""
        import torch._dynamo.config as dynamo_config

        # One graph per bucket and runner (widths share it), more where the graph splits around
        # eager modules; past the limit dynamo would silently run the step eagerly.
        need = 64 + 4 * len(self.batch_sizes)
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, need)
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 16 * need)
        for key in self.keys():
            inputs = self.make_static_inputs(*key)
            if inputs["kv_idx"].shape[1] > 1:  # a width of 1 would be specialised (0/1 rule); keep it static
                torch._dynamo.mark_dynamic(inputs["kv_idx"], 1)
            self.inputs[key] = inputs
        width = self.seq_len_buckets[0]
        with torch.inference_mode():
            for bs in self.batch_sizes:
                key = (bs, width)
                for _ in range(self.warmup):
                    self.forward_fn(**self.inputs[key])
                t0 = time.perf_counter()
                self.compiled(**self.inputs[key])
                self.compile_seconds[bs] = time.perf_counter() - t0
        logger.info("compiled decode for batch sizes %s in %.1f s (KV widths %s share each graph)",
                    self.batch_sizes, sum(self.compile_seconds.values()), self.seq_len_buckets)

    def _launch(self, key: Key) -> torch.Tensor:
        self.outputs[key] = self.compiled(**self.inputs[key])
        return self.outputs[key]
