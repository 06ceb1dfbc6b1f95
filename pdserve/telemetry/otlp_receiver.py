"""A minimal OTLP/HTTP trace receiver: decodes ``ExportTraceServiceRequest`` protobufs
(opentelemetry-proto) posted to ``/v1/traces``.

Two users, one receiver: the e2e tier starts one in its own process (``start()``) and reads
every span back, flattened; ``pdserve bench gateway --tracing`` runs one as a separate process
(``python -m pdserve.telemetry.otlp_receiver``, as a collector would be), which only counts spans
per service and answers ``GET /stats`` with the counts as JSON (``--dump FILE``: and writes every
span to FILE when stopped).

Only what those need: no auth, no JSON encoding, gzip accepted (the exporters' option).
"""

from __future__ import annotations

import gzip
import json
import signal
import sys
import threading
from collections import Counter
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


def _span(service: str, resource: dict[str, Any], s: Any) -> Span:
    return Span(
        service=service,
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


@dataclass
class Receiver:
    """``keep``: keep every span (``spans``); False: only count them (``counts``)."""

    server: ThreadingHTTPServer
    keep: bool = True
    spans: list[Span] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)  # service.name -> spans
    exports: int = 0  # export requests received
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def add(self, body: bytes) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        found: list[Span] = []
        counts: Counter[str] = Counter()
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                counts[service] += len(scope_spans.spans)
                if self.keep:
                    found += [_span(service, resource, s) for s in scope_spans.spans]
        with self.lock:
            self.spans.extend(found)
            self.counts.update(counts)
            self.exports += 1

    def stats(self) -> dict[str, Any]:
        """``{"spans": total, "exports": requests, "services": {service.name: spans}}``."""
        with self.lock:
            services = dict(self.counts)
            return {"spans": sum(services.values()), "exports": self.exports,
                    "services": services}  # fmt: skip

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start(keep: bool = True) -> Receiver:
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
            self._reply(trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                        "application/x-protobuf")  # fmt: skip

        def do_GET(self) -> None:
            if self.path != "/stats":
                self.send_error(404)
                return
            self._reply(json.dumps(receiver.stats()).encode(), "application/json")

        def _reply(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    receiver = Receiver(ThreadingHTTPServer(("127.0.0.1", 0), Handler), keep=keep)
    threading.Thread(target=receiver.server.serve_forever, daemon=True).start()
    return receiver


# What every span of a dump has (``Span.as_json`` writes these and more).
DUMP_KEYS = ("service", "name", "span_id", "start_ns", "end_ns")


def load_dump(path: str) -> list[dict[str, Any]] | None:
    """The spans of a ``--dump`` file as JSON objects; None, said on stderr, when it cannot
    be read or is not a list of spans."""
    try:
        with open(path) as f:
            spans = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"cannot read {path}: {exc}", file=sys.stderr)
        return None
    if not isinstance(spans, list) or not all(
        isinstance(span, dict) and all(key in span for key in DUMP_KEYS) for span in spans
    ):
        print(f"{path} is not a list of spans (each with {', '.join(DUMP_KEYS)})",
              file=sys.stderr)  # fmt: skip
        return None
    return spans


def main(argv: list[str] | None = None) -> int:
    """Count spans on a free loopback port until SIGTERM/SIGINT; print ``{"port": PORT}`` as
    one JSON line once listening. ``--dump FILE``: keep every span and write them to FILE as
    a JSON list at the end (what ``pdserve.telemetry.trace_hops`` and
    ``pdserve.telemetry.trace_waterfall`` read)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pdserve.telemetry.otlp_receiver")
    parser.add_argument("--dump", default="", help="write every span received to this file")
    args = parser.parse_args(argv)
    receiver = start(keep=bool(args.dump))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(json.dumps({"port": receiver.server.server_address[1]}), flush=True)
    stop.wait()
    receiver.close()
    if args.dump:
        with receiver.lock, open(args.dump, "w") as f:
            json.dump([span.as_json() for span in receiver.spans], f)
        print(f"{len(receiver.spans)} spans written to {args.dump}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
