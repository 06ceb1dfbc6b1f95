"""Fallback, cancellation and pairing rules of the gateway, with real grpc.aio fake workers."""

from __future__ import annotations

import asyncio
import logging

import grpc
import httpx
import pytest

from pdserve.bench.fake_worker import DEFAULT_PIECES, FakeDecode, FakePrefill, start_worker
from tests.helpers import (
    REQUESTS,
    counted,
    dead_address,
    gateway_cluster,
    metrics_text,
    served_name,
)

CHAT = [{"role": "user", "content": "Tell me a story."}]
ANSWER = "".join(text for _, text in DEFAULT_PIECES)


async def _chat(base_url: str, **extra: object) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url) as http:
        return await http.post(
            "/v1/chat/completions", json={"model": served_name(), "messages": CHAT, **extra}
        )


async def test_prefill_worker_down_falls_back_to_local() -> None:
    async with gateway_cluster() as c:
        await c.servers["prefill"].stop(0)  # the pool still believes it is healthy
        first = await _chat(c.base_url)
        second = await _chat(c.base_url)
        metrics = await metrics_text(c.base_url)
        health = c.gateway.pool.prefill[0].healthy
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["message"]["content"] == ANSWER
    assert second.status_code == 200
    assert c.decode is not None
    assert all(not r.HasField("kv_transfer_params") for r in c.decode.seen.requests)
    assert health is False  # marked failed: the second request did not try it again
    labels = {"endpoint": "chat_completions", "outcome": "ok", "path": "local"}
    assert counted(metrics, REQUESTS, **labels) == 2


async def test_prefill_error_falls_back_and_aborts_prefill() -> None:
    prefill = FakePrefill()
    prefill.fail_with = grpc.StatusCode.INTERNAL
    async with gateway_cluster(prefill=prefill) as c:
        response = await _chat(c.base_url)
        await asyncio.wait_for(prefill.seen.aborted.wait(), 5)
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    (prefill_req,) = prefill.seen.requests
    assert prefill.seen.aborts == [prefill_req.request_id]
    assert prefill_req.request_id != response.headers["x-request-id"]


async def test_prefill_failure_policy_fail_answers_503() -> None:
    prefill = FakePrefill()
    prefill.fail_with = grpc.StatusCode.INTERNAL
    async with gateway_cluster(prefill=prefill, prefill_failure_policy="fail") as c:
        response = await _chat(c.base_url)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "worker_failed"
    assert c.decode is not None and not c.decode.seen.requests


async def test_no_prefill_workers_is_the_local_path() -> None:
    async with gateway_cluster(prefill=None) as c:
        response = await _chat(c.base_url)
    assert response.status_code == 200
    assert c.decode is not None
    assert not c.decode.seen.requests[0].HasField("kv_transfer_params")


async def test_incompatible_kv_compat_is_never_paired(caplog: pytest.LogCaptureFixture) -> None:
    prefill = FakePrefill()
    prefill.caps.kv_compat["dtype"] = "float16"
    prefill.caps.kv_compat["attention_isa"] = "amx"
    with caplog.at_level(logging.ERROR, logger="gateway.pool"):
        async with gateway_cluster(prefill=prefill) as c:
            response = await _chat(c.base_url)
    assert response.status_code == 200
    assert not prefill.seen.requests  # routed to the local path instead
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    refusals = [e for e in errors if "refusing to pair" in e]
    assert len(refusals) == 1  # logged once, not at every health refresh
    assert "attention_isa (prefill amx, decode" in refusals[0]
    assert "dtype (prefill float16, decode" in refusals[0]


async def test_round_robin_over_decode_workers_skips_dead_ones() -> None:
    second = FakeDecode()
    server = await start_worker(second)
    try:
        extra = [f"127.0.0.1:{server.port}", dead_address()]
        async with gateway_cluster(extra_decode=extra) as c:
            for _ in range(4):
                assert (await _chat(c.base_url)).status_code == 200
    finally:
        await server.stop(0)
    assert c.decode is not None
    assert len(c.decode.seen.requests) == 2 and len(second.seen.requests) == 2


