"""--enable-torch-compile on CPU: the compiled decode step gives the eager greedy tokens
on a tiny Llama and a tiny DeepSeek-V2 (MLA + MoE, whose MoE runs eagerly inside the
step) at batch 1 and at batch 3 (padded to bucket 4), and sits behind the graph gate.
Compiled graphs land in inductor's on-disk cache, so a second run is much faster."""

import os

import pytest
from torch._dynamo.utils import counters

from fleetserve.engine.compiled_decode_runner import CompiledDecodeRunner
from fleetserve.engine.model_runner import ModelRunner
from helpers.batch_driver import greedy_generate

PROMPTS = [[5, 9, 14, 3, 7], [11, 2], [8, 8, 1, 30, 4, 6, 12]]
NEW_TOKENS = 12


def _runner(path, **kw):
    return ModelRunner(path, dtype="float32", max_total_tokens=512, show_progress=False, **kw)


#: Compiling takes minutes per model on a loaded 2-core machine (inductor's C++ build), so the
#: DeepSeek-V2 case (MoE run eagerly inside the step) runs only when asked for.
DEEPSEEK = pytest.param("tiny_deepseek_v2_dir", marks=pytest.mark.skipif(
    not os.environ.get("FLEETSERVE_TEST_COMPILE_DEEPSEEK"), reason="set FLEETSERVE_TEST_COMPILE_DEEPSEEK=1"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["tiny_llama_dir", DEEPSEEK])
def test_compiled_decode_gives_the_eager_greedy_tokens(kind, request):
    path = request.getfixturevalue(kind)
    eager = _runner(path)
    compiled = _runner(path, enable_torch_compile=True, graph_batch_sizes=[1, 4],
                       graph_seq_len_buckets=[16, 64])
    runner = compiled.graph_runner
    assert isinstance(runner, CompiledDecodeRunner) and compiled.decode_graphs_enabled
    assert runner.batch_sizes == [1, 4] and sorted(runner.compile_seconds) == [1, 4]
    assert eager.graph_runner is None and not eager.decode_graphs_enabled
    graphs = counters["stats"]["unique_graphs"]
    for prompts, key in (([PROMPTS[2]], (1, 64)), (PROMPTS, (4, 64))):
        want = greedy_generate(eager, prompts, NEW_TOKENS)
        runner.last_key = None
        got = greedy_generate(compiled, prompts, NEW_TOKENS)
        assert got == want, (kind, len(prompts))
        # the last step (longest sequence 7 + 12 = 19) ran compiled at bucket 1, or at bucket 4 with
        # one padding row, width 64 (the graph compiled at width 16 serves it: the width is dynamic)
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
