"""The hop table: each hop of a disaggregated request from its spans; other traces left out;
and the receiver's dump that it reads."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from pdserve.telemetry.trace_hops import hops, main

MS = 1_000_000
# (service, name, parent, start ms, end ms) of one request on the disaggregated path
REQUEST = (
    ("pdserve-gateway", "POST /v1/completions", "", 0, 700),
    ("pdserve-gateway", "prefill", "POST /v1/completions", 10, 450),
    ("pdserve-prefill", "pdserve.v1.PrefillWorker/Prefill", "prefill", 12, 448),
    ("pdserve-prefill", "engine.queue", "pdserve.v1.PrefillWorker/Prefill", 20, 40),
    ("pdserve-prefill", "engine.prefill", "pdserve.v1.PrefillWorker/Prefill", 40, 440),
    ("pdserve-gateway", "decode", "POST /v1/completions", 451, 700),
    ("pdserve-decode", "pdserve.v1.DecodeWorker/Decode", "decode", 452, 699),
    ("pdserve-decode", "engine.queue", "pdserve.v1.DecodeWorker/Decode", 480, 540),
    ("pdserve-decode", "kv.pull", "pdserve.v1.DecodeWorker/Decode", 485, 495),
    ("pdserve-decode", "engine.prefill", "pdserve.v1.DecodeWorker/Decode", 540, 590),
)  # fmt: skip


def trace(trace_id: str, rows: tuple[tuple[str, str, str, int, int], ...]) -> list[dict[str, Any]]:
    return [{"trace_id": trace_id, "service": service, "name": name, "span_id": name,
             "parent_span_id": parent or "client", "start_ns": start * MS, "end_ns": end * MS,
             "attributes": {}} for service, name, parent, start, end in rows]  # fmt: skip


def test_each_hop_runs_between_its_spans_and_other_traces_are_left_out() -> None:
    local = trace("b", tuple(r for r in REQUEST if r[0] == "pdserve-gateway"))
    values, left_out = hops(trace("a", REQUEST) + local)
    assert left_out == 1
    assert values == {
        "gateway: request to Prefill call": [10.0],
        "Prefill call reaches the engine": [8.0],
        "prefill engine: queue": [20.0],
        "prefill engine: prompt": [400.0],
        "prompt done to Decode call": [12.0],
        "Decode call reaches the engine": [28.0],
        "decode engine: to the pull": [5.0],
        "KV pull": [10.0],
        "pull done to scheduled": [45.0],
        "decode engine: first step": [50.0],
        "request to its first step": [590.0],
    }


def test_the_table_is_printed_and_bad_input_is_an_error(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "spans.json").write_text(json.dumps(trace("a", REQUEST)))
    assert main([str(tmp_path / "spans.json")]) == 0
    out = capsys.readouterr().out
    assert "1 disaggregated requests" in out and "KV pull" in out and "10.0" in out
    (tmp_path / "none.json").write_text("[]")
    assert main([str(tmp_path / "none.json")]) == 1
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "object.json").write_text(json.dumps({"spans": trace("a", REQUEST)}))
    assert main([str(tmp_path / "object.json")]) == 2
    (tmp_path / "keyless.json").write_text(json.dumps([{"name": "kv.pull"}]))
    assert main([str(tmp_path / "keyless.json")]) == 2
    assert "is not a list of spans" in capsys.readouterr().err


def test_the_receiver_dumps_every_span_it_received(tmp_path: Path) -> None:
    dump = tmp_path / "spans.json"
    argv = [sys.executable, "-m", "pdserve.telemetry.otlp_receiver", "--dump", str(dump)]
    receiver = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None
        port = json.loads(receiver.stdout.readline())["port"]
        body = trace_service_pb2.ExportTraceServiceRequest()
        resource = body.resource_spans.add()
        name = resource.resource.attributes.add()
        name.key, name.value.string_value = "service.name", "pdserve-decode"
        span = resource.scope_spans.add().spans.add()
        span.name, span.trace_id, span.span_id = "kv.pull", b"\x01" * 16, b"\x02" * 8
        span.start_time_unix_nano, span.end_time_unix_nano = 5 * MS, 15 * MS
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/traces",
            data=body.SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 200
        receiver.send_signal(signal.SIGINT)
        assert receiver.wait(timeout=60) == 0
    finally:
        if receiver.poll() is None:
            receiver.kill()
    (span_json,) = json.loads(dump.read_text())
    assert (span_json["service"], span_json["name"]) == ("pdserve-decode", "kv.pull")
    assert span_json["end_ns"] - span_json["start_ns"] == 10 * MS