async def test_client_disconnect_mid_stream_cancels_decode() -> None:
    decode = FakeDecode(delay_s=0.05)
    decode.pieces = [(100 + i, f" w{i}") for i in range(200)]
    async with gateway_cluster(decode=decode) as c:
        async with httpx.AsyncClient(base_url=c.base_url) as http:
            body = {"model": served_name(), "messages": CHAT, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                request_id = response.headers["x-request-id"]
                lines = response.aiter_lines()
                received = [await anext(lines) for _ in range(6)]
        # The client is gone: the decode RPC is cancelled and both workers get Abort.
        await asyncio.wait_for(decode.cancelled.wait(), 5)
        assert c.prefill is not None
        await asyncio.wait_for(c.prefill.seen.aborted.wait(), 5)
        await asyncio.wait_for(decode.seen.aborted.wait(), 5)
        metrics = await metrics_text(c.base_url)
    assert any(line.startswith("data: ") for line in received)
    (internal_id,) = {r.request_id for r in decode.seen.requests}
    assert internal_id != request_id
    assert decode.seen.aborts == [internal_id] and c.prefill.seen.aborts == [internal_id]
    labels = {"endpoint": "chat_completions", "outcome": "cancelled", "path": "disaggregated"}
    assert counted(metrics, REQUESTS, **labels) == 1


async def test_client_disconnect_non_streaming_cancels_decode() -> None:
    decode = FakeDecode(delay_s=0.05)
    decode.pieces = [(100 + i, f" w{i}") for i in range(200)]
    async with gateway_cluster(decode=decode) as c:
        task = asyncio.create_task(_chat(c.base_url))
        await asyncio.wait_for(decode.started.wait(), 5)
        await asyncio.sleep(0.1)
        task.cancel()  # closes the connection
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.wait_for(decode.cancelled.wait(), 5)
        await asyncio.wait_for(decode.seen.aborted.wait(), 5)
    assert len(decode.seen.aborts) == 1


async def test_decode_worker_dying_mid_stream_reports_in_band() -> None:
    decode = FakeDecode(delay_s=0.05)
    decode.pieces = [(100 + i, f" w{i}") for i in range(200)]
    body = {"model": served_name(), "messages": CHAT, "stream": True}
    async with (
        gateway_cluster(decode=decode) as c,
        httpx.AsyncClient(base_url=c.base_url) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.aiter_lines()
        await anext(lines)
        await c.servers["decode"].stop(0)
        rest = [line async for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert '"error"' in rest[-2] and "worker_failed" in rest[-2]


async def test_kv_transfer_failure_falls_back_to_local_on_the_same_decode_worker() -> None:
    decode = FakeDecode()
    decode.fail_kv_transfer = True
    async with gateway_cluster(decode=decode) as c:
        response = await _chat(c.base_url)
        assert c.prefill is not None
        await asyncio.wait_for(c.prefill.seen.aborted.wait(), 5)
        healthy = c.gateway.pool.decode[0].healthy
        metrics = await metrics_text(c.base_url)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == ANSWER
    first, second = decode.seen.requests
    assert first.HasField("kv_transfer_params") and not second.HasField("kv_transfer_params")
    assert list(first.prompt_token_ids) == list(second.prompt_token_ids)
    assert healthy  # the decode worker is fine: it only could not pull
    assert c.prefill.seen.aborts == [first.request_id] != [response.headers["x-request-id"]]
    assert 'pdserve_gateway_local_fallbacks_total{reason="kv_transfer_failed"} 1.0' in metrics
    labels = {"endpoint": "chat_completions", "outcome": "ok", "path": "local"}
    assert counted(metrics, REQUESTS, **labels) == 1


async def test_kv_transfer_failure_with_policy_fail_is_503() -> None:
    decode = FakeDecode()
    decode.fail_kv_transfer = True
    async with gateway_cluster(decode=decode, prefill_failure_policy="fail") as c:
        response = await _chat(c.base_url)
        assert c.prefill is not None
        await asyncio.wait_for(c.prefill.seen.aborted.wait(), 5)
    assert response.status_code == 503
    assert len(decode.seen.requests) == 1


async def test_workers_with_different_connectors_are_never_paired(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A NIXL prefill worker and a decode worker of our connector: refused with the reason,
    in the log and in /health; requests take the local path."""
    prefill = FakePrefill()
    prefill.caps.kv_compat["connector"] = "NixlConnector/14/pull/vllm-0.32.0"
    prefill.caps.kv_compat["kv_cache_layout"] = "LBHNC"
    decode = FakeDecode()
    decode.caps.kv_compat["connector"] = "PdserveConnector/2"
    decode.caps.kv_compat["kv_cache_layout"] = "auto"
    with caplog.at_level(logging.ERROR, logger="gateway.pool"):
        async with gateway_cluster(prefill=prefill, decode=decode) as c:
            response = await _chat(c.base_url)
            async with httpx.AsyncClient(base_url=c.base_url) as http:
                health = (await http.get("/health")).json()
    assert response.status_code == 200
    assert not prefill.seen.requests  # the decode worker computed the prompt
    (pair,) = health["unpaired_workers"]
    assert pair["prefill"] == f"127.0.0.1:{c.servers['prefill'].port}"
    assert pair["decode"] == f"127.0.0.1:{c.servers['decode'].port}"
    assert (
        "connector (prefill NixlConnector/14/pull/vllm-0.32.0, decode PdserveConnector/2)"
        in (pair["reason"])
    )
    assert "same --kv-connector" in pair["reason"]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("refusing to pair" in e and "kv_cache_layout (prefill LBHNC" in e for e in errors)
