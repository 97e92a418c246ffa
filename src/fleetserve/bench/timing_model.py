"""Service-time model of one engine instance, for the simulated worker.

An engine alternates two kinds of steps (SGLang's default scheduling, prefill first):

* a **prefill** (extend) step over the uncached prompt tokens of newly admitted
  requests, at most ``chunked_prefill_size`` tokens per step:
  ``prefill_overhead_s + prefill_per_token_s * uncached_tokens``;
* a **decode** step producing one token for each of the ``b`` running requests
  holding ``ctx`` context tokens in all:
  ``decode_base_s + decode_per_req_s * b + decode_per_ctx_token_s * ctx``.

At most ``max_running_requests`` run at once and their KV must fit in
``max_total_tokens`` slots (the radix cache evicts LRU prefixes to make room),
allocated in pages of ``page_size`` slots (SGLang's ``--page-size``; the cache
then reuses whole pages only).

Profiles (every constant can be overridden by a flag):

``h100-llama8b`` (default) -- Llama-3.1-8B in bf16 on one H100 SXM, derived from
NVIDIA's H100 SXM datasheet (989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB):

* prefill: 2 x 8.0e9 FLOP per token at ~50 % of peak -> 32 us; we use 35 us/token
  plus 5 ms per step (launch and scheduling overhead);
* decode base: 16 GB of weights read per step at ~70 % of peak bandwidth -> 6.8 ms;
* decode per request: 2 x 8e9 FLOP at ~50 % of peak -> 0.03 ms, plus ~0.05 ms of
  per-request scheduling/sampling -> 0.08 ms;
* decode per context token: 128 KiB of KV per token (32 layers x 8 KV heads x 128
  x 2 x 2 bytes) read at ~70 % of 3.35 TB/s -> 56 ns;
* KV capacity: (80 GB x 0.88 - 16 GB weights) / 128 KiB ~= 430,000 tokens;
  ``max_running_requests`` 256 and ``chunked_prefill_size`` 8192 (SGLang's H100 defaults).

``cpu-smollm2`` -- SmolLM2-135M on this machine's two CPU cores. Decode from the
measurements in docs/ARCHITECTURE ("transformers generate, float32, 2 threads:
15 tok/s at batch 1, 81 at batch 8, 206 at batch 32", i.e. 67 / 99 / 155 ms per
step): a least-squares line gives 64 ms + 2.8 ms per request. Prefill: 0.27 GFLOP
per token at ~0.5 TFLOP/s (bf16 on AMX, same source) -> 0.55 ms/token. KV:
30 layers x 3 KV heads x 64 x 2 x 2 bytes = 23 KiB/token; 65,536 tokens.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields


@dataclass
class TimingModel:
    """Constants of the engine model. Times in seconds, sizes in tokens."""

    prefill_per_token_s: float = 35e-6
    prefill_overhead_s: float = 5e-3
    decode_base_s: float = 6.8e-3
    decode_per_req_s: float = 8e-5
    decode_per_ctx_token_s: float = 56e-9
    max_running_requests: int = 256
    max_total_tokens: int = 430_000
    chunked_prefill_size: int = 8192
    page_size: int = 1  # KV slots per page, as the engine's --page-size
    time_scale: float = 1.0  # every duration is multiplied by this (slow the simulation down)

    def prefill_time(self, uncached_tokens: int) -> float:
        """Seconds for one prefill step over ``uncached_tokens`` new tokens (already time-scaled)."""
        return (self.prefill_overhead_s + self.prefill_per_token_s * uncached_tokens) * self.time_scale

    def decode_time(self, batch_size: int, context_tokens: int) -> float:
        """Seconds for one decode step of ``batch_size`` requests holding ``context_tokens`` (time-scaled)."""
        return (self.decode_base_s + self.decode_per_req_s * batch_size
                + self.decode_per_ctx_token_s * context_tokens) * self.time_scale

    def to_dict(self) -> dict:
        return asdict(self)


PROFILES: dict[str, TimingModel] = {
    "h100-llama8b": TimingModel(),
    "cpu-smollm2": TimingModel(prefill_per_token_s=5.5e-4, prefill_overhead_s=2e-3, decode_base_s=64e-3,
                               decode_per_req_s=2.8e-3, decode_per_ctx_token_s=0.0, max_running_requests=64,
                               max_total_tokens=65_536, chunked_prefill_size=2048),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--profile`` and one flag per :class:`TimingModel` field (default: the profile's value)."""
    g = p.add_argument_group("timing model (see fleetserve.bench.timing_model for sources)")
    g.add_argument("--profile", choices=sorted(PROFILES), default="h100-llama8b",
                   help="preset constants; the flags below override single values")
    for f in fields(TimingModel):
        g.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(TimingModel(), f.name)), default=None,
                       help=f"override the profile's {f.name}")


def from_args(args: argparse.Namespace) -> TimingModel:
    """The profile named by ``args.profile`` with every given override applied."""
    base = asdict(PROFILES[args.profile])
    for f in fields(TimingModel):
        v = getattr(args, f.name, None)
        if v is not None:
            base[f.name] = v
    m = TimingModel(**base)
    for name in ("max_total_tokens", "max_running_requests", "chunked_prefill_size", "time_scale"):
        if getattr(m, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(m, name)}")
    if m.page_size < 1:
        raise ValueError(f"--page-size must be >= 1, got {m.page_size}")
    if m.chunked_prefill_size % m.page_size:
        raise ValueError(f"--page-size ({m.page_size}) must divide --chunked-prefill-size ({m.chunked_prefill_size})")
    if m.max_total_tokens < m.page_size:
        raise ValueError(f"--page-size ({m.page_size}) is larger than the KV pool "
                         f"(--max-total-tokens {m.max_total_tokens})")
    return m
