"""Tracing on the real stack: every process of the session cluster exports OTLP/HTTP to the
receiver in this test process (``conftest.traces``).

One request is one trace whose spans come from the gateway, the prefill worker and the
decode worker, each parented to the span that caused it, the client's ``traceparent``
honoured; the KV pull's span carries the bytes /metrics counted.

``PDSERVE_TRACE_DUMP=FILE`` writes the HTTP request's spans as JSON (the waterfall of
docs/observability.md is drawn from such a file by ``scripts/trace_waterfall.py``).
"""

from __future__ import annotations

import json
import os
import secrets
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

from pdserve.telemetry.otlp_receiver import Receiver, Span
from protos.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.conftest import RealCluster
from tests.helpers import served_name

DEADLINE_S = 120  # spans leave each process every 0.2 s; machines differ 10x in speed
GATEWAY, PREFILL, DECODE = "pdserve-gateway", "pdserve-prefill", "pdserve-decode"
PREFILL_RPC = "pdserve.v1.PrefillWorker/Prefill"
DECODE_RPC = "pdserve.v1.DecodeWorker/Decode"


def kv_bytes_counted(cluster: RealCluster) -> float:
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith("pdserve_gateway_kv_transfer_bytes_total "):
            return float(line.split()[-1])
    raise AssertionError("no pdserve_gateway_kv_transfer_bytes_total in /metrics")


def complete(cluster: RealCluster, prompt: str, headers: dict[str, str]) -> dict[str, Any]:
    body = {"model": served_name(), "prompt": prompt, "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(
        cluster.base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return dict(json.loads(response.read()))


def wait_for_trace(traces: Receiver, trace_id: str, needed: set[tuple[str, str]]) -> list[Span]:
    """The trace's spans once every (service, span name) in ``needed`` has arrived."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        spans = traces.trace(trace_id)
        have = {(s.service, s.name) for s in spans}
        if needed <= have:
            time.sleep(1)  # stragglers of the same batch
            return traces.trace(trace_id)
        assert time.monotonic() < deadline, f"missing {sorted(needed - have)}; have {have}"
        time.sleep(0.2)


def one(spans: list[Span], service: str, name: str) -> Span:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, f"{service} {name}: {len(found)} spans"
    return found[0]


def children(spans: list[Span], parent: Span) -> dict[str, Span]:
    return {s.name: s for s in spans if s.parent_span_id == parent.span_id}


NEEDED = {
    (GATEWAY, "POST /v1/completions"),
    (GATEWAY, "prefill"),
    (GATEWAY, "decode"),
    (PREFILL, PREFILL_RPC),
    (DECODE, DECODE_RPC),
    (DECODE, "kv.pull"),
}


def test_one_trace_per_request_across_gateway_and_both_workers(
    cluster: RealCluster, traces: Receiver
) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    # Unique, and several KV blocks long: the decode worker pulls blocks it cannot have.
    prompt = f"Trace {trace_id}. " + " ".join(f"Item {i} is {i * 7}." for i in range(60))
    before = kv_bytes_counted(cluster)
    reply = complete(cluster, prompt, {"traceparent": f"00-{trace_id}-{client_span}-01"})
    counted = kv_bytes_counted(cluster) - before
    assert reply["choices"][0]["text"]
    spans = wait_for_trace(traces, trace_id, NEEDED)
    if os.environ.get("PDSERVE_TRACE_DUMP"):
        Path(os.environ["PDSERVE_TRACE_DUMP"]).write_text(
            json.dumps([s.as_json() for s in spans], indent=1)
        )

    # The client's span is the parent of the gateway's root; every other span's parent is
    # in the trace: one tree.
    root = one(spans, GATEWAY, "POST /v1/completions")
    assert root.parent_span_id == client_span
    ids = {s.span_id for s in spans}
    assert all(s.parent_span_id in ids for s in spans if s is not root)
    assert {s.service for s in spans} == {GATEWAY, PREFILL, DECODE}

    # The gateway's steps are children of its root.
    steps = children(spans, root)
    assert {"admission", "tokenize", "route", "prefill", "decode"} <= set(steps)
    route = steps["route"].attributes
    assert route["pdserve.route.path"] == "disaggregated"
    assert "first_token" in steps["decode"].events

    # Each worker's RPC span is the child of the gateway span that called it, and names the
    # worker the router chose.
    prefill_rpc = one(spans, PREFILL, PREFILL_RPC)
    decode_rpc = one(spans, DECODE, DECODE_RPC)
    assert prefill_rpc.parent_span_id == steps["prefill"].span_id
    assert decode_rpc.parent_span_id == steps["decode"].span_id
    assert prefill_rpc.resource["service.instance.id"] == route["pdserve.route.prefill_worker"]
    assert decode_rpc.resource["service.instance.id"] == route["pdserve.route.decode_worker"]

    # Engine phases under the workers' spans, and the KV pull under the decode request's.
    assert {"engine.queue", "engine.prefill"} <= set(children(spans, prefill_rpc))
    decode_children = children(spans, decode_rpc)
    assert {"kv.pull", "engine.prefill", "engine.decode"} <= set(decode_children)
    pull = decode_children["kv.pull"]
    assert pull.attributes["pdserve.kv.blocks"] > 0
    assert pull.attributes["pdserve.kv.bytes"] == counted > 0
    assert steps["decode"].attributes["pdserve.kv.bytes"] == counted
    assert decode_rpc.start_ns <= pull.start_ns <= pull.end_ns <= decode_rpc.end_ns
    assert not any(s.error for s in spans)


def test_a_grpc_request_without_context_is_a_trace_of_its_own(
    cluster: RealCluster, traces: Receiver
) -> None:
    marker = secrets.token_hex(8)
    request = generate_pb2.GenerateRequest(
        text=f"Say {marker} " + "and more " * 30, params=common_pb2.SamplingParams(max_tokens=4)
    )
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300)
        replies = list(call)
        request_id = dict(call.initial_metadata())["x-request-id"]
    assert replies[-1].finish_reason
    deadline = time.monotonic() + DEADLINE_S
    while not (roots := [s for s in traces.spans
                         if s.attributes.get("pdserve.request_id") == request_id
                         and s.service == GATEWAY]):  # fmt: skip
        assert time.monotonic() < deadline, "the gRPC request's root span never arrived"
        time.sleep(0.2)
    (root,) = roots
    assert root.name == "pdserve.v1.Generation/Generate" and root.parent_span_id == ""
    spans = wait_for_trace(
        traces,
        root.trace_id,
        {(PREFILL, PREFILL_RPC), (DECODE, DECODE_RPC), (GATEWAY, "route")},
    )
    assert {s.service for s in spans} == {GATEWAY, PREFILL, DECODE}
