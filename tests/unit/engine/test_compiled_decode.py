"""--enable-torch-compile on CPU: the compiled decode step gives the eager greedy tokens
on a tiny Llama and a tiny DeepSeek-V2 (MLA + MoE, whose MoE runs eagerly inside the
step) at batch 1 and at batch 3 (the Llama at buckets 1 and 4; DeepSeek-V2 padded to 4 for
both), and sits behind the graph gate.
Compiled graphs land in inductor's on-disk cache, so a second run is much faster."""

import pytest
from torch._dynamo.utils import counters

from fleetserve.engine.compiled_decode_runner import CompiledDecodeRunner
from fleetserve.engine.model_runner import ModelRunner
from helpers.batch_driver import greedy_generate

PROMPTS = [[5, 9, 14, 3, 7], [11, 2], [8, 8, 1, 30, 4, 6, 12]]
NEW_TOKENS = 12


def _runner(path, **kw):
    return ModelRunner(path, dtype="float32", max_total_tokens=512, show_progress=False, **kw)


#: Compiling costs about a minute per model and bucket set on this 2-core machine (inductor's C++
#: build), so the DeepSeek-V2 case (MoE run eagerly inside the step) compiles one bucket only: both
#: of its batches run padded to 4.
CASES = [("tiny_llama_dir", [1, 4], [(1, 18), (4, 18)]), ("tiny_deepseek_v2_dir", [4], [(4, 18), (4, 18)])]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind,buckets,keys", CASES, ids=["llama", "deepseek_v2"])
def test_compiled_decode_gives_the_eager_greedy_tokens(kind, buckets, keys, request):
    path = request.getfixturevalue(kind)
    eager = _runner(path)
    compiled = _runner(path, enable_torch_compile=True, graph_batch_sizes=buckets,
                       graph_seq_len_buckets=[16, 64])
    runner = compiled.graph_runner
    assert isinstance(runner, CompiledDecodeRunner) and compiled.decode_graphs_enabled
    assert runner.batch_sizes == buckets and sorted(runner.compile_seconds) == buckets
    assert eager.graph_runner is None and not eager.decode_graphs_enabled
    graphs = counters["stats"]["unique_graphs"]
    for prompts, key in zip(([PROMPTS[2]], PROMPTS), keys):
        want = greedy_generate(eager, prompts, NEW_TOKENS)
        runner.last_key = None
        got = greedy_generate(compiled, prompts, NEW_TOKENS)
        assert got == want, (kind, len(prompts))
        # the last step (longest sequence 7 + 11 = 18) ran compiled at bucket 1, or at bucket 4 with
        # padding rows, KV width 18 as eager (the graph compiled at width 16 serves it: it is dynamic)
        assert runner.last_key == key
    assert counters["stats"]["unique_graphs"] == graphs, "a decode step recompiled"
    assert compiled.allocator.available_size() == eager.allocator.available_size()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_batches_past_torch_compile_max_bs_run_eagerly(tiny_llama_dir):
    compiled = _runner(tiny_llama_dir, enable_torch_compile=True, torch_compile_max_bs=1, graph_seq_len_buckets=[64])
    eager = _runner(tiny_llama_dir)
    runner = compiled.graph_runner
    assert runner.batch_sizes == [1]
    runner.last_key = None
    got = greedy_generate(compiled, PROMPTS[:2], 4)          # batch 2 > torch_compile_max_bs 1
    assert runner.last_key is None
    assert got == greedy_generate(eager, PROMPTS[:2], 4)
