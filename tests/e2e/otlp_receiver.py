"""A minimal OTLP/HTTP trace receiver for the e2e tier: decodes ``ExportTraceServiceRequest``
protobufs (opentelemetry-proto) posted to ``/v1/traces`` and keeps every span, flattened.

Only what a test needs: no auth, no JSON encoding, gzip accepted (the exporters' option).
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "bool_value", "int_value",
                                            "double_value") else str(value)  # fmt: skip


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


@dataclass(frozen=True)
class Span:
    service: str
    resource: dict[str, Any]
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[str]
    error: bool

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Receiver:
    server: ThreadingHTTPServer
    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def add(self, body: bytes) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        found = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    found.append(
                        Span(
                            service=str(resource.get("service.name", "")),
                            resource=resource,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            name=s.name,
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes=_attributes(s.attributes),
                            events=[e.name for e in s.events],
                            error=s.status.code == s.status.STATUS_CODE_ERROR,
                        )
                    )
        with self.lock:
            self.spans.extend(found)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start() -> Receiver:
    """A receiver on a free loopback port, serving from a background thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            receiver.add(body)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    receiver = Receiver(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
    threading.Thread(target=receiver.server.serve_forever, daemon=True).start()
    return receiver
