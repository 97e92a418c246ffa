"""--torch-compile-region layer: the decoder layers are compiled (regional compilation) instead
of the whole step; on a tiny Llama in float32 the greedy tokens equal eager's, and a bad region is
refused. Graph sharing is not asserted: as the layers stand, each layer's int attributes (the
opaque gemm handle, ``layer_id`` indexing the KV pool's list) are guarded, so dynamo compiles one
graph per layer (seen with TORCH_LOGS=recompiles), and steps after capture recompiled too."""

import pytest
from torch._dynamo.utils import counters

from fleetserve.engine.compiled_decode_runner import CompiledDecodeRunner
from fleetserve.engine.model_runner import ModelRunner
from helpers.batch_driver import greedy_generate

PROMPTS = [[5, 9, 14, 3, 7], [11, 2], [8, 8, 1, 30, 4, 6, 12]]


def _runner(path, **kw):
    return ModelRunner(path, dtype="float32", max_total_tokens=512, show_progress=False, **kw)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_layer_region_gives_the_eager_greedy_tokens(tiny_llama_dir):
    eager = _runner(tiny_llama_dir)
    before = counters["stats"]["unique_graphs"]
    compiled = _runner(tiny_llama_dir, enable_torch_compile=True, graph_batch_sizes=[1, 4],
                       graph_seq_len_buckets=[16, 64], torch_compile_region="layer")
    runner = compiled.graph_runner
    assert isinstance(runner, CompiledDecodeRunner)
    assert runner.compiled == compiled._static_decode_forward  # the step itself runs eagerly
    assert len(runner.regions) == len(compiled.model.layers) >= 2
    assert counters["stats"]["unique_graphs"] > before  # the layers were compiled
    for prompts in ([PROMPTS[2]], PROMPTS):
        runner.last_key = None
        assert greedy_generate(compiled, prompts, 12) == greedy_generate(eager, prompts, 12), len(prompts)
        assert runner.last_key is not None  # the steps went through the compiled runner


def test_bad_region_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="--torch-compile-region"):
        _runner(tiny_llama_dir, enable_torch_compile=True, graph_batch_sizes=[1], torch_compile_region="model")
