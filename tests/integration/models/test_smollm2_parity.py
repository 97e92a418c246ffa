"""SmolLM2-135M-Instruct from the GGUF: our logits and greedy tokens equal
transformers' (which dequantizes the same GGUF), float32."""

import pytest
import torch

from helpers.parity import greedy_generate, greedy_matches_teacher_forced, hf_greedy, max_diff_extend_and_decode

pytestmark = pytest.mark.slow


def test_logits_match_transformers_through_kv_pool(smollm2_runner, hf_smollm2):
    g = torch.Generator().manual_seed(0)
    lens = [1, 9, 33, 70]
    prompts = [torch.randint(0, smollm2_runner.vocab_size, (n,), generator=g).tolist() for n in lens]
    cached = [0, 4, 20, 64]
    steps = [torch.randint(0, smollm2_runner.vocab_size, (len(prompts),), generator=g).tolist() for _ in range(3)]
    free_before = smollm2_runner.allocator.available_size()
    diffs = max_diff_extend_and_decode(smollm2_runner, hf_smollm2, prompts, cached, steps)
    assert set(diffs) == {"prefix_extend", "extend_after_prefix", "decode"}
    for phase, d in diffs.items():
        assert d <= 1e-3, f"{phase}: max abs diff {d}"
    assert smollm2_runner.allocator.available_size() == free_before


def test_greedy_32_tokens_match_generate(smollm2_runner, hf_smollm2, smollm2_path):
    from fleetserve.models.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three colors."}], add_generation_prompt=True,
                                   return_dict=True)["input_ids"]
    prompts = [list(chat), tok("The capital of France is")["input_ids"], tok("def fibonacci(n):")["input_ids"]]
    ours = greedy_generate(smollm2_runner, prompts, 32)  # one batch: EXTEND, then batched DECODE
    assert ours[0] == hf_greedy(hf_smollm2, prompts[0], 32)
    for p, o in zip(prompts[1:], ours[1:]):
        assert greedy_matches_teacher_forced(hf_smollm2, p, o)
    assert len({tuple(o) for o in ours}) == len(prompts)
