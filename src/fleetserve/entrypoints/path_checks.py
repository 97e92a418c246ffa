"""Start-up checks of ``--model-path`` / ``--tokenizer-path`` before anything binds or loads.

A model is a directory (Hugging Face layout) or a ``.gguf`` file, the two forms the loaders read
(``fleetserve.models.tokenizer.load_tokenizer``, ``models.config``); nothing is downloaded, so a
path that is neither is refused at once with one line naming the flag, instead of an error from a
scheduler process after the port is taken.
"""

from __future__ import annotations

import os


def model_path_error(flag: str, path: str | None) -> str | None:
    """``None`` when ``path`` (None: the built-in model) is a directory or a ``.gguf`` file, else one
    line naming ``flag``, e.g. ``--model-path /m: no such file or directory``."""
    if path is None:
        return None
    if not os.path.exists(path):
        return f"{flag} {path}: no such file or directory"
    if os.path.isdir(path) or (os.path.isfile(path) and path.lower().endswith(".gguf")):
        return None
    return f"{flag} {path}: give a model directory or a .gguf file"
