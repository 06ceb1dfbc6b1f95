"""One logging set-up for every pdserve process: text lines (the default) or JSON lines.

``setup`` applies ``LogSettings`` (``PDSERVE_LOG_LEVEL``, ``PDSERVE_LOG_FORMAT``) to the root
logger. Every record gets ``request_id`` (the edge request id of the request being served, set
with ``request_context`` by the gateway's adapters) and ``trace_id`` (the current OpenTelemetry
span's, while tracing is on); JSON lines name them when known, text lines leave them out.

A record may carry structured fields: ``log.info("...", extra={"fields": {...}})``. JSON lines
add them as keys (they never replace time, level, service, logger or message); text lines
append them to the message as ``key=value`` pairs. ``None`` values are left out.
"""

from __future__ import annotations

import json
import logging as _logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from pdserve.settings import LogSettings
from pdserve.telemetry import tracing

FIELDS = "fields"  # the ``extra`` key of a record's structured fields
CONTEXT_KEYS = ("request_id", "trace_id")
_BASE_KEYS = ("time", "level", "service", "logger", "message")

_request_id: ContextVar[str] = ContextVar("pdserve_request_id", default="")


@contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Name ``request_id`` on every record logged inside the ``with`` (this task and the
    tasks it starts)."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        try:
            _request_id.reset(token)
        except ValueError:  # an async generator closed from another context: nothing to undo
            pass


def current_request_id() -> str:
    return _request_id.get()


class ContextFilter(_logging.Filter):
    """Sets ``record.request_id`` and ``record.trace_id`` (unless the caller set them)."""

    def filter(self, record: _logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = _request_id.get()
        if not getattr(record, "trace_id", ""):
            record.trace_id = tracing.current_trace_id()
        return True


def fields_of(record: _logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, FIELDS, None)
    if not isinstance(fields, Mapping):
        return {}
    return {k: v for k, v in fields.items() if v is not None}


def _text_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text, ensure_ascii=False)
    return text


def key_values(fields: Mapping[str, Any]) -> str:
    """``fields`` as ``key=value`` pairs (values with spaces, quotes or ``=`` JSON-quoted)."""
    return " ".join(f"{k}={_text_value(v)}" for k, v in fields.items() if v is not None)


class TextFormatter(_logging.Formatter):
    """``HH:MM:SS LEVEL service logger: message key=value ...``."""

    def __init__(self, service: str) -> None:
        super().__init__(
            f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s", datefmt="%H:%M:%S"
        )

    def formatMessage(self, record: _logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = fields_of(record)
        return f"{line} {key_values(fields)}" if fields else line


class JsonFormatter(_logging.Formatter):
    """One JSON object per line: time (ISO 8601, UTC), level, service, logger, message, then
    request_id and trace_id when known, the record's fields, and exception / stack if any."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: _logging.LogRecord) -> str:
        created = datetime.fromtimestamp(record.created, tz=UTC)
        line: dict[str, Any] = {
            "time": created.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in CONTEXT_KEYS:
            value = getattr(record, key, "")
            if value:
                line[key] = value
        for key, value in fields_of(record).items():
            if key not in _BASE_KEYS:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def _settings() -> tuple[LogSettings, str]:
    """The settings, and what was wrong with them (then the format is text)."""
    try:
        return LogSettings(), ""
    except ValidationError as err:
        bad = err.errors()[0].get("input")
        problem = f"PDSERVE_LOG_FORMAT={bad!r} is not text or json; logging as text"
        return LogSettings(format="text"), problem


def setup(service: str, level: str | None = None) -> None:
    """Log to stderr in the configured format; ``level`` (e.g. a worker's ``--log-level``)
    overrides ``PDSERVE_LOG_LEVEL``."""
    settings, problem = _settings()
    handler = _logging.StreamHandler()
    handler.addFilter(ContextFilter())
    formatter = JsonFormatter if settings.format == "json" else TextFormatter
    handler.setFormatter(formatter(service))
    _logging.basicConfig(level=(level or settings.level).upper(), handlers=[handler], force=True)
    if problem:
        _logging.getLogger(__name__).warning("%s", problem)
