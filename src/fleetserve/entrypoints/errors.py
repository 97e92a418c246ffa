"""The one error type of a refused request.

Every check a request goes through before it reaches the scheduler (body
parsing, the OpenAI and SGLang field rules, sampling ranges, context fit, token
ids) raises :class:`APIError`. It is plain Python: the HTTP layer
(:mod:`fleetserve.entrypoints.http.errors`) turns it into the OpenAI-style body
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``
with ``status`` as the HTTP status, and the offline :class:`~fleetserve.entrypoints.engine.Engine`
lets it propagate (it is a ``ValueError``).
"""

from __future__ import annotations

from typing import Any

# OpenAI's error "type" for each status we emit.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(ValueError):
    """A request the server refuses, with what an OpenAI client needs to know why.

    Args:
        message: human-readable explanation.
        status: HTTP status (400 unless said otherwise).
        param: the offending request field, dotted (``"messages.0.content"``), or None.
        code: machine-readable code, a string a client can act on (``"model_not_found"``,
            ``"invalid_api_key"`` ...) or None, as in OpenAI's errors and the router's; never
            the HTTP status.
        type: OpenAI error type; derived from ``status`` when omitted.
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(self.status, "invalid_request_error")

    def to_dict(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``, the OpenAI error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def model_not_found(name: str, served: str) -> APIError:
    """The 404 for a request naming a model this server does not serve (vLLM answers 404 too).

    ``code`` ``"model_not_found"``, ``param`` ``"model"``; ``served`` is the name to use instead.
    """
    return APIError(f"the model '{name}' does not exist; this server serves '{served}'", 404, "model",
                    "model_not_found")
