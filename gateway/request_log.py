"""One log line per finished request: logger ``pdserve.requests``, level INFO, message
"request done" and the request's fields (``FIELDS``, documented in docs/observability.md).

Every generation request gets exactly one line, whatever its outcome: ``generation_ended``
from the two places a ``Generation`` ends (``_finish``: "ok"; ``abandon``: everything else),
which hands over what the line says of it as data (``RoutedRequest``);
``refused`` from ``GenerationService.start`` for requests that end before a ``Generation``
exists (invalid, overloaded, unavailable, cancelled while tokenizing); ``refused_at_edge`` from
the transport adapters for requests they refuse before the core sees them (a malformed body, a
missing API key), which they serve inside ``serving``. The outcomes are the metrics' ``outcome``
labels. A request with ``n`` > 1 choices logs one line per choice (request id ``<id>-<index>``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from gateway.errors import GatewayError
from gateway.events import outcome_for
from gateway.routing.interfaces import Split
from pdserve.telemetry import log as pdlog
from pdserve.telemetry import tracing

log = logging.getLogger("pdserve.requests")

MESSAGE = "request done"
PHASES = ("queue", "prefill", "transfer", "decode")
# Every field a line may carry, in order; one that is not known is left out.
FIELDS = (
    "request_id",  # the edge id: the client's x-request-id when sane, else made at the edge
    "internal_id",  # the gateway's id of the first attempt (what the workers saw)
    "trace_id",
    "endpoint",
    "outcome",
    "path",
    "split",  # where the prompt was computed and why (gateway.routing.split)
    "predicted_ttft_s",  # the adaptive split's prediction for the chosen worker
    "prefill_worker",
    "decode_worker",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "retries",
    "migrations",
    "total_s",
    "ttft_s",
    *(f"{phase}_s" for phase in PHASES),
)


@dataclass
class _Lines:
    """How many request lines the request being served has written (shared by the tasks it
    starts: choices run in tasks of their own)."""

    written: int = 0


_lines: ContextVar[_Lines | None] = ContextVar("pdserve_request_lines", default=None)


@contextmanager
def serving(request_id: str) -> Iterator[None]:
    """Serve one edge request: its id names every log line
    (``pdserve.telemetry.log.request_context``) and ``refused_at_edge`` knows whether the core
    wrote its line already."""
    token = _lines.set(_Lines())
    try:
        with pdlog.request_context(request_id):
            yield
    finally:
        try:
            _lines.reset(token)
        except ValueError:  # an async generator closed from another context: nothing to undo
            pass


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _emit(fields: dict[str, object]) -> None:
    if log.isEnabledFor(logging.INFO):
        kept = {k: v for k, v in fields.items() if v is not None and v != ""}
        log.info(MESSAGE, extra={pdlog.FIELDS: kept})
    lines = _lines.get()
    if lines is not None:
        lines.written += 1


@dataclass(frozen=True)
class RoutedRequest:
    """What the line of a routed request says of it, filled in when it ends."""

    edge_id: str  # the client's id
    request_id: str  # the gateway's id of the first attempt
    trace_id: str | None
    endpoint: str
    path: str
    prefill_worker: str  # "local": the decode worker computed the prompt
    decode_worker: str
    prompt_tokens: int
    completion_tokens: int
    retries: int
    migrations: int
    received_at: float  # time.monotonic()
    first_token_at: float | None
    split: Split | None = None


def generation_ended(
    request: RoutedRequest,
    outcome: str,
    *,
    cached_tokens: int | None = None,
    phases: Mapping[str, float] | None = None,
) -> None:
    """The line of a request that was routed (``phases``: from ``GatewayMetrics.phases``)."""
    r = request
    now = time.monotonic()
    first = r.first_token_at
    fields: dict[str, object] = {
        "request_id": r.edge_id,
        "internal_id": r.request_id,
        "trace_id": r.trace_id,
        "endpoint": r.endpoint,
        "outcome": outcome,
        "path": r.path,
        "split": None if r.split is None else str(r.split),
        "predicted_ttft_s": _seconds(None if r.split is None else r.split.predicted_ttft_s),
        "prefill_worker": r.prefill_worker,
        "decode_worker": r.decode_worker,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": cached_tokens,
        "retries": r.retries,
        "migrations": r.migrations,
        "total_s": _seconds(now - r.received_at),
        "ttft_s": _seconds(None if first is None else first - r.received_at),
    }
    for phase in PHASES:
        fields[f"{phase}_s"] = _seconds((phases or {}).get(phase))
    _emit(fields)


def refused(
    request_id: str,
    endpoint: str,
    outcome: str,
    *,
    received_at: float | None = None,
    prompt_tokens: int | None = None,
) -> None:
    """The line of a request that ended before it was routed (path "none")."""
    total = None if received_at is None else time.monotonic() - received_at
    _emit(
        {
            "request_id": request_id,
            "trace_id": tracing.current_trace_id(),
            "endpoint": endpoint,
            "outcome": outcome,
            "path": "none",
            "prompt_tokens": prompt_tokens,
            "total_s": _seconds(total),
        }
    )


def refused_at_edge(
    request_id: str, endpoint: str, err: GatewayError, received_at: float | None = None
) -> bool:
    """The line of a request its adapter refused (e.g. vLLM's renderer refused its body),
    unless the core has written one (the error came from there, and the core counted it);
    True when it wrote the line (the adapter then counts the request)."""
    lines = _lines.get()
    if lines is not None and lines.written:
        return False
    refused(request_id, endpoint, outcome_for(err), received_at=received_at)
    return True
