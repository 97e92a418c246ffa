"""Fixtures of the entrypoint end-to-end tests.

``smollm2_server``: ONE real ``fleetserve serve`` on the built-in SmolLM2-135M (HTTP process +
scheduler process), started on first use and shared by every module here that only needs "a
served SmolLM2" (``test_serve_openai_e2e.py``, ``test_structured_outputs.py``): a start costs
about 20 s of CPU on this machine. Its flags are the union of what those modules test:

* ``--api-key API_KEY`` (every route but the probes needs it: clients send it),
* ``--max-request-bytes MAX_BODY`` (a larger body is 413),
* ``--max-total-tokens 4096`` (so the context length is 4096),
* ``--tool-call-parser qwen25`` (only requests with ``tools`` see it).

Tests run one at a time, so each still sees an idle server at its start; a test that counts
(running requests, KV in use) waits for its own requests' counts to return to zero, as before.
"""

from __future__ import annotations

import os
import sys

import pytest

from fleetserve.engine.rank_supervisor import free_port
from helpers.serve_process import serve_process
from helpers.smollm2_server import API_KEY, MAX_BODY, MAX_TOTAL_TOKENS, STARTUP_TIMEOUT, TOOL_CALL_PARSER


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    """``base`` URL (``http://127.0.0.1:<port>``) of the shared SmolLM2 server (see the module doc)."""
    port = free_port()
    # one intra-op thread: batch-1 decode is Python-bound, and spinning OpenMP threads suffer most on a shared CPU
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "fleetserve.cli", "serve", "--port", str(port),
           "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--api-key", API_KEY, "--max-request-bytes", str(MAX_BODY),
           "--tool-call-parser", TOOL_CALL_PARSER, "--log-level", "warning"]
    base = f"http://127.0.0.1:{port}"
    with open(tmp_path_factory.mktemp("smollm2_server") / "serve.log", "w+") as log, \
            serve_process(cmd, base, log, env, STARTUP_TIMEOUT):
        yield base
