"""Domain errors of the gateway core.

The core raises these; each transport maps them to its wire status in one place
(``gateway.http.error_response``, ``gateway.grpc_api._abort``). ``param`` names the offending
request field when there is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class GatewayError(Exception):
    """Base of every error the core raises on purpose."""

    # A short machine-readable code, used as OpenAI's ``error.code``.
    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(GatewayError):
    """The request is malformed or asks for something unsupported (HTTP 400)."""

    code = "invalid_request"


class PromptTooLong(InvalidRequest):
    """Prompt (plus requested max_tokens) does not fit the model's context (HTTP 400)."""

    code = "context_length_exceeded"


class NotFound(GatewayError):
    """The request names something the gateway does not have (HTTP 404)."""

    code = "not_found"


class ModelNotFound(NotFound):
    """The request names a model this gateway does not serve (HTTP 404)."""

    code = "model_not_found"


class NoWorkerAvailable(GatewayError):
    """No healthy (compatible) worker can take the request (HTTP 503)."""

    code = "no_worker_available"


class WorkerFailed(GatewayError):
    """A worker failed while serving the request (HTTP 503 before the first token)."""

    code = "worker_failed"

    def __init__(
        self, message: str, *, worker: str = "", reason: str = "", param: str | None = None
    ) -> None:
        super().__init__(message, param=param)
        self.worker = worker
        # The worker's own word on the cause, e.g. "kv_transfer_failed" (may be empty).
        self.reason = reason


class WorkerTimedOut(WorkerFailed):
    """A worker stopped answering in time: no token within ``inter_token_timeout_s``, or a
    prefill past its deadline with no other way left (HTTP 504, gRPC DEADLINE_EXCEEDED)."""

    code = "worker_timeout"


class Unauthenticated(GatewayError):
    """No or a wrong API key (HTTP 401, gRPC UNAUTHENTICATED)."""

    code = "invalid_api_key"


class Overloaded(GatewayError):
    """The gateway runs ``max_concurrent_requests`` already (HTTP 429, RESOURCE_EXHAUSTED)."""

    code = "too_many_requests"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(GatewayError):
    """The client's deadline passed before the request finished (gRPC DEADLINE_EXCEEDED)."""

    code = "deadline_exceeded"


def public_message(err: GatewayError, routing: bool) -> str:
    """What a client is told of ``err``: without routing headers (a deployment that hides its
    topology) a failed worker is not named by its address."""
    if routing or not isinstance(err, WorkerFailed) or not err.worker:
        return err.message
    return err.message.replace(err.worker, "<worker>")


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A one-line message and the offending field from pydantic/FastAPI validation errors."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if param is None and first.get("type") == "missing":
        return "the request body is missing", None
    if param is None:
        return "the request body must be a JSON object", None
    message = str(first.get("msg", "invalid value"))
    return (f"{param}: {message}" if param else message), param
