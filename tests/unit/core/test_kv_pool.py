import torch

from fleetserve.core.kv_pool import MHAKVPool, MLAKVPool, TokenSlotAllocator


def test_allocator_never_hands_out_slot_zero_or_twice():
    alloc = TokenSlotAllocator(10)
    a = alloc.alloc(6)
    b = alloc.alloc(4)
    assert alloc.alloc(1) is None
    got = torch.cat([a, b]).tolist()
    assert sorted(got) == list(range(1, 11))
    alloc.free(a)
    assert alloc.available_size() == 6
    c = alloc.alloc(6)
    assert sorted(c.tolist()) == sorted(a.tolist())


def test_mla_pool_is_smaller_than_mha_for_deepseek_shapes():
    # DeepSeek-V3: 128 heads of 192 (K) / 128 (V) vs one 512 latent + 64 rope key.
    mla = MLAKVPool(4, num_layers=2, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16)
    mha = MHAKVPool(4, num_layers=2, num_kv_heads=128, head_dim=192, v_head_dim=128, dtype=torch.bfloat16)
    assert mla.bytes_per_token == 2 * 576 * 2
    assert mha.bytes_per_token == 2 * 128 * (192 + 128) * 2
    assert mha.bytes_per_token // mla.bytes_per_token == 71
