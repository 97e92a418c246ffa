"""--enable-torch-compile on CPU: the compiled decode step gives the eager greedy tokens on a
tiny Llama at batch 1 and at batch 3 (buckets 1 and 4), a batch past the largest bucket runs
eagerly, and the step sits behind the graph gate. The MLA + MoE model (tiny DeepSeek-V2, MoE run
eagerly inside the step) is compiled under DP attention + EP in test_compiled_decode_parallel.py,
so it is not compiled a second time here (compiling costs about a minute per model on 2 cores).
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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compiled_decode_gives_the_eager_greedy_tokens(tiny_llama_dir):
    path, buckets, keys = tiny_llama_dir, [1, 4], [(1, 18), (4, 18)]
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
        assert got == want, len(prompts)
        # the last step (longest sequence 7 + 11 = 18) ran compiled at bucket 1, or at bucket 4 with
        # padding rows, KV width 18 as eager (the graph compiled at width 16 serves it: it is dynamic)
        assert runner.last_key == key
    assert counters["stats"]["unique_graphs"] == graphs, "a decode step recompiled"
    assert compiled.allocator.available_size() == eager.allocator.available_size()
    # five requests: past the largest bucket (4), so each step replays bucket 4 for the first four
    # rows and bucket 1 for the fifth (longest sequence 4 + 3 = 7), with eager's tokens
    five = PROMPTS + [[3, 1, 4], [1, 5, 9, 2]]
    runner.last_key = None
    assert greedy_generate(compiled, five, 4) == greedy_generate(eager, five, 4)
    assert runner.last_key == (1, 7)
    assert counters["stats"]["unique_graphs"] == graphs, "a sliced decode step recompiled"
