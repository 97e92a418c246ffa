"""Tokenizer and chat template from the model's own files (transformers; no network).

* HF directory: ``AutoTokenizer.from_pretrained(dir)`` (tokenizer.json /
  tokenizer_config.json, chat template from ``chat_template.jinja`` or the
  tokenizer config).
* GGUF file: ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` builds the
  tokenizer and chat template from the GGUF metadata (``tokenizer.ggml.*``,
  ``tokenizer.chat_template``).
"""

from __future__ import annotations

import os

from fleetserve.models.config import is_gguf
from fleetserve.models.registry import default_model_path


def load_tokenizer(model_path: str | None = None):
    """The tokenizer of ``model_path`` (None = the built-in default model).

    Raises FileNotFoundError when the path does not exist.
    """
    from transformers import AutoTokenizer

    path = model_path or default_model_path()
    if is_gguf(path):
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path),
                                             local_files_only=True)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is neither a directory nor a .gguf file")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
