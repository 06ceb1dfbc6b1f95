"""Retries, migration, timeouts and the circuit breaker (gateway.recovery), with real grpc.aio
fake workers. The round-robin picker sends a cluster's first request to its first workers
(the ones passed as ``prefill``/``decode``); the second ones come from ``extra_*``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import httpx

from pdserve.bench.fake_worker import DEFAULT_PIECES, FakeDecode, FakePrefill, start_worker
from pdserve.rpc.server import GrpcServer
from tests.helpers import REQUESTS, Cluster, counted, gateway_cluster, metrics_text, served_name

PROMPT = [11, 12, 13, 14, 15]
MAX_TOKENS = 9


def expected(prompt_len: int = len(PROMPT), n: int = MAX_TOKENS) -> list[tuple[int, str]]:
    """What an uninterrupted positional fake generates: (token id, text) pairs."""
    return [DEFAULT_PIECES[(prompt_len + i) % len(DEFAULT_PIECES)] for i in range(n)]


def ids(pieces: list[tuple[int, str]]) -> list[int]:
    return [token for token, _ in pieces]


def text(pieces: list[tuple[int, str]]) -> str:
    return "".join(t for _, t in pieces)


@asynccontextmanager
async def two_of_each(
    first_decode: FakeDecode, first_prefill: FakePrefill | None = None, **overrides: Any
) -> AsyncIterator[tuple[Cluster, FakePrefill, FakeDecode]]:
    """A gateway with two prefill and two decode fakes (the second ones healthy)."""
    second_prefill, second_decode = FakePrefill(), FakeDecode(positional=True)
    servers: list[GrpcServer] = [
        await start_worker(second_prefill),
        await start_worker(second_decode),
    ]
    try:
        async with gateway_cluster(
            prefill=first_prefill or True,
            decode=first_decode,
            extra_prefill=[f"127.0.0.1:{servers[0].port}"],
            extra_decode=[f"127.0.0.1:{servers[1].port}"],
            retry_backoff_s=0.01,
            **overrides,
        ) as c:
            yield c, second_prefill, second_decode
    finally:
        for server in servers:
            await server.stop(0)


async def stream_text(c: Cluster) -> tuple[str, str, dict[str, Any]]:
    """Stream one completion of PROMPT; (text, finish reason, usage)."""
    out = ""
    finish, usage = "", {}
    body = {"model": served_name(), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with (
        httpx.AsyncClient(base_url=c.base_url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                out += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
    return out, finish, usage


async def test_decode_worker_dying_mid_stream_migrates_without_gap_or_repeat() -> None:
    dying = FakeDecode(positional=True, fail_after=4)
    async with two_of_each(dying) as (c, _, healthy):
        out, finish, usage = await stream_text(c)
        metrics = await metrics_text(c.base_url)
        ejected = not c.gateway.pool.decode[0].healthy
    assert out == text(expected()), "the client's stream has a gap or a repeat"
    assert finish == "length"
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["prompt_tokens"] == len(PROMPT)
    (moved,) = healthy.seen.requests
    first = dying.seen.requests[0]
    # The continuation: the prompt plus the 4 tokens the client has, for the 5 still due.
    assert list(moved.prompt_token_ids) == PROMPT + ids(expected()[:4])
    assert moved.params.max_tokens == MAX_TOKENS - 4
    assert moved.HasField("kv_transfer_params"), "migration goes through a prefill worker"
    assert moved.request_id != first.request_id
    assert counted(metrics, 'pdserve_gateway_retries_total{kind="migration"}') == 1
    assert ejected


async def test_hung_decode_stream_migrates_after_the_inter_token_timeout() -> None:
    hung = FakeDecode(positional=True, hang_after=2)
    async with two_of_each(hung, inter_token_timeout_s=0.5) as (c, _, healthy):
        out, finish, _ = await stream_text(c)
        await asyncio.wait_for(hung.seen.aborted.wait(), 10)
    assert out == text(expected())
    assert finish == "length"
    assert hung.seen.aborts == [hung.seen.requests[0].request_id]
    assert list(healthy.seen.requests[0].prompt_token_ids) == PROMPT + ids(expected()[:2])


async def test_hung_stream_without_another_worker_is_a_504() -> None:
    hung = FakeDecode(positional=True, hang_after=2)
    async with gateway_cluster(decode=hung, inter_token_timeout_s=0.5) as c:
        async with httpx.AsyncClient(base_url=c.base_url, timeout=60) as http:
            response = await http.post(
                "/v1/completions",
                json={"model": served_name(), "prompt": PROMPT, "max_tokens": MAX_TOKENS},
            )
        metrics = await metrics_text(c.base_url)
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "worker_timeout"
    assert counted(metrics, "pdserve_gateway_requests_total") == 1
    timeout = {"endpoint": "completions", "outcome": "timeout", "path": "disaggregated"}
    assert counted(metrics, REQUESTS, **timeout) == 1


async def test_decode_failure_before_first_token_retries_with_the_same_handoff() -> None:
    failing = FakeDecode(positional=True, fail_after=0)
    async with two_of_each(failing) as (c, _, healthy):
        out, finish, _ = await stream_text(c)
        metrics = await metrics_text(c.base_url)
    assert out == text(expected()) and finish == "length"
    (tried,), (retried,) = failing.seen.requests, healthy.seen.requests
    assert retried.kv_transfer_params == tried.kv_transfer_params  # one prefill, reused
    assert c.prefill is not None and len(c.prefill.seen.requests) == 1
    assert retried.request_id != tried.request_id
    assert counted(metrics, 'pdserve_gateway_retries_total{kind="decode"}') == 1


async def test_prefill_failure_retries_on_another_prefill_worker() -> None:
    broken = FakePrefill()
    broken.fail_with = grpc.StatusCode.UNAVAILABLE
    async with two_of_each(FakeDecode(positional=True), broken) as (c, healthy_prefill, _):
        out, _, _ = await stream_text(c)
        metrics = await metrics_text(c.base_url)
        first_ejected = not c.gateway.pool.prefill[0].healthy
        await asyncio.wait_for(broken.seen.aborted.wait(), 10)
    assert out == text(expected())
    assert len(healthy_prefill.seen.requests) == 1
    assert c.decode is not None
    assert c.decode.seen.requests[0].HasField("kv_transfer_params"), "still disaggregated"
    assert counted(metrics, "pdserve_gateway_local_fallbacks_total") == 0
    assert first_ejected


async def test_ejected_worker_is_probed_back_in() -> None:
    async with gateway_cluster(eject_s=0.2, health_interval_s=0.1) as c:
        pool = c.gateway.pool
        worker = pool.decode[0]
        pool.mark_failed(worker, "scripted failure")
        assert not worker.healthy and worker.down.is_set()
        deadline = time.monotonic() + 30
        while not worker.healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert worker.healthy and not worker.down.is_set()
        failed = time.monotonic()
        pool.mark_failed(worker, "scripted failure")  # a second ejection in a row waits longer
        assert worker.ejected_until - failed > 0.35  # twice eject_s, not eject_s again


async def test_worker_ejected_mid_stream_moves_its_requests_at_once() -> None:
    # Two tokens, then it hangs: the stream can only finish on the healthy worker, however
    # late this test gets to eject it.
    slow = FakeDecode(positional=True, delay_s=0.2, hang_after=2)
    async with two_of_each(slow, inter_token_timeout_s=300) as (c, _, healthy):
        task = asyncio.create_task(stream_text(c))
        while len(slow.seen.requests) < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # a couple of tokens in
        c.gateway.pool.mark_failed(c.gateway.pool.decode[0], "scripted: health check failed")
        out, finish, _ = await asyncio.wait_for(task, 60)
    assert out == text(expected()) and finish == "length"
    assert len(healthy.seen.requests) == 1


async def test_prefill_on_a_worker_ejected_meanwhile_moves_at_once() -> None:
    stuck = FakePrefill(serve_s=600)  # a hung prefill engine: the call never returns
    async with two_of_each(FakeDecode(positional=True), stuck) as (c, healthy_prefill, _):
        task = asyncio.create_task(stream_text(c))
        while not stuck.seen.requests:
            await asyncio.sleep(0.01)
        c.gateway.pool.mark_failed(c.gateway.pool.prefill[0], "scripted: health check failed")
        out, finish, _ = await asyncio.wait_for(task, 60)
        await asyncio.wait_for(stuck.seen.aborted.wait(), 10)
    assert out == text(expected()) and finish == "length"
    assert len(healthy_prefill.seen.requests) == 1


async def test_engine_that_takes_no_step_with_requests_is_hung() -> None:
    """Liveness beyond the gRPC server answering: queued requests and a step count that does
    not move eject the worker; steps moving again readmit it."""
    decode = FakeDecode()
    async with gateway_cluster(decode=decode, health_interval_s=0.1, stall_timeout_s=0.5) as c:
        worker = c.gateway.pool.decode[0]
        decode.caps.load.running = 2
        decode.caps.load.engine_steps = 7
        deadline = time.monotonic() + 30
        while worker.healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not worker.healthy and "took no step" in worker.last_error
        decode.caps.load.engine_steps = 8
        while not worker.healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert worker.healthy
        decode.caps.load.running = 0  # idle: no steps needed
        await asyncio.sleep(1.0)
        assert worker.healthy
