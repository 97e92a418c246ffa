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


def test_paged_allocator_hands_out_whole_aligned_pages():
    alloc = TokenSlotAllocator(16, page_size=4)  # pages 1..4 = slots 4..19
    assert alloc.size == 16 and alloc.max_slot == 19
    a = alloc.alloc(6)  # two fresh pages, the first 6 of their 8 slots
    assert alloc.available_size() == 8
    assert a.numel() == 6 and int(a[0]) % 4 == 0 and int(a[4]) % 4 == 0
    assert a[:4].tolist() == list(range(int(a[0]), int(a[0]) + 4))
    # continue the sequence: 2 slots left in its last page, then one fresh page
    more = alloc.alloc_extend(6, int(a[-1]), 3)
    assert more[:2].tolist() == [int(a[-1]) + 1, int(a[-1]) + 2] and int(more[2]) % 4 == 0
    assert alloc.available_size() == 4
    assert alloc.tokens_needed(9, 3) == 0 and alloc.tokens_needed(8, 1) == 4 and alloc.tokens_needed(6, 7) == 8
    assert alloc.alloc_extend(9, int(more[-1]), 8) is None and alloc.available_size() == 4  # nothing taken
    # one slot of a page frees the whole page
    alloc.free(more[2:])
    assert alloc.available_size() == 8
    alloc.free(a)
    assert alloc.available_size() == 16
    assert sorted(alloc.free_slots().tolist()) == list(range(4, 20))


def test_page_size_one_is_the_token_allocator():
    a, b = TokenSlotAllocator(10), TokenSlotAllocator(10, page_size=1)
    assert a.max_slot == b.max_slot == 10
    assert a.alloc(3).tolist() == b.alloc(3).tolist() == [1, 2, 3]
    assert TokenSlotAllocator(10).alloc(4).tolist() == TokenSlotAllocator(10, 1).alloc_extend(5, 99, 4).tolist()


def test_allocator_keeps_a_lone_request_on_one_ascending_run():
    # The documented order: fresh pools hand out 1, 2, 3, ...; frees go back lowest on top.
    from fleetserve.core.kv_pool import contiguous_run

    alloc = TokenSlotAllocator(16)
    prefill = alloc.alloc(5)
    steps = [alloc.alloc_extend(5 + i, int(prefill[-1]) + i, 1) for i in range(3)]
    seq = torch.cat([prefill, *steps])
    assert seq.tolist() == list(range(1, 9)) and contiguous_run(seq) == 1
    alloc.free(seq[[6, 2, 4, 3]])  # any order in: slots 3, 4, 5, 7 come back lowest first
    assert alloc.alloc(3).tolist() == [3, 4, 5]
    assert alloc.alloc(2).tolist() == [7, 9]
    assert contiguous_run(torch.tensor([3, 4, 5])) == 3 and contiguous_run(torch.tensor([7])) == 7
    assert contiguous_run(torch.tensor([1, 5, 3, 4])) is None  # first + L - 1 == last, yet not a run
    assert contiguous_run(torch.tensor([2, 1])) is None and contiguous_run(torch.tensor([], dtype=torch.int64)) is None
    paged = TokenSlotAllocator(16, page_size=4)  # pages 1..4 = slots 4..19
    assert paged.alloc(6).tolist() == list(range(4, 10))
