"""pdserve.telemetry.tracing: configuration from the OTEL_* environment, the no-op path, and W3C
context in and out (SDK in-memory exporter)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.telemetry import tracing

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_off_by_default_and_by_the_standard_switches() -> None:
    assert tracing.exporter_names({}) == []
    assert tracing.exporter_names({"OTEL_TRACES_EXPORTER": "none"}) == []
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert tracing.exporter_names(endpoint) == ["otlp"]
    assert tracing.exporter_names({**endpoint, "OTEL_TRACES_EXPORTER": "none"}) == []
    assert tracing.exporter_names({**endpoint, "OTEL_SDK_DISABLED": "true"}) == []
    both = {"OTEL_TRACES_EXPORTER": "otlp, console"}
    assert tracing.exporter_names(both) == ["otlp", "console"]


def test_each_process_names_itself() -> None:
    assert tracing.service_name("gateway", {}) == "pdserve-gateway"
    assert tracing.service_name("decode", {"OTEL_SERVICE_NAME": "shop"}) == "shop-decode"


def test_off_costs_nothing_and_carries_nothing() -> None:
    assert not tracing.enabled()
    with tracing.span("x", {"a": 1}) as span:
        span.set_attribute("b", 2)
        assert tracing.inject() == ()
    assert span is tracing.NO_SPAN
    assert tracing.start_span("y") is tracing.NO_SPAN
    assert tracing.step("z") is tracing.NO_SPAN
    assert tracing.extract({"traceparent": PARENT}) is None


def test_a_bad_protocol_leaves_tracing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    assert not tracing.setup("gateway")
    assert not tracing.enabled()


def test_the_client_context_is_honoured_and_passed_on(spans: InMemorySpanExporter) -> None:
    parent = tracing.extract([("TraceParent", PARENT), ("x-other", "1")])
    with tracing.span("root", kind="server", parent=parent), tracing.span("child", kind="client"):
        carried = dict(tracing.inject())
    child, root = spans.get_finished_spans()
    assert f"{root.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert root.parent is not None and f"{root.parent.span_id:016x}" == "b7ad6b7169203331"
    assert child.parent is not None and child.parent.span_id == root.context.span_id
    _, trace_id, span_id, _ = carried["traceparent"].split("-")
    assert trace_id == "0af7651916cd43dd8448eb211c80319c"
    assert int(span_id, 16) == child.context.span_id
    assert root.resource.attributes["service.name"] == "pdserve-gateway"


def test_use_ends_a_span_on_error_and_finish_ends_it_once(
    spans: InMemorySpanExporter,
) -> None:
    failed = tracing.start_span("decode", kind="client")
    with pytest.raises(RuntimeError), tracing.use(failed):
        assert tracing.inject()  # the span is current
        raise RuntimeError("worker gone")
    tracing.finish(failed, {"late": True}, "error")  # already ended: nothing happens
    timed = tracing.start_span("kv.pull", start_time=1_000.0)
    tracing.end_at(timed, 1_002.5)
    first, second = spans.get_finished_spans()
    assert first.name == "decode" and not first.status.is_ok
    assert "late" not in (first.attributes or {})
    assert (second.start_time, second.end_time) == (1_000 * 10**9, 1_002_500_000_000)


def test_a_step_is_a_child_that_is_not_made_current(spans: InMemorySpanExporter) -> None:
    with tracing.span("request", kind="server") as request:
        with tracing.step("route") as route:
            route.set_attribute("pdserve.picker", "load")
            carried = dict(tracing.inject())  # still the request's context, not the step's
        with pytest.raises(ValueError), tracing.step("admission"):
            raise ValueError("bad model")
        with pytest.raises(asyncio.CancelledError), tracing.step("tokenize"):
            raise asyncio.CancelledError  # cancellation is not a failure
    routed, refused, cancelled, root = spans.get_finished_spans()
    assert root.context.span_id == request.get_span_context().span_id
    for step in (routed, refused, cancelled):
        assert step.parent is not None and step.parent.span_id == root.context.span_id
        assert step.kind.name == "INTERNAL"
    assert int(carried["traceparent"].split("-")[2], 16) == root.context.span_id
    assert routed.attributes == {"pdserve.picker": "load"} and routed.status.is_unset
    assert not refused.status.is_ok and refused.status.description == "ValueError: bad model"
    assert [event.name for event in refused.events] == ["exception"]
    assert cancelled.status.is_unset and not cancelled.events


def test_a_span_fails_on_an_error_but_not_on_cancellation(spans: InMemorySpanExporter) -> None:
    with pytest.raises(KeyError), tracing.span("POST /v1/completions", kind="server"):
        assert tracing.current_trace_id()  # current inside the with
        raise KeyError("boom")
    with pytest.raises(asyncio.CancelledError), tracing.span("Generate", kind="server"):
        raise asyncio.CancelledError
    assert tracing.current_trace_id() == ""  # and no longer after it
    failed, cancelled = spans.get_finished_spans()
    assert failed.kind.name == "SERVER" and not failed.status.is_ok
    assert [event.name for event in failed.events] == ["exception"]
    assert cancelled.end_time is not None and cancelled.status.is_unset


def test_the_resource_hashes_as_the_sdks_once(spans: InMemorySpanExporter) -> None:
    from opentelemetry.sdk.resources import Resource

    from pdserve.telemetry.tracing_sdk import resource

    with tracing.span("x"):
        pass
    fixed = spans.get_finished_spans()[0].resource
    plain = Resource(fixed.attributes, fixed.schema_url)
    assert fixed.attributes["service.name"] == "pdserve-gateway"
    assert "telemetry.sdk.version" in fixed.attributes  # Resource.create's own attributes
    assert hash(fixed) == hash(plain) and fixed == plain and {plain: 1}[fixed] == 1
    assert resource({"a": 1}) != resource({"a": 2})


def test_a_streaming_span_closed_in_another_context_ends_quietly(
    spans: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    """A server stream (an async generator) holds its span current across yields; when its
    consumer goes away, asyncio closes it later in a task of its own, another context. The
    span still ends, and nothing is logged as an error ("Failed to detach context")."""

    async def stream() -> Any:
        with tracing.span("Decode", kind="server"):
            for n in range(3):
                yield n

    async def consume_one_and_leave() -> None:
        gen = stream()
        assert await anext(gen) == 0
        # Closed the way asyncio closes an abandoned generator: from a task of its own.
        await asyncio.create_task(gen.aclose(), context=contextvars.Context())

    asyncio.run(consume_one_and_leave())
    (decode,) = spans.get_finished_spans()
    assert decode.name == "Decode" and decode.end_time is not None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
