"""Float32 linears versus int8 candidates on SmolLM2-135M's shapes (CPU).

For each linear of the built-in model (hidden 576, intermediate 1536, 9 query
heads and 3 KV heads of 64, vocabulary 49152) and each batch size (1 and 32
rows, i.e. one decode token and a 32-request decode step), one run times:

* ``fp32 F.linear``: torch's default (MKL sgemm);
* ``fp32 oneDNN packed``: the engine's float32 path (:mod:`fleetserve.layers.cpu_gemm`);
* ``torch.ao dynamic``: ``torch.ao.nn.quantized.dynamic.Linear`` (deprecated
  eager API; fbgemm's int8 weight, one scale per tensor in its default qconfig,
  activations quantized per call; ``--quantization int8`` calls the same
  fbgemm op with per-row weight scales);
* ``fbgemm fp16 weights``: ``torch.ops.quantized.linear_dynamic_fp16`` (weights
  stored fp16, float32 math; ``--quantization fp16_weight``);
* ``_weight_int8pack_mm``: weight-only int8 (per output channel scale),
  float32 activations (the kernel torchao's int8 weight-only path uses on CPU);
* ``bf16 oneDNN packed``: ``--quantization bf16_linear`` (:mod:`fleetserve.layers.bf16_gemm`;
  AMX tiles where the CPU has them);
* ``oneDNN int8 per-token``: ``torch.ops.onednn.qlinear_pointwise`` (the int8 linear inductor
  emits for x86; AMX int8 where the CPU has it) with per-row int8 weights and int8
  activations scaled per token, float32 output (no engine mode uses it yet);
* ``torchao int8 wo`` / ``torchao int8 dyn``: torchao's current API
  (``quantize_`` with ``Int8WeightOnlyConfig`` / ``Int8DynamicActivationInt8WeightConfig``),
  when torchao imports.

Timings are medians of interleaved repeats, microseconds per call, on the
thread count given (the machine is shared: compare ratios within one run).
Each quantized candidate's relative error ``||y - y32|| / ||y32||`` on the
random weights is printed too.

Usage::

    python benchmarks/quant_linear.py                 # writes docs/benchmarks.md
    python benchmarks/quant_linear.py --quick --no-doc
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

#: (name, in_features, out_features) of SmolLM2-135M's linears.
SHAPES = [
    ("qkv 576->960", 576, 960),
    ("o 576->576", 576, 576),
    ("gate_up 576->3072", 576, 3072),
    ("down 1536->576", 1536, 576),
    ("lm_head 576->49152", 576, 49152),
]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    keep = ["avx2", "fma", "avx512f", "avx512_vnni", "avx512vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8"]
                    return ", ".join(f for f in keep if f in flags) or "none of avx2/avx512/vnni"
    except OSError:
        pass
    return "?"


def _candidates(w: torch.Tensor) -> dict[str, callable]:
    from fleetserve.layers.cpu_gemm import PackedLinear

    out: dict[str, callable] = {}
    out["fp32 F.linear"] = lambda x: F.linear(x, w)
    packed = PackedLinear()
    out["fp32 oneDNN packed"] = lambda x: packed(x, w)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.ao.nn.quantized.dynamic as nnqd

        torch.backends.quantized.engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "fbgemm"
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        qd = nnqd.Linear.from_float(_with_qconfig(lin))
    out["torch.ao dynamic"] = qd

    p16 = torch.ops.quantized.linear_prepack_fp16(w, None)
    out["fbgemm fp16 weights"] = lambda x: torch.ops.quantized.linear_dynamic_fp16(x, p16)

    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    wq = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    out["_weight_int8pack_mm"] = lambda x: torch._weight_int8pack_mm(x, wq, scale)

    from fleetserve.layers import bf16_gemm

    if bf16_gemm.available():
        b16 = bf16_gemm.Bf16LinearGemm(w)
        out["bf16 oneDNN packed"] = b16  # --quantization bf16_linear (AMX where the CPU has it)
    if hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise"):
        # oneDNN's int8 linear (AMX int8 where the CPU has it): symmetric int8 weights per row,
        # int8 activations with one scale per token (rows scaled to [-127, 127] here), float32 out
        packed_q = torch.ops.onednn.qlinear_prepack(wq, None)
        zps = torch.zeros(w.shape[0], dtype=torch.int64)

        def onednn_int8(x, packed_q=packed_q, scale=scale, zps=zps):
            r = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127.0)
            qx = torch.round(x / r).to(torch.int8)
            y = torch.ops.onednn.qlinear_pointwise(qx, 1.0, 0, packed_q, scale, zps, None, 1.0, 0,
                                                   torch.float32, "none", [], "")
            return y.mul_(r)

        out["oneDNN int8 per-token"] = onednn_int8

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.quantization import (Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig,
                                              quantize_)
        for label, cfg in (("torchao int8 wo", Int8WeightOnlyConfig()),
                           ("torchao int8 dyn", Int8DynamicActivationInt8WeightConfig())):
            m = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False))
            m[0].weight.data.copy_(w)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    quantize_(m, cfg)
                    m(torch.randn(2, w.shape[1]))
                out[label] = m
            except Exception as e:  # noqa: BLE001 -- report and skip a candidate that does not run
                print(f"{label}: skipped ({type(e).__name__}: {str(e)[:80]})", file=sys.stderr)
    except Exception as e:  # noqa: BLE001
        print(f"torchao: not importable ({type(e).__name__})", file=sys.stderr)
    return out


def _with_qconfig(lin: torch.nn.Linear) -> torch.nn.Linear:
    from torch.ao.quantization import default_dynamic_qconfig

    lin.qconfig = default_dynamic_qconfig
    return lin


def _time(fn, x: torch.Tensor, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return (time.perf_counter() - t0) / iters * 1e6


def run(batches: list[int], repeats: int, budget_s: float) -> tuple[list[str], list[list[str]]]:
    torch.manual_seed(0)
    names: list[str] = []
    rows: list[list[str]] = []
    with torch.inference_mode():
        for label, k, n in SHAPES:
            w = torch.randn(n, k) / k ** 0.5
            cands = _candidates(w)
            names = list(cands)
            for b in batches:
                x = torch.randn(b, k)
                ref = F.linear(x, w)
                errs = {c: float((cands[c](x) - ref).norm() / ref.norm()) for c in cands}
                # iterations so one call-set takes about budget_s / repeats
                t1 = _time(cands["fp32 F.linear"], x, 3)
                iters = max(2, int(budget_s / repeats / max(t1 * 1e-6, 1e-6) / len(cands)))
                samples = {c: [] for c in cands}
                for _ in range(repeats):
                    for c, fn in cands.items():
                        fn(x)
                        samples[c].append(_time(fn, x, iters))
                med = {c: statistics.median(v) for c, v in samples.items()}
                base = med["fp32 F.linear"]
                cells = [f"{med[c]:.0f} ({base / med[c]:.2f}x{'' if c.startswith('fp32') else f', e {errs[c]:.1e}'})"
                         for c in cands]
                rows.append([label, str(b)] + cells)
                print(" | ".join(rows[-1]), flush=True)
    return names, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=0.6, help="seconds per (shape, batch) cell")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--section", default="quant_linear", help="docs/benchmarks.md section to write")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.quick:
        a.repeats, a.budget_s = 3, 0.3
    names, rows = run(a.batches, a.repeats, a.budget_s)
    try:
        import torchao

        tao = f"torchao {torchao.__version__}"
    except Exception:  # noqa: BLE001
        tao = "torchao not installed"
    header = (f"torch {torch.__version__}, {tao}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
              f"CPU flags: {_cpu_flags()}; {torch.get_num_threads()} torch threads.\n\n"
              "Microseconds per call, median of interleaved repeats (speed-up over fp32 `F.linear`; "
              "`e` = relative error against it on random weights).\n\n")
    table = "| linear | rows | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 2) + "\n"
    table += "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n"
    print(header + table)
    if not a.no_doc:
        from doc_section import write_section

        cmd = " ".join(["python benchmarks/quant_linear.py"] + sys.argv[1:])
        write_section(a.section, "Int8 linears vs float32 on SmolLM2's shapes (CPU)", cmd, header + table)


if __name__ == "__main__":
    main()
