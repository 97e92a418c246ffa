"""create_app: one module per API family, the state on app.state, handlers outside the app builder."""

import tempfile

import pytest

from fleetserve.entrypoints.http import create_app
from fleetserve.entrypoints.http.state import ServerState
from fleetserve.entrypoints.tokenizer_manager import ModelInfo, TokenizerManager

FAMILY = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/generate": "native",
    "/v1/models": "admin",
    "/health": "admin",
    "/version": "admin",
    "/health_generate": "admin",
    "/get_model_info": "admin",
    "/get_server_info": "admin",
    "/flush_cache": "admin",
    "/abort_request": "admin",
    "/metrics": "admin",
}


@pytest.fixture
def app():
    d = tempfile.mkdtemp(prefix="fs-app-")
    info = ModelInfo(model_path="/m", served_model_name="toy", vocab_size=10, context_length=20)
    tm = TokenizerManager(None, info, f"ipc://{d}/in", f"ipc://{d}/out")
    yield create_app(tm, server_args={"x": 1}, api_key="k", max_request_bytes=123)
    tm.send_sock.close(0)
    tm.recv_sock.close(0)


def endpoints(app) -> dict:
    """path -> endpoint function of every route, looking inside included routers
    (FastAPI >= 0.16x keeps an included router as one lazy entry)."""
    found, stack = {}, list(app.routes)
    while stack:
        r = stack.pop()
        inner = getattr(r, "original_router", None)
        if inner is not None:
            stack += inner.routes
        elif hasattr(r, "endpoint"):
            found[r.path] = r.endpoint
    return found


def test_every_route_lives_in_its_family_module(app):
    ours = {p: f for p, f in endpoints(app).items() if p in FAMILY}
    expected = {p: f"fleetserve.entrypoints.http.{m}" for p, m in FAMILY.items()}
    assert {p: f.__module__ for p, f in ours.items()} == expected
    # module-level functions, not closures inside create_app
    assert all("<locals>" not in f.__qualname__ for f in ours.values())


def test_state_holds_the_settings(app):
    state = app.state.server
    assert isinstance(state, ServerState)
    assert (state.model_name, state.server_args, state.api_key, state.max_request_bytes) == ("toy", {"x": 1}, "k", 123)
    assert state.engine_running()
