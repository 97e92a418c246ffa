"""Which int8 linears flip SmolLM2's greedy tokens (``--quantization int8``, issue 16).

One float32 SmolLM2 is loaded once; float32 writes greedy continuations of the first
``--prompts`` prompts of ``benchmarks/quant_quality.py`` (``--tokens`` each). Then for each
variant (a set of linears in int8, the rest in float32) one teacher-forced forward of every
prompt + its float32 continuation gives, at the continuation positions:

* ``top-1`` = share of positions whose argmax equals float32's (on float32's own greedy path:
  a variant at 100% here would reproduce every greedy token);
* ``logit err`` = ``||z - z32|| / ||z32||`` over those positions;
* ``flip margin`` = median float32 top-1 minus top-2 logit at the flipped positions.

Linears left in float32 use the SmoothQuant-smoothed weight (the RMSNorms are smoothed once for
all variants), so a variant differs from float32 only by the int8 rounding of its int8 linears.

``--numerics`` adds a table that splits the error by source with emulated ("fake") quantization in
float32 (:class:`FakeGemm`): weights rounded per row to int8 and back, activations rounded per token
to fbgemm's 7-bit grid and back (``torch.quantize_per_tensor_dynamic``), each with one or two
terms (two = the rounding error rounded again, ``Int8DynamicGemm(act_passes=2, weight_passes=2)``),
with and without SmoothQuant.

Usage::

    python benchmarks/int8_sensitivity.py --prompts 8 --tokens 32 [--numerics] [--per-layer]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class FloatGemm:
    """``x @ w.T (+ b)`` in float32 with a fixed (smoothed) weight; the call's weight is ignored."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w.contiguous()

    def __call__(self, x, weight=None, bias=None):
        return F.linear(x, self.w, bias)


