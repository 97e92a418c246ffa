"""The flags of the entrypoint tests' shared SmolLM2 server (``smollm2_server`` in
``tests/integration/entrypoints/conftest.py``), for the tests that depend on them."""

API_KEY = "test-key"          # --api-key: every route but the probes needs ``Authorization: Bearer API_KEY``
MAX_BODY = 100_000            # --max-request-bytes: a larger body is 413
MAX_TOTAL_TOKENS = 4096       # --max-total-tokens: also the served context length (SmolLM2's own is 8192)
TOOL_CALL_PARSER = "qwen25"   # --tool-call-parser: only requests with ``tools`` see it
STARTUP_TIMEOUT = 240         # seconds, to /health 200 on a busy 2-core machine
