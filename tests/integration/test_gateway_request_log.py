"""The gateway's request log (fake workers, a real gateway, its log captured as JSON lines):
exactly one ``pdserve.requests`` line per request, whatever its outcome, with its ids,
workers, tokens and timings; the trace id when tracing is on."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.request_log import FIELDS
from pdserve.telemetry import log as pdlog
from protos.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.helpers import (
    REQUESTS,
    GatedDecode,
    counted,
    gateway_cluster,
    served_name,
    tokenizer,
)

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


class Captured:
    """The gateway's log as JSON lines (the formatter and filter every process uses)."""

    def __init__(self) -> None:
        self.stream = io.StringIO()

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stream.getvalue().splitlines()]

    def requests(self) -> list[dict[str, Any]]:
        return [line for line in self.lines() if line["logger"] == "pdserve.requests"]

    async def wait(self, count: int) -> list[dict[str, Any]]:
        deadline = time.monotonic() + 30
        while len(self.requests()) < count:
            assert time.monotonic() < deadline, self.requests()
            await asyncio.sleep(0.02)
        return self.requests()


@pytest.fixture
def log() -> Iterator[Captured]:
    captured = Captured()
    handler = logging.StreamHandler(captured.stream)
    handler.addFilter(pdlog.ContextFilter())
    handler.setFormatter(pdlog.JsonFormatter("gateway"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield captured
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def only(lines: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
    mine = [line for line in lines if line["request_id"] == request_id]
    assert len(mine) == 1, lines
    assert set(mine[0]) - {"time", "level", "service", "logger", "message"} <= set(FIELDS)
    return mine[0]


async def test_an_ok_request_is_one_line_with_its_workers_tokens_and_phases(
    log: Captured,
) -> None:
    prompt = "Hello there, how are you?"
    body = {"model": served_name(), "prompt": prompt, "max_tokens": 3}
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        reply = await http.post("/v1/completions", json=body, headers={"x-request-id": "edge-1"})
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        metrics = (await http.get("/metrics")).text
    call_s = counted(metrics, "pdserve_gateway_prefill_seconds_sum")
    line = only(log.requests(), "edge-1")
    assert line["level"] == "INFO" and line["message"] == "request done"
    assert line["service"] == "gateway"
    assert len(line["internal_id"]) == 32 and line["internal_id"] != "edge-1"
    assert line["endpoint"] == "completions" and line["outcome"] == "ok"
    assert line["path"] == "disaggregated"
    assert line["split"] == "prefill_worker:static"  # disagg_policy's default
    assert "predicted_ttft_s" not in line  # the static policy predicts nothing
    assert line["prefill_worker"] == "fake-role_prefill"
    assert line["decode_worker"] == "fake-role_decode"
    assert line["prompt_tokens"] == len(tokenizer().encode_text(prompt)) == usage["prompt_tokens"]
    assert line["completion_tokens"] == 3 == usage["completion_tokens"]
    assert line["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert line["retries"] == 0 and line["migrations"] == 0
    assert 0 < line["ttft_s"] <= line["total_s"]
    # The fakes' engine times: queue = decode queue - pull + the prefill engine's queue, or
    # the prefill call's time less its computing when that is longer.
    assert line["transfer_s"] == pytest.approx(0.002)
    assert line["queue_s"] == pytest.approx(0.005 - 0.002 + max(0.001, call_s - 0.02))
    assert line["prefill_s"] == pytest.approx(0.02) and line["decode_s"] == pytest.approx(0.1)
    assert "trace_id" not in line  # tracing is off


async def test_a_cancelled_stream_is_one_line(log: Captured) -> None:
    body = {"model": served_name(), "prompt": "Hi", "max_tokens": 4, "stream": True}
    decode = GatedDecode(free=1)  # one token, then nothing until the client is gone
    async with gateway_cluster(decode=decode) as c, httpx.AsyncClient(base_url=c.base_url) as h:
        headers = {"x-request-id": "edge-gone"}
        async with h.stream("POST", "/v1/completions", json=body, headers=headers) as reply:
            assert reply.status_code == 200
            async for chunk in reply.aiter_text():
                if '"text"' in chunk:
                    break  # the first token arrived: hang up
        await asyncio.wait_for(decode.cancelled.wait(), 30)
        await log.wait(1)
    line = only(log.requests(), "edge-gone")
    assert line["outcome"] == "cancelled" and line["endpoint"] == "completions"
    assert 1 <= line["completion_tokens"] < 4
    assert line["ttft_s"] <= line["total_s"]
    assert "cached_tokens" not in line and "decode_s" not in line  # not reported


async def test_invalid_requests_are_one_line_each(log: Captured) -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        cases = {
            "no-model": {"model": "nope", "prompt": "Hi"},  # refused by the core
            "bad-body": {"model": served_name(), "prompt": "Hi", "max_tokens": "many"},
            "no-suffix": {"model": served_name(), "prompt": "Hi", "suffix": "x"},  # by the route
        }
        for request_id, body in cases.items():
            reply = await http.post(
                "/v1/completions", json=body, headers={"x-request-id": request_id}
            )
            assert reply.status_code in (400, 404), reply.text
        chat = {"model": served_name(), "messages": []}
        reply = await http.post("/v1/chat/completions", json=chat, headers={"x-request-id": "e"})
        assert reply.status_code == 400
        metrics = (await http.get("/metrics")).text
    lines = log.requests()
    assert len(lines) == 4, lines
    # Each is counted once, as its line says, whichever layer refused it (an unknown model
    # under the first model, whose service answered the 404).
    model, invalid = served_name(), {"outcome": "invalid", "path": "none"}
    assert counted(metrics, REQUESTS, model=model, endpoint="completions", **invalid) == 3
    assert counted(metrics, REQUESTS, model=model, endpoint="chat_completions", **invalid) == 1
    assert counted(metrics, REQUESTS) == 4
    for request_id in [*cases, "e"]:
        line = only(lines, request_id)
        assert line["outcome"] == "invalid" and line["path"] == "none"
        assert "internal_id" not in line and "decode_worker" not in line
    assert only(lines, "e")["endpoint"] == "chat_completions"
    assert only(lines, "no-model")["total_s"] >= 0


async def test_grpc_requests_and_every_choice_are_lines(log: Captured) -> None:
    request = generate_pb2.GenerateRequest(
        text="Hello", params=common_pb2.SamplingParams(max_tokens=2)
    )
    async with gateway_cluster() as c, grpc.aio.insecure_channel(c.grpc_target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        replies = [r async for r in stub.Generate(request, metadata=(("x-request-id", "g1"),))]
        assert replies[-1].finish_reason
        with pytest.raises(grpc.aio.AioRpcError):
            bad = generate_pb2.GenerateRequest(params=common_pb2.SamplingParams(max_tokens=2))
            await stub.Generate(bad, metadata=(("x-request-id", "g2"),)).read()
        async with httpx.AsyncClient(base_url=c.base_url) as http:
            body = {"model": served_name(), "prompt": "Hi", "max_tokens": 2, "n": 2}
            reply = await http.post("/v1/completions", json=body, headers={"x-request-id": "n"})
            assert reply.status_code == 200, reply.text
            metrics = (await http.get("/metrics")).text
    assert counted(metrics, REQUESTS, endpoint="grpc_generate", outcome="invalid") == 1
    assert counted(metrics, REQUESTS, endpoint="grpc_generate", outcome="ok") == 1
    lines = log.requests()
    assert len(lines) == 4, lines
    ok = only(lines, "g1")
    assert ok["endpoint"] == "grpc_generate" and ok["outcome"] == "ok"
    assert ok["completion_tokens"] == 2
    assert only(lines, "g2")["outcome"] == "invalid"  # no input: refused by the adapter
    choices = [only(lines, f"n-{i}") for i in range(2)]
    assert {x["outcome"] for x in choices} == {"ok"}
    assert choices[0]["internal_id"] != choices[1]["internal_id"]


async def test_the_trace_id_is_on_the_line_while_tracing_is_on(
    log: Captured, spans: InMemorySpanExporter
) -> None:
    headers = {"traceparent": f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01", "x-request-id": "t1"}
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        body = {"model": served_name(), "prompt": "Hello", "max_tokens": 2}
        reply = await http.post("/v1/completions", json=body, headers=headers)
        assert reply.status_code == 200, reply.text
        body["model"] = "nope"
        reply = await http.post("/v1/completions", json=body, headers={"x-request-id": "t2"})
        assert reply.status_code == 404
    lines = log.requests()
    assert only(lines, "t1")["trace_id"] == CLIENT_TRACE
    other = only(lines, "t2")["trace_id"]  # a trace of its own
    assert len(other) == 32 and other != CLIENT_TRACE
    traced = {f"{s.context.trace_id:032x}" for s in spans.get_finished_spans()}
    assert other in traced
