"""Tracing in the gateway (SDK in-memory exporter, fake workers): one trace per request, the
client's ``traceparent`` honoured, the gateway's spans parented, and each worker call
carrying the context of the gateway span that made it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import httpx
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protos.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.helpers import gateway_cluster, served_name

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


async def wait_for(exporter: InMemorySpanExporter, root: str) -> list[ReadableSpan]:
    """The finished spans once the one named ``root`` has ended (it ends last)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finished = list(exporter.get_finished_spans())
        if any(s.name == root for s in finished):
            return finished
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {root} span; got {[s.name for s in finished]}")


def by_name(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def parent_span_id(traceparent: str) -> int:
    return int(traceparent.split("-")[2], 16)


async def test_an_http_request_is_one_trace_in_the_clients_trace(
    spans: InMemorySpanExporter,
) -> None:
    body = {"model": served_name(), "prompt": "Hello there", "max_tokens": 4}
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        reply = await http.post("/v1/completions", json=body, headers=headers)
        assert reply.status_code == 200, reply.text
        await http.get("/health")  # probes are not traced
        got = by_name(await wait_for(spans, "POST /v1/completions"))
        assert c.prefill is not None and c.decode is not None
        prefill_md, decode_md = c.prefill.seen.metadata[0], c.decode.seen.metadata[0]
        metrics = (await http.get("/metrics")).text
    assert set(got) == {"POST /v1/completions", "admission", "tokenize", "route", "prefill",
                        "decode"}  # fmt: skip
    root = got["POST /v1/completions"]
    assert {f"{s.context.trace_id:032x}" for s in got.values()} == {CLIENT_TRACE}
    assert root.parent is not None and root.parent.span_id == int(CLIENT_SPAN, 16)
    for name in ("admission", "tokenize", "route", "prefill", "decode"):
        assert got[name].parent is not None and got[name].parent.span_id == root.context.span_id
    attributes: dict[str, Any] = dict(root.attributes or {})
    assert attributes["http.response.status_code"] == 200
    assert attributes["pdserve.request_id"] == reply.headers["x-request-id"]
    route = dict(got["route"].attributes or {})
    assert route["pdserve.route.path"] == "disaggregated"
    assert route["pdserve.route.decode_worker"] == "fake-role_decode"
    assert route["pdserve.route.prefill_worker"] == "fake-role_prefill"
    decode = got["decode"]
    assert [e.name for e in decode.events] == ["first_token"]
    kv_bytes = dict(decode.attributes or {})["pdserve.kv.bytes"]
    assert kv_bytes > 0 and f"pdserve_gateway_kv_transfer_bytes_total {float(kv_bytes)}" in metrics
    # Each worker call carries the context of the gateway span that made it.
    assert parent_span_id(prefill_md["traceparent"]) == got["prefill"].context.span_id
    assert parent_span_id(decode_md["traceparent"]) == got["decode"].context.span_id
    assert CLIENT_TRACE in prefill_md["traceparent"] and CLIENT_TRACE in decode_md["traceparent"]


async def test_a_grpc_request_without_context_starts_its_own_trace(
    spans: InMemorySpanExporter,
) -> None:
    request = generate_pb2.GenerateRequest(
        text="Hello", params=common_pb2.SamplingParams(max_tokens=3)
    )
    name = "pdserve.v1.Generation/Generate"
    async with gateway_cluster() as c, grpc.aio.insecure_channel(c.grpc_target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for _ in range(2):
            replies = [r async for r in stub.Generate(request)]
            assert replies[-1].finish_reason
        await wait_for(spans, name)
        deadline = time.monotonic() + 30
        while sum(s.name == name for s in spans.get_finished_spans()) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    roots = [s for s in spans.get_finished_spans() if s.name == name]
    assert all(r.parent is None for r in roots)
    traces = {r.context.trace_id for r in roots}
    assert len(traces) == 2  # one trace per request
    for trace_id in traces:
        names = {s.name for s in spans.get_finished_spans() if s.context.trace_id == trace_id}
        assert {"prefill", "decode", "route"} <= names


async def test_tracing_off_sends_no_context() -> None:
    body = {"model": served_name(), "prompt": "Hello there", "max_tokens": 2}
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        reply = await http.post("/v1/completions", json=body)
        assert reply.status_code == 200
        assert c.decode is not None
        assert "traceparent" not in c.decode.seen.metadata[0]
