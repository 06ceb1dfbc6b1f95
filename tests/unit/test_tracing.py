"""pdserve.tracing: configuration from the OTEL_* environment, the no-op path, and W3C
context in and out (SDK in-memory exporter)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve import tracing

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
