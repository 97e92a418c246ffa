"""ServerArgs: SGLang flag names parse into the dataclass; impossible values are refused."""

import argparse

import pytest
import torch

from fleetserve.engine.args import ServerArgs


def parse(argv):
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return ServerArgs.from_cli_args(p.parse_args(argv))


def test_sglang_flags_parse():
    a = parse(["--model", "/m.gguf", "--port", "8001", "--tp-size", "4", "--dp-size", "2",
               "--enable-dp-attention", "--ep-size", "2", "--moe-a2a-backend", "all_to_all",
               "--max-total-tokens", "4096", "--chunked-prefill-size", "-1", "--schedule-policy", "fcfs",
               "--disable-radix-cache", "--api-key", "k", "--served-model-name", "x", "--random-seed", "7"])
    assert a.model_path == "/m.gguf" and a.port == 8001 and a.tp_size == 4 and a.dp_size == 2
    assert a.enable_dp_attention and a.ep_size == 2 and a.moe_a2a_backend == "all_to_all"
    assert a.max_total_tokens == 4096 and a.chunk_size is None and a.schedule_policy == "fcfs"
    assert a.disable_radix_cache and a.api_key == "k" and a.served_model_name == "x" and a.random_seed == 7
    assert a.attn_tp_size == 2 and a.world_size == 4


def test_defaults_match_dataclass():
    a, b = parse([]), ServerArgs()
    assert a.random_seed is not None and b.random_seed is not None  # picked once, shared by all ranks
    a.random_seed = b.random_seed
    assert a == b
    assert ServerArgs().chunk_size == 8192 and ServerArgs().world_size == 1


@pytest.mark.parametrize("kwargs", [
    {"tp_size": 3, "dp_size": 2, "enable_dp_attention": True},
    {"tp_size": 2, "ep_size": 4},
    {"schedule_policy": "random"},
    {"dtype": "int4"},
    {"nnodes": 2},
    {"max_running_requests": 0},
    {"port": 99999},
    {"cuda_graph_max_bs": 0},
])
def test_impossible_combinations_raise(kwargs):
    with pytest.raises(ValueError):
        ServerArgs(**kwargs)


def test_cuda_graph_flags_parse_and_default_off_nowhere():
    a = parse(["--disable-cuda-graph", "--cuda-graph-max-bs", "16"])
    assert a.disable_cuda_graph is True and a.cuda_graph_max_bs == 16
    b = parse([])
    # Not disabled by default: graphs are used wherever they exist (CUDA); CPU has none.
    assert b.disable_cuda_graph is False and b.cuda_graph_max_bs is None


def test_page_size_flag_parses_defaults_to_one():
    assert parse([]).page_size == 1
    a = parse(["--page-size", "16", "--chunked-prefill-size", "64"])
    assert a.page_size == 16 and a.chunk_size == 64
    assert parse(["--page-size", "4", "--chunked-prefill-size", "-1"]).page_size == 4  # no chunking: no rule


@pytest.mark.parametrize("kwargs,msg", [
    ({"page_size": 0}, "--page-size must be >= 1, got 0"),
    ({"page_size": -4}, "--page-size must be >= 1, got -4"),
    ({"page_size": 3, "chunked_prefill_size": 8192}, "--page-size (3) must divide --chunked-prefill-size (8192)"),
    ({"page_size": 64, "max_total_tokens": 32, "chunked_prefill_size": 64},
     "--page-size (64) is larger than the KV pool (--max-total-tokens 32)"),
])
def test_bad_page_size_refused_with_one_line_naming_the_flag(kwargs, msg):
    with pytest.raises(ValueError) as e:
        ServerArgs(**kwargs)
    assert str(e.value) == msg and "\n" not in str(e.value)


def test_allocator_refuses_a_pool_smaller_than_a_page():
    from fleetserve.core.kv_pool import TokenSlotAllocator

    with pytest.raises(ValueError, match="--page-size 16"):
        TokenSlotAllocator(10, 16)
    a = TokenSlotAllocator(70, 16)  # rounded down to whole pages
    assert a.size == 64 and a.num_pages == 4 and a.max_slot == 79 and a.available_size() == 64


def test_torch_compile_flags_parse_with_sglang_defaults():
    # SGLang's server_args: enable_torch_compile = False, torch_compile_max_bs = 32
    b = parse([])
    assert b.enable_torch_compile is False and b.torch_compile_max_bs == 32
    a = parse(["--enable-torch-compile", "--torch-compile-max-bs", "8"])
    assert a.enable_torch_compile is True and a.torch_compile_max_bs == 8


@pytest.mark.parametrize("value", [0, -2])
def test_torch_compile_max_bs_below_one_is_refused_naming_the_flag(value):
    with pytest.raises(ValueError) as e:
        ServerArgs(torch_compile_max_bs=value)
    assert str(e.value) == f"--torch-compile-max-bs must be >= 1, got {value}"


def test_serve_refuses_a_bad_torch_compile_max_bs_in_one_line(capsys):
    from fleetserve.entrypoints import serve

    assert serve.main(["--enable-torch-compile", "--torch-compile-max-bs", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["fleetserve serve: --torch-compile-max-bs must be >= 1, got 0"]


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "CPU", "cuda0"])
def test_a_bad_device_is_refused_naming_the_flag(device):
    with pytest.raises(ValueError, match=r"^--device must be cpu, cuda or cuda:N"):
        ServerArgs(device=device)


def test_cuda_without_a_visible_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--device cuda: no CUDA device is visible"):
        ServerArgs(device="cuda")


@pytest.mark.parametrize("kwargs, ok", [
    (dict(tp_size=1), True),
    (dict(tp_size=2), True),
    (dict(tp_size=4), False),                                       # 4 ranks, 2 GPUs
    (dict(tp_size=2, dp_size=2), False),                            # 4 ranks without DP attention
    (dict(tp_size=2, dp_size=2, enable_dp_attention=True), True),   # 2 ranks
    (dict(tp_size=4, nnodes=2, dist_init_addr="10.0.0.1:5000"), True),  # 2 per node
    (dict(device="cuda:1"), True),
    (dict(device="cuda:2"), False),
])
def test_cuda_ranks_need_one_visible_gpu_each(monkeypatch, kwargs, ok):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    kwargs = {"device": "cuda", **kwargs}
    if ok:
        assert ServerArgs(**kwargs).device == kwargs["device"]
    else:
        with pytest.raises(ValueError, match=r"^--device cuda(:2)?: .*2 visible GPU"):
            ServerArgs(**kwargs)
