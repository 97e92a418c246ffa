"""Tiny random DeepSeek-V2 / V3 (MLA + MoE) and Llama models: logits and
greedy tokens equal transformers' own modelling code, float32, through the
KV pool (extend after a cached prefix, batched decode with absorbed MLA)."""

import pytest
import torch

from fleetserve.engine.model_runner import ModelRunner
from fleetserve.core.kv_pool import MHAKVPool, MLAKVPool
from helpers.parity import greedy_generate, greedy_matches_teacher_forced, hf_greedy, max_diff_extend_and_decode

KINDS = ["tiny_deepseek_v2_dir", "tiny_deepseek_v2_greedy_dir", "tiny_deepseek_v3_dir", "tiny_llama_dir"]


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(request.param)
    runner = ModelRunner(path, dtype="float32", max_total_tokens=1024, show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, runner, hf


def test_kv_pool_kind(pair):
    kind, runner, _ = pair
    cfg = runner.model_config
    if "deepseek" in kind:
        assert isinstance(runner.kv_pool, MLAKVPool)
        assert runner.kv_pool.kv_buffer[0].shape[1] == cfg.kv_lora_rank + cfg.qk_rope_head_dim
        assert runner.kv_bytes_per_token == cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    else:
        assert isinstance(runner.kv_pool, MHAKVPool)
        assert runner.kv_bytes_per_token == cfg.num_hidden_layers * cfg.num_key_value_heads * 2 * cfg.head_dim * 4
    assert runner.kv_pool.bytes_per_token == runner.kv_bytes_per_token


def test_logits_match_transformers(pair):
    _, runner, hf = pair
    g = torch.Generator().manual_seed(1)
    lens = [1, 6, 17, 45]
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
    steps = [torch.randint(0, 256, (len(prompts),), generator=g).tolist() for _ in range(4)]
    diffs = max_diff_extend_and_decode(runner, hf, prompts, [0, 3, 16, 30], steps)
    for phase, d in diffs.items():
        assert d <= 1e-3, f"{phase}: max abs diff {d}"
    assert runner.allocator.available_size() == runner.max_total_tokens


def test_greedy_32_tokens_match_generate(pair):
    _, runner, hf = pair
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 12, 29)]
    ours = greedy_generate(runner, prompts, 32)  # one batch: EXTEND, then batched DECODE
    assert ours[0] == hf_greedy(hf, prompts[0], 32)
    for p, o in zip(prompts[1:], ours[1:]):
        assert greedy_matches_teacher_forced(hf, p, o)
