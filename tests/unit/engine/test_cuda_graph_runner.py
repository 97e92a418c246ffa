"""Decode-graph bucket choice and padding (the parts of decode graphs that run on CPU)."""

import pytest
import torch

from fleetserve.engine.cuda_graph_runner import (DecodeGraphRunner, EagerDecodeGraphRunner, choose_bucket,
                                                 default_batch_sizes, default_seq_len_buckets)


def test_default_sizes_and_bucket_choice():
    sizes = default_batch_sizes(40)
    assert sizes == [1, 2, 4, 8, 16, 24, 32, 40]
    assert default_batch_sizes(3) == [1, 2, 3]
    assert choose_bucket(0, sizes) == 1      # an all-IDLE step still replays the smallest graph
    assert choose_bucket(5, sizes) == 8
    assert choose_bucket(17, sizes) == 24
    assert choose_bucket(40, sizes) == 40
    assert choose_bucket(41, sizes) is None  # too large: run eagerly


def test_bucket_from_the_largest_rank_is_the_same_on_every_rank():
    sizes = default_batch_sizes(32)
    global_num_tokens = [3, 0, 13, 9]        # one rank idle, the others decoding
    buckets = {choose_bucket(max(global_num_tokens), sizes) for _ in global_num_tokens}
    assert buckets == {16}


def test_graph_runner_refuses_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        DecodeGraphRunner(lambda **k: k["x"], lambda bs: {"x": torch.zeros(bs)}, {}, [1, 2])


def test_seq_len_buckets_end_at_the_longest_sequence():
    assert default_seq_len_buckets(1000) == [256, 512, 1000]
    assert default_seq_len_buckets(1024) == [256, 512, 1024]
    assert default_seq_len_buckets(100) == [100]


def test_stand_in_pads_static_buffers_and_reuses_them():
    seen = []

    def fwd(ids, kv):
        seen.append((ids.clone(), kv.clone(), ids.data_ptr()))
        return ids[:, None] * 10 + kv.sum(1, keepdim=True)

    make = lambda bs, w: {"ids": torch.zeros(bs, dtype=torch.int64), "kv": torch.zeros(bs, w, dtype=torch.int64)}
    r = EagerDecodeGraphRunner(fwd, make, {"ids": 7, "kv": 0}, batch_sizes=[1, 2, 4], seq_len_buckets=[4, 8])
    r.capture()
    assert sorted(r.inputs) == [(1, 4), (1, 8), (2, 4), (2, 8), (4, 4), (4, 8)]
    out = r.run({"ids": torch.tensor([1, 2, 3]), "kv": torch.tensor([[1, 1, 0], [2, 0, 0], [5, 5, 5]])},
                r.bucket_for(3), seq_len=3)
    assert r.last_key == (4, 4)
    ids, kv, ptr = seen[-1]
    assert ids.tolist() == [1, 2, 3, 7]                      # the padding row gets the pad value
    assert kv.tolist() == [[1, 1, 0, 0], [2, 0, 0, 0], [5, 5, 5, 0], [0, 0, 0, 0]]
    assert ptr == r.inputs[(4, 4)]["ids"].data_ptr()         # the static buffer itself
    assert out.tolist() == [[12], [22], [45]]                # the real rows only
    r.run({"ids": torch.tensor([4]), "kv": torch.tensor([[9]])}, 4, seq_len=1)
    assert seen[-1][0].tolist() == [4, 7, 7, 7]              # stale rows of the last run are re-padded
    out = r.run({"ids": torch.tensor([1]), "kv": torch.ones(1, 10, dtype=torch.int64)}, 2, seq_len=10)
    assert r.last_key == (2, 10) and seen[-1][1].shape == (2, 10) and out.tolist() == [[20]]
    out = r.run({"ids": torch.zeros(0, dtype=torch.int64), "kv": torch.zeros(0, 1, dtype=torch.int64)}, 2, 1)
    assert out.shape == (0, 1) and seen[-1][0].tolist() == [7, 7]   # an IDLE rank: padding only
