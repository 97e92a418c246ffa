"""The model runner: loads one rank's model shard, owns its KV pool, runs forwards.

Contract with the scheduler (ForwardBatch in, float32 logits out):

* ``forward(batch)`` writes every new token's KV to ``batch.out_cache_loc``,
  attends over each request's ``batch.kv_indices``, and returns logits
  ``[B, vocab]`` for each request's last new token, or ``[T, vocab]`` for every
  new token when ``batch.return_all_logits``. An IDLE batch (zero tokens)
  returns ``[0, vocab]`` -- and still runs every layer, so that collective
  operations inside the MoE / FFN layers line up across DP-attention ranks.
* ``allocator`` hands out pool slots; slot 0 is the scratch slot.

Decode graphs (SGLang's ``cuda_graph_runner`` behind ``--disable-cuda-graph``):
on CUDA, unless disabled, a DECODE batch -- or, under DP attention, a DECODE or
IDLE batch whose step every rank agreed may use a graph
(``ForwardBatch.can_run_graph``) -- goes through a
:class:`~fleetserve.engine.cuda_graph_runner.DecodeGraphRunner` when its bucket
(batch size, or the instance-wide largest count under DP attention) is at most
``cuda_graph_max_bs``. The batch is padded to the bucket: padding rows read
token 0 at position 0, write their KV to the scratch slot 0 and attend only to
it (sequence length 1), so no real slot is touched; their logits are dropped.
Without DP attention, a DECODE batch past the largest bucket is replayed in slices
of that bucket (and one smaller bucket for the rest) rather than run eagerly.
On CPU nothing changes unless ``eager_graph_stand_in=True`` (tests), which runs
the same padded path eagerly, or ``enable_torch_compile=True``
(``--enable-torch-compile``), which runs it through ``torch.compile`` for buckets
up to ``torch_compile_max_bs``
(:class:`~fleetserve.engine.compiled_decode_runner.CompiledDecodeRunner`), behind
the same gate (``decode_graphs_enabled``, the DP-attention agreement).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE, ParallelState
from fleetserve.distributed.traceable import register_groups
from fleetserve.core.forward_batch import ForwardBatch, ForwardMode
from fleetserve.core.kv_pool import TokenSlotAllocator
from fleetserve.core.forward_context import ForwardContext
from fleetserve.layers.attention import configure_cuda_sdpa
from fleetserve.layers.opaque_gemm import register_gemm_layers
from fleetserve.engine.int8_calibration import calibrator
from fleetserve.layers.quantization import apply_quantization, check_quantization
from fleetserve.engine.compiled_decode_runner import CompiledDecodeRunner, run_host_syncing_modules_eagerly
from fleetserve.engine.cuda_graph_runner import (DecodeGraphRunner, EagerDecodeGraphRunner, default_batch_sizes,
                                                 default_seq_len_buckets)
from fleetserve.models.config import architecture, is_gguf, load_model_config, resolve_dtype
from fleetserve.models.loader import open_weight_source, run_loaders
from fleetserve.models.registry import default_model_path, model_class

logger = logging.getLogger(__name__)

#: Fraction of available memory given to the KV pool when neither
#: ``max_total_tokens`` nor ``mem_fraction_static`` is set. Small on CPU: the
#: machines are shared and the pool is committed page by page as it fills.
DEFAULT_CPU_KV_FRACTION = 0.1
MAX_AUTO_TOKENS = 1 << 20
#: Largest decode batch given a graph when ``cuda_graph_max_bs`` is not set. Lower
#: than SGLang's (up to 160+): attention here gathers every row's KV up to the
#: captured width, so a graph's cost grows with bs x width.
DEFAULT_CUDA_GRAPH_MAX_BS = 32
#: Largest decode batch compiled when ``torch_compile_max_bs`` is not set (SGLang's default).
DEFAULT_TORCH_COMPILE_MAX_BS = 32
#: Pad values of the static decode inputs (see the module docstring).
GRAPH_PAD_VALUES = {"input_ids": 0, "positions": 0, "out_cache_loc": 0, "seq_lens": 1, "kv_idx": 0}


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
        dtype: ``"auto"`` (bf16 on CUDA, fp32 on CPU: :func:`~fleetserve.models.config.resolve_dtype`), ``"float32"``, ``"bfloat16"``.
        max_total_tokens: KV pool size in tokens; None = from ``mem_fraction_static``.
        mem_fraction_static: fraction of free memory (after loading the weights)
            given to the KV pool (default 0.1 on CPU, 0.8 on CUDA).
        pstate: this rank's parallel layout.
        device: ``"cpu"`` or ``"cuda:N"``.
        show_progress: show a tqdm bar while loading weights.
        disable_cuda_graph: never use decode graphs (``--disable-cuda-graph``).
        cuda_graph_max_bs: largest bucket (``--cuda-graph-max-bs``; default 32).
        eager_graph_stand_in: on a non-CUDA device, run the decode-graph path with
            :class:`EagerDecodeGraphRunner` (same padding and buckets, eager forward).
            For tests; ignored on CUDA, where real graphs are captured.
        graph_seq_len_buckets: KV widths of the graph buffers (default:
            :func:`default_seq_len_buckets` of ``max_context_len``).
        page_size: KV slots per page (``--page-size``); the pool is rounded down to whole pages.
        quantization: ``--quantization`` (``none``, ``int8``, ``w8a8_int8``, ``auto``; see
            :mod:`fleetserve.layers.quantization`); applied once after the weights load.
        enable_torch_compile: on a non-CUDA device, decode batches up to ``torch_compile_max_bs``
            through ``torch.compile`` (``--enable-torch-compile``; compiles every bucket at
            start-up). Ignored (logged once, by rank 0) on CUDA, where the CUDA graphs run. Under
            TP / DP attention / EP every rank compiles the same buckets; the collectives inside the
            step are opaque ops (:mod:`fleetserve.distributed.traceable`).
        torch_compile_max_bs: largest compiled bucket (``--torch-compile-max-bs``; default 32).
        torch_compile_region: ``"step"`` compiles the whole decode step (one graph per bucket);
            ``"layer"`` compiles each decoder layer's forward instead (regional compilation; one graph
            per layer today, the rest of the step eager). ValueError otherwise.
        graph_batch_sizes: the buckets themselves, instead of :func:`default_batch_sizes` of the
            max (like SGLang's ``--cuda-graph-bs``; tests and benchmarks use it to compile fewer).

    Raises:
        RuntimeError: capturing the decode graphs failed on CUDA (retry with
            ``disable_cuda_graph=True``).
        ValueError: the KV pool is smaller than one page (names ``--page-size``), or a bad /
            impossible ``quantization`` (names ``--quantization``).

    Attributes: ``model_config`` (the HF config), ``model``, ``vocab_size``,
    ``kv_pool`` (MHAKVPool or MLAKVPool), ``allocator``, ``max_total_tokens``,
    ``max_context_len``, ``dtype``, ``eos_token_ids``, ``kv_bytes_per_token``,
    ``graph_runner`` (None when decode graphs are off), ``quantization`` (``int8`` or ``none``, as applied).
    """

    def __init__(self, model_path: str | None = None, dtype: str | torch.dtype = "auto",
                 max_total_tokens: int | None = None, mem_fraction_static: float | None = None,
                 pstate: ParallelState = SINGLE_RANK_STATE, device: str | torch.device = "cpu", show_progress: bool = True,
                 disable_cuda_graph: bool = False, cuda_graph_max_bs: int | None = None,
                 eager_graph_stand_in: bool = False, graph_seq_len_buckets: list[int] | None = None,
                 page_size: int = 1, quantization: str | None = "none", enable_torch_compile: bool = False,
                 torch_compile_max_bs: int | None = None, graph_batch_sizes: list[int] | None = None,
                 torch_compile_region: str = "step"):
        self.model_path = model_path or default_model_path()
        self.device = torch.device(device)
        self.pstate = pstate
        self.dtype = resolve_dtype(dtype)
        check_quantization(quantization, str(self.device))  # fail before loading the weights
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
        if self.device.type == "cuda":
            logger.info("attention on CUDA: FLEETSERVE_CUDA_SDPA=%s", configure_cuda_sdpa())
        self.quantization = apply_quantization(self.model, quantization, self.device, calibrate=self.int8_calibrator())

        self.kv_bytes_per_token = self.model.kv_bytes_per_token(self.dtype)
        if max_total_tokens is None:
            frac = mem_fraction_static
            if frac is None:
                frac = 0.8 if self.device.type == "cuda" else DEFAULT_CPU_KV_FRACTION
            budget = int(available_memory_bytes(self.device) * frac)
            max_total_tokens = max(1, min(MAX_AUTO_TOKENS, budget // self.kv_bytes_per_token))
        self.allocator = TokenSlotAllocator(int(max_total_tokens), page_size)
        self.max_total_tokens = self.allocator.size  # whole pages
        self.max_context_len = min(int(config.max_position_embeddings), self.max_total_tokens)
        # rows 0 .. max_slot (with paging the last page ends past max_total_tokens)
        self.kv_pool = cls.kv_pool_class(size=self.allocator.max_slot, dtype=self.dtype, device=self.device,
                                         **self.model.kv_pool_kwargs())
        logger.info(
            "%s on %s (%s, rank tp=%d/%d ep=%d/%d): KV cache %s, %d bytes per token per rank, %d tokens (%.1f MiB)",
            architecture(config), self.device, str(self.dtype).replace("torch.", ""), pstate.tp_rank, pstate.tp_size,
            pstate.ep_rank, pstate.ep_size, type(self.kv_pool).__name__, self.kv_bytes_per_token,
            self.max_total_tokens, self.max_total_tokens * self.kv_bytes_per_token / 2**20)
        self.graph_runner: DecodeGraphRunner | None = None
        if enable_torch_compile and self.device.type == "cuda" and pstate.tp_rank == 0:  # one line per instance
            logger.warning("--enable-torch-compile is CPU-only here; on CUDA the decode CUDA graphs run uncompiled")
        if enable_torch_compile and self.device.type != "cuda":
            sizes = graph_batch_sizes or default_batch_sizes(torch_compile_max_bs or DEFAULT_TORCH_COMPILE_MAX_BS)
            self._init_compiled_runner(sizes,
                                       graph_seq_len_buckets or default_seq_len_buckets(self.max_context_len),
                                       torch_compile_region)
        elif not disable_cuda_graph and (self.device.type == "cuda" or eager_graph_stand_in):
            sizes = graph_batch_sizes or default_batch_sizes(cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS)
            self._init_graph_runner(sizes,
                                    graph_seq_len_buckets or default_seq_len_buckets(self.max_context_len))

    def int8_calibrator(self):
        """The calibration pass ``--quantization int8`` smooths with (engine/int8_calibration.py)."""
        return calibrator(self.model, self.model_path, self.vocab_size, self.dtype, self.device)

    # ------------------------------------------------------------ decode graphs
    @property
    def decode_graphs_enabled(self) -> bool:
        """Whether a decode step may go through the graph runner (the DP hook's ``check_graph``)."""
        return self.graph_runner is not None

    def _init_graph_runner(self, sizes: list[int], seq_len_buckets: list[int]) -> None:
        if self.device.type != "cuda":
            self.graph_runner = EagerDecodeGraphRunner(self._static_decode_forward, self._make_static_inputs,
                                                       GRAPH_PAD_VALUES, sizes, seq_len_buckets)
            self.graph_runner.capture()
            return
        unsafe = sorted({type(m).__name__ for m in self.model.modules() if not getattr(m, "cuda_graph_safe", True)})
        if unsafe:
            logger.info("decode CUDA graphs off: %s synchronise with the host in their forward", ", ".join(unsafe))
            return
        runner = DecodeGraphRunner(self._static_decode_forward, self._make_static_inputs, GRAPH_PAD_VALUES,
                                   sizes, seq_len_buckets)
        try:
            with torch.inference_mode():
                runner.capture()
        except Exception as e:
            raise RuntimeError(f"capturing decode CUDA graphs failed ({type(e).__name__}: {e}); "
                               "start with --disable-cuda-graph to run decode eagerly") from e
        self.graph_runner = runner
        logger.info("captured %d decode CUDA graphs (batch sizes %s, KV widths %s)", len(runner.graphs),
                    sizes, seq_len_buckets)

    def _init_compiled_runner(self, sizes: list[int], seq_len_buckets: list[int], region: str = "step") -> None:
        eager = run_host_syncing_modules_eagerly(self.model)
        register_gemm_layers(self.model)  # the linears' kernels stay opaque ops in the graph
        register_groups(self.pstate)  # so do the collectives (distributed/traceable.py)
        if eager and self.pstate.tp_rank == 0:
            logger.info("compiled decode: %s run eagerly inside the step (host reads)", ", ".join(eager))
        if region not in ("step", "layer"):
            raise ValueError(f"--torch-compile-region must be step or layer, got {region!r}")
        regions = list(self.model.layers) if region == "layer" else None
        runner = CompiledDecodeRunner(self._static_decode_forward, self._make_static_inputs, GRAPH_PAD_VALUES,
                                      sizes, seq_len_buckets, regions=regions)
        try:
            runner.capture()
        except Exception as e:
            raise RuntimeError(f"compiling the decode step failed ({type(e).__name__}: {e}); "
                               "start without --enable-torch-compile to decode eagerly") from e
        self.graph_runner = runner

    def _make_static_inputs(self, bs: int, seq_len: int) -> dict[str, torch.Tensor]:
        """Static decode buffers of one key, filled with the padding values."""
        def buf(*shape: int, name: str) -> torch.Tensor:
            return torch.full(shape, GRAPH_PAD_VALUES[name], dtype=torch.int64, device=self.device)

        return {"input_ids": buf(bs, name="input_ids"), "positions": buf(bs, name="positions"),
                "out_cache_loc": buf(bs, name="out_cache_loc"), "seq_lens": buf(bs, name="seq_lens"),
                "kv_idx": buf(bs, seq_len, name="kv_idx")}

    def _static_decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                               seq_lens: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """DECODE forward over fixed shapes: int64 ``[bs]`` inputs and ``kv_idx [bs, L]``
        -> float32 logits ``[bs, vocab]``. No host sync (capturable on CUDA)."""
        bs, L = kv_idx.shape
        keys = torch.arange(L, device=kv_idx.device)
        mask = (keys[None, :] < seq_lens[:, None]).view(bs, 1, 1, L)
        last = torch.arange(bs, device=kv_idx.device)
        # Under DP attention every rank runs the same bucket, so the FFN gather sees bs rows per group.
        counts = [bs] * self.pstate.attn_dp_size if self.pstate.attn_dp_size > 1 else None
        meta = ForwardContext(ForwardMode.DECODE, positions, out_cache_loc, kv_idx, mask, None, None, last,
                              bs, 1, bs, global_num_tokens=counts)
        return self.model.compute_logits(self.model(input_ids, meta, self.kv_pool))

    def _graph_bucket(self, batch: ForwardBatch) -> int | None:
        """The bucket ``batch`` runs in through the graph runner, or None (eager)."""
        if self.graph_runner is None or batch.return_all_logits:
            return None
        if self.pstate.attn_dp_size > 1:
            # Every rank reaches the same answer: can_run_graph and the counts come from sync_step.
            if not (batch.can_run_graph and batch.mode.is_decode_or_idle()) or batch.global_num_tokens is None:
                return None
            return self.graph_runner.bucket_for(max(batch.global_num_tokens))
        if not batch.mode.is_decode() or batch.batch_size == 0:
            return None
        return self.graph_runner.bucket_for(batch.batch_size)

    def _graph_chunks(self, batch: ForwardBatch) -> list[tuple[int, int, int]] | None:
        """``[(start, stop, bucket), ...]`` row ranges of a DECODE batch larger than the
        largest bucket, each replayed through the graph runner on its own; None when the
        batch is not such a batch.

        Decode rows do not interact (each attends to its own KV), so a batch of 64 runs as
        two replays of the 32 bucket instead of one eager step: on an H200 an eager step of
        SmolLM2-135M took 37-92 ms and a bucket-32 replay 5-10 ms (docs/benchmarks.md,
        engine-cuda-check). Not under DP attention, where every rank must replay one agreed
        shape (the FFN gather); TP ranks hold the same batch and so split it alike.
        """
        if (self.graph_runner is None or batch.return_all_logits or self.pstate.attn_dp_size > 1
                or not batch.mode.is_decode()):
            return None
        largest = self.graph_runner.batch_sizes[-1]
        n = batch.batch_size
        if n <= largest:
            return None
        chunks = [(a, min(a + largest, n)) for a in range(0, n, largest)]
        return [(a, b, self.graph_runner.bucket_for(b - a)) for a, b in chunks]

    def _forward_graph(self, batch: ForwardBatch, bucket: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of a DECODE (or DP IDLE) batch through the graph runner's ``bucket``."""
        stop = batch.batch_size if stop is None else stop
        n = stop - start
        kv = [k.to(self.device) for k in batch.kv_indices[start:stop]]
        if n:
            kv_idx = torch.nn.utils.rnn.pad_sequence(kv, batch_first=True, padding_value=0)
        else:
            kv_idx = torch.zeros(0, 1, dtype=torch.int64, device=self.device)
        inputs = {"input_ids": batch.input_ids, "positions": batch.positions, "out_cache_loc": batch.out_cache_loc,
                  "seq_lens": batch.seq_lens}
        inputs = {k: v[start:stop].to(self.device) for k, v in inputs.items()}
        inputs["kv_idx"] = kv_idx
        return self.graph_runner.run(inputs, bucket, max(1, kv_idx.shape[1])).clone()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one batch; returns float32 logits ``[B, vocab]`` (or ``[T, vocab]``
        with ``return_all_logits``; ``[0, vocab]`` for IDLE).

        Through the decode-graph runner when :meth:`_graph_bucket` gives a bucket
        (module docstring); eagerly otherwise."""
        bucket = self._graph_bucket(batch)
        if bucket is not None:
            return self._forward_graph(batch, bucket)
        chunks = self._graph_chunks(batch)
        if chunks is not None:
            return torch.cat([self._forward_graph(batch, b, start, stop) for start, stop, b in chunks])
        meta = ForwardContext.build(batch, self.device)
        meta.global_num_tokens = batch.global_num_tokens  # DP attention's FFN gather
        hidden = self.model(batch.input_ids.to(self.device), meta, self.kv_pool)
        if not batch.return_all_logits:
            hidden = hidden.index_select(0, meta.last_token_idx)
        return self.model.compute_logits(hidden)