def wq(w: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric int8 rounding of ``w`` and back (float32)."""
    s = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
    return (w / s).round().clamp(-127, 127) * s


def aq(x: torch.Tensor) -> torch.Tensor:
    """Per-token 7-bit rounding of ``x [N, in]`` on fbgemm's grid and back (what one int8 pass sees)."""
    r = x.abs().amax(1, keepdim=True).clamp(min=1e-12)
    return torch.quantize_per_tensor_dynamic((x / r).contiguous(), torch.quint8, True).dequantize() * r


class FakeGemm:
    """Emulated int8 linear: ``w_terms`` / ``a_terms`` int8 terms for weight / activation (0 = float32)."""

    def __init__(self, w: torch.Tensor, a_terms: int, w_terms: int) -> None:
        self.w = w if w_terms == 0 else (wq(w) if w_terms == 1 else wq(w) + wq(w - wq(w)))
        self.a = a_terms

    def __call__(self, x, weight=None, bias=None):
        x2 = x.reshape(-1, x.shape[-1]).float()
        if self.a:
            q = aq(x2)
            x2 = q + aq(x2 - q) if self.a == 2 else q
        return F.linear(x2, self.w, bias).reshape(*x.shape[:-1], self.w.shape[0])


def forward_logits(model, seqs: list[list[int]], dtype=torch.float32) -> torch.Tensor:
    """Logits ``[sum len, vocab]`` of one EXTEND forward of ``seqs`` (all tokens)."""
    from fleetserve.core.forward_batch import ForwardBatch, ForwardMode
    from fleetserve.core.forward_context import ForwardContext

    lens = [len(s) for s in seqs]
    n = sum(lens)
    pool = model.kv_pool_class(size=n, dtype=dtype, device="cpu", **model.kv_pool_kwargs())
    slots = torch.arange(1, n + 1, dtype=torch.int64)
    kv, off = [], 0
    for ln in lens:
        kv.append(slots[off:off + ln].clone())
        off += ln
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    pos = torch.cat([torch.arange(ln) for ln in lens])
    t = lambda v: torch.tensor(v, dtype=torch.int64)
    batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=ids, positions=pos, out_cache_loc=slots,
                         seq_lens=t(lens), extend_prefix_lens=t([0] * len(lens)), extend_seq_lens=t(lens),
                         kv_indices=kv, return_all_logits=True)
    with torch.inference_mode():
        meta = ForwardContext.build(batch, "cpu")
        hidden = model(ids, meta, pool)
        return model.compute_logits(hidden).float()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-layer", action="store_true", help="also one layer at a time (all its linears)")
    ap.add_argument("--numerics", action="store_true", help="also the error by source (emulated quantization)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from fleetserve.layers.linear import ParallelLMHead
    from fleetserve.layers.quantization import Int8DynamicGemm, _targets, has_vnni
    from fleetserve.layers.smooth_quant import ALPHA, restore_norms, smooth
    from fleetserve.models.registry import default_model_path
    from fleetserve.models.tokenizer import load_tokenizer
    from quant_modes import build
    from quant_quality import PROMPTS
    from quant_throughput import closed_loop

    t0 = time.perf_counter()
    sched, _ = build(["none"])
    runner = sched.runner
    model = runner.model
    tok = load_tokenizer(default_model_path())
    prompts = [tok.encode(p) for p in PROMPTS[: a.prompts]]
    _, _, outs = closed_loop(sched, prompts, len(prompts), a.tokens, "ref")
    print(f"loaded + float32 greedy in {time.perf_counter() - t0:.0f} s", flush=True)
    seqs = [p + outs[i] for i, p in enumerate(prompts)]
    # positions whose logits predict continuation tokens: prompt_len-1 .. len-2 of each sequence
    sel, off = [], 0
    for p, s in zip(prompts, seqs):
        sel.extend(range(off + len(p) - 1, off + len(s) - 1))
        off += len(s)
    sel = torch.tensor(sel)

    layers = _targets(model)
    calib = runner.int8_calibrator()(layers)
    eff = smooth(model.int8_smoothing_groups(), calib, ALPHA)
    smoothed = {m: eff.get(m, m.weight.detach().float()) for m in layers}
    rr = not has_vnni()
    i8 = {m: Int8DynamicGemm(smoothed[m], reduce_range=rr) for m in layers}
    fl = {m: FloatGemm(smoothed[m]) for m in layers}

    def kind(m) -> str:
        if isinstance(m, ParallelLMHead):
            return "lm_head"
        for name, mod in model.named_modules():
            if mod is m:
                return name.split(".")[-1]
        return "?"

    names = {m: kind(m) for m in layers}
    layer_of = {}
    for i, layer in enumerate(model.layers):
        for mod in layer.modules():
            if mod in i8:
                layer_of[mod] = i

    def run(int8_set) -> tuple[float, float, float]:
        for m in layers:
            m._gemm = i8[m] if m in int8_set else fl[m]
        z = forward_logits(model, seqs)[sel]
        top = z.argmax(-1)
        agree = (top == ref_top).float().mean().item()
        err = ((z - ref_z).norm() / ref_z.norm()).item()
        flips = (top != ref_top).nonzero().flatten()
        margin = statistics.median(ref_margin[flips].tolist()) if len(flips) else float("nan")
        return agree, err, margin

    for m in layers:
        m._gemm = fl[m]
    ref_z = forward_logits(model, seqs)[sel]
    ref_top = ref_z.argmax(-1)
    top2 = ref_z.topk(2, dim=-1).values
    ref_margin = top2[:, 0] - top2[:, 1]
    chk = (ref_top == torch.tensor([t for i in range(len(prompts)) for t in outs[i]])).float().mean().item()
    print(f"{len(sel)} positions; float32 teacher-forced argmax = engine greedy on {chk:.1%}; "
          f"median float32 margin {ref_margin.median():.2f}", flush=True)

    kinds = sorted(set(names.values()))
    variants = [("all int8", set(layers))] + [(f"only {k}", {m for m in layers if names[m] == k}) for k in kinds]
    variants += [(f"all but {k}", {m for m in layers if names[m] != k}) for k in kinds]
    if a.per_layer:
        variants += [(f"only layer {i}", {m for m in layers if layer_of.get(m) == i}) for i in range(len(model.layers))]
    print("| variant | top-1 = float32 | logit err | flip margin (median) |\n|---|---|---|---|")
    for name, s in variants:
        agree, err, margin = run(s)
        print(f"| {name} | {agree:.1%} | {err:.2%} | {margin:.2f} |", flush=True)
    if a.numerics:
        print("\n| SmoothQuant | activations | weights | top-1 = float32 | logit err | flip margin (median) |\n"
              "|---|---|---|---|---|---|")
        for smoothed_run in (False, True):
            restore_norms(model)
            e = smooth(model.int8_smoothing_groups(), calib, ALPHA) if smoothed_run else {}
            w = {m: e.get(m, m.weight.detach().float()) for m in layers}
            for at, wt in ((1, 1), (0, 1), (1, 0), (2, 1), (1, 2), (2, 2), (2, 0)):
                for m in layers:
                    fl[m] = FakeGemm(w[m], at, wt)
                agree, err, margin = run(set())
                lab = lambda t: ("float32", "int8", "2 x int8")[t]
                print(f"| {'yes' if smoothed_run else 'no'} | {lab(at)} | {lab(wt)} | {agree:.1%} | {err:.2%} | "
                      f"{margin:.2f} |", flush=True)
        restore_norms(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
