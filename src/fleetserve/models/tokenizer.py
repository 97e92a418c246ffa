"""Tokenizer and chat template from the model's own files (transformers; no network).

* HF directory: ``AutoTokenizer.from_pretrained(dir)`` (tokenizer.json /
  tokenizer_config.json, chat template from ``chat_template.jinja`` or the
  tokenizer config).
* GGUF file: ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` builds the
  tokenizer and chat template from the GGUF metadata (``tokenizer.ggml.*``,
  ``tokenizer.chat_template``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any

from fleetserve.models.config import is_gguf
from fleetserve.models.registry import default_model_path

logger = logging.getLogger(__name__)


def tokenizer_cache_dir(gguf_path: str) -> str:
    """Where the tokenizer converted from ``gguf_path`` is kept (keyed by path, size and mtime).

    Converting a GGUF's tokenizer takes transformers 10-40 s on these CPUs (it parses
    every vocabulary string of the file); the saved ``tokenizer.json`` loads in about 1 s.
    ``$FLEETSERVE_CACHE`` overrides the base directory (default ``~/.cache/fleetserve``).
    """
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
    base = os.environ.get("FLEETSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fleetserve")
    return os.path.join(base, "tokenizers", key)



def tokenizer_dir(model_path: str | None = None) -> str:
    """A directory with the tokenizer of ``model_path`` (None = the built-in model) as
    ``tokenizer.json`` + config + chat template, for readers without transformers' GGUF
    support (the router's ``--tokenizer-path``). A GGUF's tokenizer is converted once into
    :func:`tokenizer_cache_dir`; a model directory is returned as it is."""
    path = model_path or default_model_path()
    if not is_gguf(path):
        return path
    folder = tokenizer_cache_dir(path)
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        load_tokenizer(path)  # converts and caches it
    return folder

def save_tokenizer_cache(tokenizer: Any, cache_dir: str) -> None:
    """Save ``tokenizer`` into ``cache_dir`` atomically (write a sibling, then rename); errors only log.

    When another process saved a complete cache there first (``fleetserve launch`` starts its
    instances together, and each converts the tokenizer on a first run), the rename fails with
    "directory not empty": that is no error, so the copy is dropped without a warning.
    """
    tmp = None
    try:
        os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(cache_dir))
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cache_dir)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isfile(os.path.join(cache_dir, "tokenizer_config.json")):  # another process won the race
            logger.debug("tokenizer already cached in %s by another process", cache_dir)
        else:
            logger.warning("could not cache the tokenizer in %s: %s", cache_dir, e)


def load_tokenizer(model_path: str | None = None):
    """The tokenizer of ``model_path`` (None = the built-in default model).

    A tokenizer converted from a GGUF file is read from (or saved to) the cache of
    :func:`tokenizer_cache_dir`.

    Raises FileNotFoundError when the path does not exist.
    """
    from transformers import AutoTokenizer

    path = model_path or default_model_path()
    if is_gguf(path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model path {path!r} does not exist")
        cache_dir = tokenizer_cache_dir(path)
        if os.path.isfile(os.path.join(cache_dir, "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(cache_dir, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path),
                                            local_files_only=True)
        save_tokenizer_cache(tok, cache_dir)
        return tok
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is neither a directory nor a .gguf file")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
