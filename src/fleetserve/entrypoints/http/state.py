"""What every route needs, in one object: the tokenizer manager and the server's settings.

:func:`~fleetserve.entrypoints.http.app.create_app` stores one
:class:`ServerState` on ``app.state.server``; a route reaches it with
:func:`server_state`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import FastAPI, Request

from fleetserve.entrypoints.errors import model_not_found
from fleetserve.entrypoints.tokenizer_manager import ModelInfo, TokenizerManager
from fleetserve.entrypoints.validation import DP_RANK_HEADER, resolve_routed_dp_rank

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


@dataclass
class ServerState:
    """The served engine as the routes see it.

    Attributes:
        tm: the tokenizer manager: tokenizer, sockets to the schedulers, metrics.
        server_args: reported by ``/get_server_info`` (its ``api_key`` never is).
        api_key: when set, every route but the probes needs ``Authorization: Bearer <api_key>``.
        max_request_bytes: larger request bodies are answered 413.
        is_alive: reports whether the scheduler process(es) still run; None: assume they do.
    """

    tm: TokenizerManager
    server_args: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    is_alive: Callable[[], bool] | None = None

    @property
    def info(self) -> ModelInfo:
        return self.tm.info

    @property
    def model_name(self) -> str:
        """The name clients send as ``model``."""
        return self.tm.info.served_model_name

    @property
    def dp_size(self) -> int:
        """``--dp-size``: how many DP ranks (schedulers with their own queue) serve requests."""
        return int(self.server_args.get("dp_size") or 1)

    def routed_dp_rank(self, request: Request, body_rank: Any, body_param: str = "routed_dp_rank") -> int | None:
        """The DP rank ``request`` names (``X-data-parallel-rank`` header, else ``body_rank``); None: any.

        Raises APIError(400) as :func:`~fleetserve.entrypoints.validation.resolve_routed_dp_rank`.
        """
        return resolve_routed_dp_rank(body_rank, request.headers.get(DP_RANK_HEADER), self.dp_size, body_param)

    def engine_running(self) -> bool:
        """False once a scheduler process is known to have exited."""
        return self.is_alive is None or self.is_alive()

    def check_model(self, name: str | None) -> None:
        """Accept no name, the served name or the model path; else raise APIError 404 (``model_not_found``)."""
        if name is not None and name not in (self.model_name, self.info.model_path):
            raise model_not_found(name, self.model_name)


def server_state_of(app: FastAPI) -> ServerState:
    """The :class:`ServerState` stored on ``app``."""
    return app.state.server


def server_state(request: Request) -> ServerState:
    """The :class:`ServerState` of the app that received ``request``."""
    return server_state_of(request.app)
