"""The installed fleetserve's version, for ``GET /version`` (vLLM's route) and the ``version``
field of ``/get_server_info`` (SGLang's) and ``/v1/loads``.

Read from the package metadata (``importlib.metadata``), not from ``fleetserve.__version__``:
the package root is a floor above the entrypoints. ``"unknown"`` when fleetserve runs from a
source tree that was never installed.
"""

from __future__ import annotations

import importlib.metadata

try:
    PACKAGE_VERSION: str = importlib.metadata.version("fleetserve")
except importlib.metadata.PackageNotFoundError:
    PACKAGE_VERSION = "unknown"
