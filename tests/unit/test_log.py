"""pdserve.telemetry.log: the JSON and text formats, the request/trace id filter, the format
switch."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.telemetry import log as pdlog
from pdserve.telemetry import tracing


def record(message: str = "hello %s", *args: object, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("gateway.pool", logging.WARNING, __file__, 1, message, args, None)
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def as_json(rec: logging.LogRecord, service: str = "gateway") -> dict[str, object]:
    pdlog.ContextFilter().filter(rec)
    line = pdlog.JsonFormatter(service).format(rec)
    assert "\n" not in line
    parsed: dict[str, object] = json.loads(line)
    return parsed


def test_a_json_line_has_the_base_keys_and_the_records_fields() -> None:
    fields = {"outcome": "ok", "total_s": 0.25, "note": "a b", "missing": None, "level": "x"}
    line = as_json(record("hello %s", "there", fields=fields), service="prefill-1")
    assert list(line)[:5] == ["time", "level", "service", "logger", "message"]
    assert line["level"] == "WARNING"  # a field never replaces a base key
    assert line["service"] == "prefill-1"
    assert line["logger"] == "gateway.pool"
    assert line["message"] == "hello there"
    assert line["outcome"] == "ok" and line["total_s"] == 0.25 and line["note"] == "a b"
    assert "missing" not in line
    assert "request_id" not in line and "trace_id" not in line  # not known here
    time = str(line["time"])
    assert time.endswith("Z")
    parsed = datetime.fromisoformat(time.replace("Z", "+00:00"))
    assert parsed.utcoffset() == timedelta(0)


def test_a_json_line_carries_the_exception() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        rec = record("failed")
        rec.exc_info = sys.exc_info()
    line = as_json(rec)
    assert "ValueError: boom" in str(line["exception"])


def test_the_request_id_comes_from_the_context_while_a_request_is_served() -> None:
    assert "request_id" not in as_json(record())
    with pdlog.request_context("edge-7"):
        assert pdlog.current_request_id() == "edge-7"
        assert as_json(record())["request_id"] == "edge-7"
        # A record naming its own request (one choice of several) keeps it.
        assert as_json(record(request_id="edge-7-1"))["request_id"] == "edge-7-1"
    assert pdlog.current_request_id() == ""
    assert "request_id" not in as_json(record())


def test_the_trace_id_comes_from_the_current_span_while_tracing_is_on() -> None:
    assert tracing.current_trace_id() == ""
    assert tracing.setup("gateway", exporters=[InMemorySpanExporter()])
    try:
        assert "trace_id" not in as_json(record())  # no span current
        with tracing.span("work") as span:
            expected = tracing.trace_id(span)
            assert len(expected) == 32 and expected != "0" * 32
            assert as_json(record())["trace_id"] == expected
        assert "trace_id" not in as_json(record())
    finally:
        tracing.shutdown()


def test_a_text_line_appends_the_fields_as_key_values() -> None:
    fields = {"outcome": "ok", "note": "a b", "quote": 'x"y', "empty": "", "flag": True, "n": 3}
    rec = record("request done", fields=fields)
    line = pdlog.TextFormatter("gateway").format(rec)
    assert line.endswith(
        'WARNING gateway gateway.pool: request done outcome=ok note="a b" quote="x\\"y" '
        'empty="" flag=true n=3'
    )
    assert pdlog.TextFormatter("gateway").format(record("plain")).endswith("gateway.pool: plain")


@pytest.fixture
def root_logging() -> Iterator[None]:
    """setup() replaces the root logger's handlers: put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


def _capture_root() -> io.StringIO:
    stream = io.StringIO()
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)
    return stream


@pytest.mark.usefixtures("root_logging")
def test_setup_switches_to_json_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_LOG_FORMAT", "json")
    monkeypatch.setenv("PDSERVE_LOG_LEVEL", "debug")
    pdlog.setup("decode-3")
    stream = _capture_root()
    with pdlog.request_context("r1"):
        logging.getLogger("x").debug("one %d", 1)
    line = json.loads(stream.getvalue())
    assert line["service"] == "decode-3" and line["message"] == "one 1"
    assert line["level"] == "DEBUG" and line["request_id"] == "r1"


@pytest.mark.usefixtures("root_logging")
def test_setup_defaults_to_text_and_a_given_level_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_LOG_FORMAT", raising=False)
    monkeypatch.setenv("PDSERVE_LOG_LEVEL", "DEBUG")
    pdlog.setup("gateway", "warning")
    stream = _capture_root()
    logging.getLogger("x").info("hidden")
    logging.getLogger("x").warning("shown")
    assert stream.getvalue().rstrip("\n").endswith("WARNING gateway x: shown")
    assert "hidden" not in stream.getvalue()


@pytest.mark.usefixtures("root_logging")
def test_an_unknown_format_is_reported_and_text_is_used(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PDSERVE_LOG_FORMAT", "xml")
    pdlog.setup("gateway")  # its handler writes to the (captured) stderr
    logging.getLogger("x").warning("still logging")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("PDSERVE_LOG_FORMAT='xml' is not text or json; logging as text")
    assert lines[1].endswith("WARNING gateway x: still logging")
