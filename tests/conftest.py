"""Fixtures shared by every test tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from grpc._cython import cygrpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.telemetry import tracing

# grpc.aio starts its poller thread with the first aio object of a process and joins it when the
# last one is garbage collected. That join, run inside a garbage collection, can wait forever for
# a poller asleep in epoll: the suite once hung in an unrelated test's fixture (main thread in
# gc_collect_main -> cygrpc shutdown_grpc_aio -> Thread.join, the poller in epoll_wait). Held
# once for the whole test process, grpc.aio stays up until the process exits, as it does in the
# gateway and the workers, which keep their channels and servers for their whole life.
cygrpc.init_grpc_aio()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process (as the gateway), its spans kept in memory."""
    exporter = InMemorySpanExporter()
    assert tracing.setup("gateway", exporters=[exporter])
    try:
        yield exporter
    finally:
        tracing.shutdown()
