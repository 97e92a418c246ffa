"""The engine's HTTP API: a FastAPI app over a :class:`~fleetserve.entrypoints.tokenizer_manager.TokenizerManager`.

Routes (OpenAI-compatible and SGLang-native), by the module that holds them:

==============================  ==============  ======================================================
``POST /v1/completions``        completions.py  prompt as text, texts, token ids or lists of ids; echo; logprobs; SSE
``POST /v1/chat/completions``   chat.py         chat template of the model; text content parts; logprobs; SSE
``POST /generate``              native.py       SGLang: ``text`` / ``input_ids``, single or batch, ``sampling_params``
``GET  /v1/models``             admin.py        the served model (``/v1/models/{name}``: its card)
``GET  /health``                admin.py        the scheduler process is alive
``GET  /health_generate``       admin.py        runs a one-token generation
``GET  /get_model_info``        admin.py        model path, context length, vocabulary size
``GET  /get_server_info``       admin.py        server arguments plus the schedulers' live stats
``GET  /v1/loads``              loads.py        SGLang: per-DP-rank load (``dp_rank``, ``include``, ``format``)
``GET  /get_load``              loads.py        SGLang's older per-DP-rank load list
``POST /flush_cache``           admin.py        empty the radix cache
``POST /abort_request``         admin.py        abort by request id
``GET  /metrics``               admin.py        Prometheus text format
==============================  ==============  ======================================================

The other modules: ``app.py`` builds the app (``create_app``); ``state.py`` the
:class:`~fleetserve.entrypoints.http.state.ServerState` every route reads;
``body.py`` reads and parses bodies; ``streaming.py`` submits, then collects or
streams, for the three generating families; ``errors.py`` and ``auth.py`` the
error responses and the API key; ``lifespan.py`` start-up and the scheduler
watchdog. Field checks and sampling construction are
:mod:`fleetserve.entrypoints.validation`'s.

Bodies are read and parsed here (not by FastAPI) so that every bad input gets an
OpenAI-style JSON error: malformed JSON and wrong types 400, unknown model 404,
a body over ``max_request_bytes`` 413, a wrong or missing API key 401.
A client that disconnects aborts its requests on the scheduler (streaming: the
response generator is cancelled; non-streaming: a watcher polls for the disconnect).
"""

from fleetserve.entrypoints.http.app import create_app

__all__ = ["create_app"]
