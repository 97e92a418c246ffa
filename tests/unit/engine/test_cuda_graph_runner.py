"""CUDA-graph bucket choice (the part of decode graphs that runs on CPU)."""

import pytest
import torch

from fleetserve.engine.cuda_graph_runner import DecodeGraphRunner, choose_bucket, default_batch_sizes


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
