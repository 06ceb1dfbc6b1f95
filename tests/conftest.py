"""Fixtures shared by every test tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.telemetry import tracing


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process (as the gateway), its spans kept in memory."""
    exporter = InMemorySpanExporter()
    assert tracing.setup("gateway", exporters=[exporter])
    try:
        yield exporter
    finally:
        tracing.shutdown()
