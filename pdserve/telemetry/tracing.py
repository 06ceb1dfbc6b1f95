"""OpenTelemetry tracing of every pdserve process (gateway, prefill and decode workers).

Off by default. ``setup`` turns it on from the standard OpenTelemetry environment:
``OTEL_TRACES_EXPORTER`` ("otlp", "console" or "none"; a comma list works) or, without it, an
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (which implies otlp);
``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` ("http/protobuf", the default, or "grpc");
``OTEL_TRACES_SAMPLER[_ARG]``, ``OTEL_BSP_*`` and ``OTEL_RESOURCE_ATTRIBUTES`` are read by
the SDK itself; ``OTEL_SDK_DISABLED=true`` keeps it off.

Each process names itself: service.name is ``<prefix>-gateway``, ``<prefix>-prefill`` or
``<prefix>-decode``, the prefix being ``OTEL_SERVICE_NAME`` or "pdserve", so one environment
shared by ``pdserve up`` and all its children still tells them apart; the worker id is the
``service.instance.id`` and ``pdserve.worker_id`` resource attributes.

While tracing is off nothing of OpenTelemetry is imported: ``span`` and ``start_span`` return
one shared no-op object and ``inject`` returns nothing, so the request path pays a function
call. W3C trace context travels as ``traceparent``/``tracestate`` (gRPC metadata, HTTP
headers, vLLM's ``trace_headers``).
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
DEFAULT_PREFIX = "pdserve"
PROTOCOLS = ("http/protobuf", "grpc")

_tracer: Any = None  # an opentelemetry Tracer while tracing is on
_provider: Any = None
_kinds: dict[str, Any] = {}  # "server", "client", "internal": the SpanKind (while on)
# While on, the OpenTelemetry modules the request path uses (imported once, by ``setup``).
_context: Any = None  # opentelemetry.context
_trace: Any = None  # opentelemetry.trace
_propagate: Any = None  # opentelemetry.propagate


class _NoSpan:
    """What every span call returns while tracing is off: accepts everything, does nothing."""

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        return None

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        return None

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        return None

    def record_exception(self, exception: BaseException) -> None:
        return None

    def end(self, end_time: int | None = None) -> None:
        return None

    def is_recording(self) -> bool:
        return False


NO_SPAN = _NoSpan()


def enabled() -> bool:
    return _tracer is not None


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def exporter_names(env: Mapping[str, str] | None = None) -> list[str]:
    """The trace exporters the environment asks for (empty: tracing off)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [n for n in names if n]
    if not names:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        names = ["otlp"] if endpoint and endpoint.strip() else []
    return [n for n in names if n != "none"]


def service_name(role: str, env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    prefix = env.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_PREFIX
    return f"{prefix}-{role}"


def _exporter(name: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (otlp, console, none)")
    protocol = (
        _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()
    raise ValueError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL: unsupported protocol {protocol!r} "
        f"(one of {', '.join(PROTOCOLS)})"
    )


def setup(role: str, worker_id: str = "", exporters: Sequence[Any] | None = None) -> bool:
    """Turn tracing on for this process if the environment asks for it; True if on.

    ``role``: "gateway", "prefill" or "decode". ``exporters`` (tests): span exporters to use
    instead of the environment's, each span exported as it ends. A misconfiguration is
    logged, and the process runs untraced rather than not at all."""
    global _tracer, _provider, _context, _trace, _propagate
    if _tracer is not None:
        return True
    names = ["given"] if exporters else exporter_names()
    if not names:
        return False
    try:
        chosen = list(exporters) if exporters else [_exporter(name) for name in names]
    except ValueError as exc:
        log.error("tracing stays off: %s", exc)
        return False
    from opentelemetry import context, propagate, trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    from pdserve.telemetry.tracing_sdk import resource

    attributes = {"service.name": service_name(role), "pdserve.role": role}
    if worker_id:
        attributes |= {"service.instance.id": worker_id, "pdserve.worker_id": worker_id}
    # Sampler from OTEL_TRACES_SAMPLER (default parentbased_always_on); flushed at exit.
    provider = TracerProvider(resource=resource(attributes))
    processor = SimpleSpanProcessor if exporters else BatchSpanProcessor
    for exporter in chosen:
        provider.add_span_processor(processor(exporter))
    # This provider is pdserve's own, not the global one: vLLM's tracing (in the same
    # process) sets up its own, and the two must not replace each other.
    _context, _trace, _propagate = context, trace, propagate
    kinds = trace.SpanKind
    _kinds.update(server=kinds.SERVER, client=kinds.CLIENT, internal=kinds.INTERNAL)
    _provider = provider
    _tracer = provider.get_tracer("pdserve")
    log.info("tracing on: service.name %s, exporters %s", attributes["service.name"], names)
    return True


def shutdown() -> None:
    """Export what is buffered and stop (also done at interpreter exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def _kind(kind: str) -> Any:
    return _kinds.get(kind, _kinds.get("internal"))


def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    kind: str = "internal",
    parent: Any = None,
) -> Any:
    """A context manager: a span, current inside the ``with`` (exceptions are recorded).

    ``parent``: a context from ``extract`` (default: the current span)."""
    if _tracer is None:
        return NO_SPAN
    return _Current(
        _tracer.start_span(name, context=parent, kind=_kind(kind), attributes=attributes)
    )


class _Step:
    """``step``'s context manager: ends the span on the way out, failed by an exception."""

    __slots__ = ("span",)

    def __init__(self, span: Any) -> None:
        self.span = span

    def __enter__(self) -> Any:
        return self.span

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, Exception):  # not for cancellation or exit (OpenTelemetry's own
            fail(self.span, exc)  # context manager fails the span on those too)
        self.span.end()


def step(name: str) -> Any:
    """A context manager: an internal span, child of the current span, for a step that starts
    no span of its own; unlike ``span``, it is not made current inside the ``with``, which
    spares the context switches (exceptions are recorded as ``span`` records them)."""
    if _tracer is None:
        return NO_SPAN
    return _Step(_tracer.start_span(name))


def start_span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    kind: str = "internal",
    start_time: float | None = None,
) -> Any:
    """A span that the caller ends (``end``), child of the current span; not made current.

    ``start_time``: seconds since the epoch (default: now)."""
    if _tracer is None:
        return NO_SPAN
    start = None if start_time is None else int(start_time * 1e9)
    return _tracer.start_span(name, kind=_kind(kind), attributes=attributes, start_time=start)


