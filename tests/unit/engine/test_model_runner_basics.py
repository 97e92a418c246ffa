"""ModelRunner contract: IDLE batches, dtype choice, default model, MLA decode
(absorbed) equals MLA extend (expanded), bf16 serving stays close to fp32."""

import logging

import pytest
import torch

from fleetserve.core.forward_batch import ForwardBatch
from fleetserve.engine.model_runner import ModelRunner
from fleetserve.models.config import resolve_dtype
from fleetserve.models.registry import default_model_path
from helpers.batch_driver import Req, free, run_decode, run_extend


@pytest.fixture(scope="module")
def v3_runner(tiny_deepseek_v3_dir):
    return ModelRunner(tiny_deepseek_v3_dir, dtype="float32", max_total_tokens=1024, show_progress=False)


def test_default_model_is_the_smollm2_gguf():
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_dtype_resolution(monkeypatch):
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    # auto on CPU is float32 whatever the CPU (AMX included: bf16 is --quantization bf16_linear's
    # opt-in, lossy), bfloat16 on CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cap in ("AMX", "AVX512", "AVX2"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda cap=cap: cap)
        assert resolve_dtype("auto") is torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_dtype("auto") is torch.bfloat16
    with pytest.raises(ValueError):
        resolve_dtype("int3")


def test_idle_batch_returns_no_rows(v3_runner, tiny_llama_dir):
    llama = ModelRunner(tiny_llama_dir, dtype="float32", max_total_tokens=64, show_progress=False)
    for runner in (v3_runner, llama):
        out = runner.forward(ForwardBatch.idle())
        assert out.shape == (0, runner.vocab_size) and out.dtype == torch.float32
        assert runner.allocator.available_size() == runner.max_total_tokens


def test_mla_absorbed_decode_equals_expanded_extend(v3_runner):
    """The same one-token step, once as DECODE (absorbed MLA over the latent) and
    once as a one-token EXTEND (per-head K/V expanded from the latent)."""
    prompts = [list(range(10, 30)), list(range(40, 47))]
    a, b = [Req([]) for _ in prompts], [Req([]) for _ in prompts]
    run_extend(v3_runner, a, prompts)
    run_extend(v3_runner, b, prompts)
    absorbed = run_decode(v3_runner, a, [3, 4])
    expanded = run_extend(v3_runner, b, [[3], [4]])
    assert (absorbed - expanded).abs().max().item() <= 1e-4
    assert absorbed.std().item() > 1.0
    free(v3_runner, a + b)


def test_kv_log_and_eos(tiny_deepseek_v3_dir, caplog):
    with caplog.at_level(logging.INFO, logger="fleetserve.engine.model_runner"):
        r = ModelRunner(tiny_deepseek_v3_dir, dtype="float32", max_total_tokens=100, show_progress=False)
    assert f"{r.kv_bytes_per_token} bytes per token" in caplog.text
    assert r.eos_token_ids == [257]
    assert r.max_context_len == 100 and r.allocator.available_size() == 100


def test_bfloat16_serving_is_close_to_float32(tiny_llama_dir, v3_runner, tiny_deepseek_v3_dir):
    for path, ref_runner in ((tiny_llama_dir, None), (tiny_deepseek_v3_dir, v3_runner)):
        fp32 = ref_runner or ModelRunner(path, dtype="float32", max_total_tokens=64, show_progress=False)
        bf16 = ModelRunner(path, dtype="bfloat16", max_total_tokens=64, show_progress=False)
        assert bf16.kv_pool.dtype == torch.bfloat16
        prompt = list(range(60, 80))
        outs = []
        for r in (fp32, bf16):
            req = Req([])
            run_extend(r, [req], [prompt[:-1]])
            outs.append(run_decode(r, [req], [prompt[-1]]))
            free(r, [req])
        assert outs[1].dtype == torch.float32
        assert torch.corrcoef(torch.stack([outs[0][0], outs[1][0]]))[0, 1] > 0.99


@pytest.mark.parametrize("which", ["llama", "v3"])
def test_uneven_batch_is_split_into_groups_with_same_logits(which, v3_runner, tiny_llama_dir):
    """One long prompt with many short ones: padding everything to one shape would
    waste most of the work, so attention runs per length group -- same logits."""
    from fleetserve.core.forward_context import _group_requests

    runner = v3_runner if which == "v3" else ModelRunner(tiny_llama_dir, dtype="float32", max_total_tokens=1024,
                                                         show_progress=False)
    assert len(_group_requests([300] + [5] * 10, [300] + [5] * 10, decode=False)) >= 2
    assert len(_group_requests([20, 18, 25], [20, 18, 25], decode=False)) == 1
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in [300] + [3, 7, 5, 2, 6, 4, 8, 9, 1, 5]]
    alone = []
    for p in prompts:
        r = Req([])
        alone.append(run_extend(runner, [r], [p])[0])
        free(runner, [r])
    reqs = [Req([]) for _ in prompts]
    batched = run_extend(runner, reqs, prompts)
    assert (batched - torch.stack(alone)).abs().max().item() <= 1e-4
    # Decode with the same spread of lengths also splits, and matches one-by-one decode.
    dec = run_decode(runner, reqs, [1] * len(prompts))
    for i, r in enumerate(reqs):
        one = Req([])
        run_extend(runner, [one], [r.tokens[:-1]])
        assert (run_decode(runner, [one], [1])[0] - dec[i]).abs().max().item() <= 1e-4
        free(runner, [one])
    free(runner, reqs)
    assert runner.allocator.available_size() == runner.max_total_tokens


def test_page_size_rounds_the_pool_to_pages_and_sizes_the_kv_rows(tiny_llama_dir):
    from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE
    from fleetserve.engine.args import ServerArgs
    from fleetserve.engine.rank_builder import make_model_runner

    args = ServerArgs(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=70, page_size=16,
                      chunked_prefill_size=64, random_seed=0)
    r = make_model_runner(args, SINGLE_RANK_STATE)
    assert r.allocator.page_size == 16 and r.allocator.size == 64 and r.max_total_tokens == 64
    # pages 1..4 = slots 16..79: the buffers need 80 rows
    assert r.kv_pool.k_buffer[0].shape[0] == 80 == r.allocator.max_slot + 1
