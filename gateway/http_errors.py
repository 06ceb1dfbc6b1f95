"""The one mapping of the gateway's domain errors to HTTP status and error JSON (OpenAI's;
Anthropic's for its Messages API)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from gateway import openai_format as fmt
from gateway.errors import (
    DeadlineExceeded,
    GatewayError,
    InvalidRequest,
    NotFound,
    NoWorkerAvailable,
    Overloaded,
    Unauthenticated,
    WorkerFailed,
    WorkerTimedOut,
    public_message,
)

_STATUS: list[tuple[type[GatewayError], int, str]] = [
    (NotFound, 404, "invalid_request_error"),
    (InvalidRequest, 400, "invalid_request_error"),
    (Unauthenticated, 401, "authentication_error"),
    (Overloaded, 429, "rate_limit_error"),
    (DeadlineExceeded, 504, "timeout_error"),
    (WorkerTimedOut, 504, "timeout_error"),
    (NoWorkerAvailable, 503, "service_unavailable_error"),
    (WorkerFailed, 503, "service_unavailable_error"),
]


# Anthropic's error types by status (its Messages API: /v1/messages).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def status_and_type(err: GatewayError) -> tuple[int, str]:
    for kind, status, name in _STATUS:
        if isinstance(err, kind):
            return status, name
    return 500, "server_error"


def error_response(err: GatewayError, routing: bool, anthropic: bool = False) -> JSONResponse:
    """``routing``: the deployment's ``routing_headers`` (off: no worker address is shown);
    ``anthropic``: Anthropic's error shape and types (``/v1/messages``)."""
    status, kind = status_and_type(err)
    headers = {}
    if isinstance(err, Overloaded):
        headers["retry-after"] = str(err.retry_after_s)
    if isinstance(err, Unauthenticated):
        headers["www-authenticate"] = "Bearer"
    message = public_message(err, routing)
    if anthropic:
        anthropic_kind = _ANTHROPIC_TYPES.get(status, "api_error")
        body = {"type": "error", "error": {"type": anthropic_kind, "message": message}}
    else:
        body = fmt.error_body(message, kind, err.param, err.code)
    return JSONResponse(body, status, headers)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


def _described(text: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": text}


# The error responses of the generation endpoints, for the OpenAPI document.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _described("invalid request (bad field, prompt longer than the context)"),
    401: _described("missing or invalid API key (when keys are configured)"),
    404: _described("unknown model"),
    429: _described("the gateway is saturated; retry after Retry-After seconds"),
    503: _described("no healthy worker can take the request, or a worker failed"),
    504: _described("a worker stopped answering in time (inter-token or prefill timeout)"),
}