class use:
    """Make ``span`` current inside the ``with``; on an exception, record it and end the span
    (the caller ends it otherwise)."""

    __slots__ = ("_token", "span")

    def __init__(self, span: Any) -> None:
        self.span = span
        self._token: Any = None

    def __enter__(self) -> Any:
        if self.span is not NO_SPAN:
            self._token = _context.attach(_trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if self._token is None:
            return
        _detach(self._token)
        if exc is not None:
            fail(self.span, exc)
            self.span.end()


class _Current(_Step):
    """``span``'s context manager: as ``step``'s, with the span current inside the ``with``."""

    __slots__ = ("_token",)

    def __enter__(self) -> Any:
        self._token = _context.attach(_trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        _detach(self._token)
        super().__exit__(kind, exc, tb)


def _detach(token: Any) -> None:
    """Undo an ``attach``, unless the ``with`` ends in another context than it began in: a
    server stream (an async generator) that its consumer abandoned is closed by asyncio in a
    task of its own, where there is nothing to undo (OpenTelemetry's own ``detach`` logs
    that as an error, with a traceback, on every cancelled stream)."""
    if not isinstance(token, contextvars.Token):  # another OTEL_PYTHON_CONTEXT runtime
        _context.detach(token)
        return
    try:
        token.var.reset(token)
    except ValueError:  # created in another context
        pass


def fail(span: Any, exc: BaseException | str) -> None:
    """Mark ``span`` failed (records the exception, or the reason given as a string)."""
    if not span.is_recording():
        return
    from opentelemetry.trace import Status, StatusCode

    if isinstance(exc, BaseException):
        span.record_exception(exc)
        exc = f"{type(exc).__name__}: {exc}"
    span.set_status(Status(StatusCode.ERROR, exc))


def finish(
    span: Any, attributes: Mapping[str, Any] | None = None, error: str | None = None
) -> None:
    """End ``span`` unless it has ended already, after adding ``attributes`` and, with
    ``error``, an error status."""
    if not span.is_recording():
        return
    if attributes:
        span.set_attributes(attributes)
    if error:
        fail(span, error)
    span.end()


def end_at(span: Any, end_time: float) -> None:
    """End ``span`` at ``end_time`` (seconds since the epoch)."""
    span.end(end_time=int(end_time * 1e9))


def inject() -> tuple[tuple[str, str], ...]:
    """The current trace context as (key, value) pairs (traceparent, tracestate); empty while
    tracing is off or no span is current."""
    if _tracer is None:
        return ()
    carrier: dict[str, str] = {}
    _propagate.inject(carrier)
    return tuple(carrier.items())


def headers() -> dict[str, str]:
    """``inject`` as a dict, e.g. for vLLM's ``trace_headers``."""
    return dict(inject())


def extract(pairs: Iterable[tuple[Any, Any]] | Mapping[str, Any] | None) -> Any:
    """The trace context in ``pairs`` (gRPC metadata, HTTP headers); None while tracing is off
    or when they carry none (a span started with it is then a root)."""
    if _tracer is None or not pairs:
        return None
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    carrier = {}
    for key, value in items:
        name = key.decode("latin-1") if isinstance(key, bytes) else str(key)
        if name.lower() in (TRACEPARENT, TRACESTATE):
            carrier[name.lower()] = value.decode("latin-1") if isinstance(value, bytes) else value
    if not carrier:
        return None
    return _propagate.extract(carrier)


def trace_id(span: Any) -> str:
    """The 32-hex-digit trace id of ``span`` ("" while tracing is off)."""
    if span is NO_SPAN:
        return ""
    return f"{span.get_span_context().trace_id:032x}"


def current_trace_id() -> str:
    """The trace id of the current span ("" while tracing is off or no span is current)."""
    if _tracer is None:
        return ""
    context = _trace.get_current_span().get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else ""


def monotonic_to_epoch(ts: float) -> float:
    """A ``time.monotonic()`` value of any process on this machine as seconds since the epoch
    (vLLM's engine-core timestamps are monotonic)."""
    return time.time() - (time.monotonic() - ts)
