"""Session-wide fixtures shared by every test area.

Models are built or loaded once per session:

* ``smollm2_path``: the built-in SmolLM2-135M-Instruct Q4_1 GGUF.
* ``tiny_llama_dir``, ``tiny_deepseek_v2_dir`` (no q_lora, group-limited
  top-k, YaRN), ``tiny_deepseek_v2_greedy_dir`` (q_lora, greedy top-k),
  ``tiny_deepseek_v3_dir`` (sigmoid router with correction bias): tiny random
  fp32 HF directories with a byte-level tokenizer (see
  ``tests/helpers/tiny_models.py``).
* ``smollm2_runner``: one float32 :class:`ModelRunner` on SmolLM2 (16,384 KV
  slots). Tests that use it must free every slot they allocate.
* ``hf_smollm2``: transformers' own float32 model from the same GGUF (the
  parity reference; about 30 s to load).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # makes `helpers` importable

torch.set_num_threads(1)  # tiny ops: thread sync costs more than it saves; also robust on a busy machine


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from fleetserve.models.registry import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tiny_models"))


def _tiny(root: str, kind: str) -> str:
    from helpers.tiny_models import build_tiny_model

    path = os.path.join(root, kind)
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_tiny_model(kind, path, seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_models_root) -> str:
    return _tiny(tiny_models_root, "llama")


@pytest.fixture(scope="session")
def tiny_deepseek_v2_dir(tiny_models_root) -> str:
    return _tiny(tiny_models_root, "deepseek_v2")


@pytest.fixture(scope="session")
def tiny_deepseek_v2_greedy_dir(tiny_models_root) -> str:
    return _tiny(tiny_models_root, "deepseek_v2_greedy")


@pytest.fixture(scope="session")
def tiny_deepseek_v3_dir(tiny_models_root) -> str:
    return _tiny(tiny_models_root, "deepseek_v3")


@pytest.fixture(scope="session")
def smollm2_runner(smollm2_path):
    from fleetserve.engine.model_runner import ModelRunner

    return ModelRunner(smollm2_path, dtype="float32", max_total_tokens=16384, show_progress=False)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_path),
                                                 gguf_file=os.path.basename(smollm2_path), dtype=torch.float32)
    return model.eval()


# --------------------------------------------------------------- gloo rank pools
# Persistent 2- and 4-rank gloo pools (fleetserve.testing.rank_pool), started
# once per session and shared by the parallel unit and integration tests: a pool
# only runs stateless jobs, so both areas can use the same ranks.
@pytest.fixture(scope="session")
def pool2():
    from fleetserve.testing.rank_pool import RankPool

    with RankPool(world_size=2, timeout_s=30) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool4():
    from fleetserve.testing.rank_pool import RankPool

    with RankPool(world_size=4, timeout_s=30) as pool:
        yield pool
