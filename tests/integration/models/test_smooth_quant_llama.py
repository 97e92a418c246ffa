"""SmoothQuant on a whole (tiny, GQA) Llama: the groups LlamaForCausalLM lists cover every
linear, and the folded model -- norm weights divided by s, QKV / gate-up / O / down / LM head
weights smoothed, V and up rows divided -- computes float32's logits when run in float
(only the int8 rounding is meant to see the factors)."""

import torch
import torch.nn.functional as F

from fleetserve.engine.model_runner import ModelRunner
from fleetserve.layers.cpu_gemm import PackedLinear
from fleetserve.layers.quantization import _targets, apply_quantization
from fleetserve.layers.smooth_quant import restore_norms, smooth
from helpers.batch_driver import Req, free, run_extend

PROMPTS = [[256, 72, 101, 108, 108, 111, 44, 32], [256] + list(range(30, 60))]


def logits(runner):
    reqs = [Req([]) for _ in PROMPTS]
    out = run_extend(runner, reqs, PROMPTS, return_all_logits=True)
    free(runner, reqs)
    return out


def test_folded_llama_is_float32_in_float(tiny_llama_dir):
    runner = ModelRunner(tiny_llama_dir, dtype="float32", max_total_tokens=512, show_progress=False)
    model = runner.model
    with torch.inference_mode():
        ref = logits(runner)
        targets = _targets(model)
        stats = runner.int8_calibrator()(targets)
        assert set(stats) == set(targets) and all(v.shape == (t.weight.shape[1],) for t, v in
                                                  ((t, stats[t]) for t in targets))
        eff = smooth(model.int8_smoothing_groups(), stats)
        assert set(eff) == set(targets)  # every linear is smoothed (the LM head too)
        for t in targets:
            assert not torch.allclose(eff[t], t.weight.float())
            t._gemm = lambda x, w, b=None, t=t: F.linear(x, eff[t].to(x.dtype), b)
        folded = logits(runner)
        assert torch.allclose(folded, ref, rtol=0, atol=1e-4 * ref.abs().max().item())
        assert restore_norms(model) == 2 * len(model.layers) + 1
        for t in targets:
            t._gemm = PackedLinear()
        assert torch.allclose(logits(runner), ref, rtol=0, atol=1e-6 * ref.abs().max().item())
        # the int8 engine itself: smoothed, deterministic, close to float32
        assert apply_quantization(model, "int8", calibrate=runner.int8_calibrator()) == "int8"
        q = logits(runner)
        assert torch.equal(q, logits(runner))
        assert ((q - ref).norm() / ref.norm()).item() < 0.1
