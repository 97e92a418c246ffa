"""Weight loading: GGUF <-> HF directory round trip, sharded safetensors,
only-local-experts reads under EP, llama.cpp's Q/K permutation undone."""

import json
import os

import numpy as np
import pytest
import torch

from fleetserve.distributed.parallel_state import ParallelState
from fleetserve.engine.model_runner import ModelRunner
from fleetserve.models.config import gguf_config, load_model_config
from fleetserve.models.deepseek import DeepseekForCausalLM
from fleetserve.models.loader import GGUFSource, SafetensorsSource, run_loaders, unpermute_qk_rows
from helpers.batch_driver import Req, free, run_extend
from helpers.tiny_models import build_tiny_model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of Q/K rows (HF half-split -> pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    assert np.array_equal(unpermute_qk_rows(llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


def test_torch_dequantize_equals_gguf_package(smollm2_path):
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    from fleetserve.models.config import gguf_reader
    from fleetserve.models.loader import dequantize_gguf

    x = np.random.RandomState(0).randn(6, 96).astype(np.float32)
    for q in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        packed = quantize(x, q)
        ours = dequantize_gguf(packed, q)
        assert torch.equal(ours, torch.from_numpy(dequantize(packed, q)))
        assert 0 < (ours - torch.from_numpy(x)).abs().max().item() < 0.5
    seen = set()
    for t in gguf_reader(smollm2_path).tensors:
        if t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        ref = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        assert torch.equal(dequantize_gguf(t.data, t.tensor_type), torch.from_numpy(ref.copy()))
    assert {Q.Q8_0, Q.Q4_1, Q.F32} <= seen


def _logits(runner, prompt):
    r = Req([])
    out = run_extend(runner, [r], [prompt], return_all_logits=True)
    free(runner, [r])
    return out


def test_gguf_to_hf_dir_round_trip(smollm2_path, tmp_path):
    """Export the first two SmolLM2 layers from the GGUF as a HF directory; our
    runner gives identical logits from either, and transformers reads the
    directory to the same logits (so our names and Q/K layout are HF's)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg = gguf_config(smollm2_path)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size) == (30, 9, 3, 576)
    assert cfg.tie_word_embeddings and cfg.eos_token_id == 2 and cfg.vocab_size == 49152
    src = GGUFSource(smollm2_path, cfg.num_attention_heads, cfg.num_key_value_heads)
    # Row slices of a quantized tensor equal the same rows of the full tensor.
    full_q = src.read("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(src.read("model.layers.0.self_attn.q_proj.weight", 0, 64, 192), full_q[64:192])
    up = src.read("model.layers.1.mlp.up_proj.weight")
    assert torch.equal(src.read("model.layers.1.mlp.up_proj.weight", 0, 100, 300), up[100:300])
    assert torch.equal(src.read("model.layers.1.mlp.up_proj.weight", 1, 10, 20), up[:, 10:20])

    cfg.num_hidden_layers = 2
    names = [n for n in src.names() if not n.startswith("model.layers.") or int(n.split(".")[2]) < 2]
    out = tmp_path / "smollm2_2layers"
    out.mkdir()
    save_file({n: src.read(n).contiguous() for n in names}, str(out / "model.safetensors"))
    cfg.save_pretrained(str(out))

    prompt = list(range(100, 140))
    from_dir = ModelRunner(str(out), dtype="float32", max_total_tokens=64, show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    ours = _logits(from_dir, prompt)
    assert (ours - ref).abs().max().item() <= 1e-4
    assert ours.std().item() > 1.0


def test_sharded_index_dir_loads_identically(tiny_deepseek_v3_dir, tmp_path):
    sharded = build_tiny_model("deepseek_v3", str(tmp_path / "sharded"), seed=0, max_shard_size="60KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) >= 3
    a = ModelRunner(tiny_deepseek_v3_dir, dtype="float32", max_total_tokens=64, show_progress=False)
    b = ModelRunner(sharded, dtype="float32", max_total_tokens=64, show_progress=False)
    prompt = list(range(5, 30))
    assert torch.equal(_logits(a, prompt), _logits(b, prompt))


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_ep_rank_reads_only_its_experts(tiny_deepseek_v2_dir, ep_rank):
    cfg = load_model_config(tiny_deepseek_v2_dir)
    ps = ParallelState(tp_rank=ep_rank, tp_size=2, ep_rank=ep_rank, ep_size=2)
    model = DeepseekForCausalLM(cfg, pstate=ps)
    src = SafetensorsSource(tiny_deepseek_v2_dir)
    run_loaders(model.weight_loaders(src), "test", show_progress=False)
    expert_reads = {int(n.split(".")[5]) for n, *_ in src.reads if ".mlp.experts." in n}
    per = cfg.n_routed_experts // 2
    assert expert_reads == set(range(ep_rank * per, (ep_rank + 1) * per))
    # Shared experts and the gate are replicated, the local experts hold the right weights.
    assert any(".mlp.shared_experts." in n for n, *_ in src.reads)
    layer = model.layers[1].mlp
    assert layer.experts.w13.shape[0] == per
    e = ep_rank * per + 1
    ref = src.read(f"model.layers.1.mlp.experts.{e}.up_proj.weight")
    assert torch.equal(layer.experts.w13[1, cfg.moe_intermediate_size:], ref)
