"""The limits of recovery (gateway.recovery), with real grpc.aio fake workers: how many times a
stream migrates, which streams never do, how prefill retries are counted, and the 429 a gateway
answers when every prefill worker's queue is full. Each failure is placed exactly by a scripted
fake; every count is read from the gateway's own /metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import httpx
import pytest

from pdserve.bench.fake_worker import DEFAULT_PIECES, FakeDecode, FakePrefill, start_worker
from pdserve.rpc.server import GrpcServer
from tests.helpers import REQUESTS, Cluster, counted, gateway_cluster, metrics_text, served_name

PROMPT = [11, 12, 13, 14, 15]
MAX_TOKENS = 9
DIES_AFTER = 2  # tokens each dying decode worker streams before it fails
MIGRATIONS = 'pdserve_gateway_retries_total{kind="migration"}'
PREFILL_RETRIES = 'pdserve_gateway_retries_total{kind="prefill"}'


def expected_text(n: int) -> str:
    """The first ``n`` tokens' text of an uninterrupted positional fake's answer to PROMPT."""
    return "".join(DEFAULT_PIECES[(len(PROMPT) + i) % len(DEFAULT_PIECES)][1] for i in range(n))


@asynccontextmanager
async def cluster(
    decode: list[FakeDecode], prefill: list[FakePrefill] | None = None, **overrides: Any
) -> AsyncIterator[Cluster]:
    """A gateway over these fakes: the first of each list is its first worker (the one the
    round-robin picker sends the first request to), the others come after in order."""
    prefill = prefill or [FakePrefill()]
    servers: list[GrpcServer] = [await start_worker(w) for w in [*prefill[1:], *decode[1:]]]
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    try:
        async with gateway_cluster(
            prefill=prefill[0],
            decode=decode[0],
            extra_prefill=addresses[: len(prefill) - 1],
            extra_decode=addresses[len(prefill) - 1 :],
            retry_backoff_s=0.01,
            **overrides,
        ) as c:
            yield c
    finally:
        for server in servers:
            await server.stop(0)


async def stream(c: Cluster, **extra: Any) -> tuple[str, str, dict[str, Any] | None]:
    """Stream one completion of PROMPT: (text, finish reason, the in-band error or None)."""
    body = {"model": served_name(), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True,
            **extra}  # fmt: skip
    out, finish, error = "", "", None
    async with (
        httpx.AsyncClient(base_url=c.base_url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            error = event.get("error") or error
            for choice in event.get("choices", []):
                out += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
    return out, finish, error


@pytest.mark.parametrize("max_migrations", [None, 1, 0], ids=["default", "one", "none"])
async def test_a_stream_whose_decode_workers_keep_dying_migrates_max_migrations_times(
    max_migrations: int | None,
) -> None:
    """Four decode workers, each dying after two tokens: the stream moves from one to the
    next ``max_migrations`` times (default 2), then ends with the last worker's error; the
    remaining workers are never asked."""
    limit = 2 if max_migrations is None else max_migrations
    dying = [FakeDecode(positional=True, fail_after=DIES_AFTER) for _ in range(4)]
    settings = {} if max_migrations is None else {"max_migrations": max_migrations}
    async with cluster(dying, **settings) as c:
        out, finish, error = await stream(c)
        metrics = await metrics_text(c.base_url)
    assert counted(metrics, MIGRATIONS) == limit
    asked = sorted(len(d.seen.requests) for d in dying)
    assert asked == [0] * (3 - limit) + [1] * (limit + 1), "one decode call per attempt"
    assert error is not None and error["code"] == "worker_failed", error
    assert "scripted worker death" in error["message"], "the worker's own error"
    assert out == expected_text(DIES_AFTER * (limit + 1)), "every token up to the last death"
    assert finish == ""
    assert counted(metrics, REQUESTS, endpoint="completions", outcome="error") == 1


STRUCTURED = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}},
    "regex": {"structured_outputs": {"regex": "[a-z ,!]+"}},
    "grammar": {"structured_outputs": {"grammar": 'root ::= "Hello" | "world"'}},
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(STRUCTURED))
async def test_a_structured_output_stream_never_migrates(kind: str) -> None:
    """Its grammar state lives in the engine that generated the tokens: a dying decode worker
    ends the stream with its error although a healthy one is there."""
    dying, healthy = FakeDecode(positional=True, fail_after=DIES_AFTER), FakeDecode()
    async with cluster([dying, healthy]) as c:
        out, finish, error = await stream(c, **STRUCTURED[kind])
        metrics = await metrics_text(c.base_url)
    (request,) = dying.seen.requests
    assert request.params.structured_output.WhichOneof("kind"), "the request is structured"
    assert counted(metrics, MIGRATIONS) == 0
    assert healthy.seen.requests == [], "no continuation on another decode worker"
    assert error is not None and "scripted worker death" in error["message"], error
    assert out == expected_text(DIES_AFTER) and finish == ""


def failing_prefill() -> FakePrefill:
    prefill = FakePrefill()
    prefill.fail_with = grpc.StatusCode.UNAVAILABLE
    return prefill


@pytest.mark.parametrize(
    ("retries", "second_fails", "prefill_calls", "fallbacks"),
    [(1, False, [1, 1], 0), (1, True, [1, 1], 1), (0, False, [1, 0], 1), (3, True, [1, 1], 1)],
    ids=["retried", "retried-then-local", "no-retry-local", "only-one-other-worker"],
)
async def test_prefill_retries_are_counted_once_per_other_prefill_worker_tried(
    retries: int, second_fails: bool, prefill_calls: list[int], fallbacks: int
) -> None:
    """The first prefill worker refuses; ``prefill_retries`` other ones are tried (as many as
    there are), each counted once; then the decode worker computes the prompt (policy local)."""
    second = failing_prefill() if second_fails else FakePrefill()
    prefills = [failing_prefill(), second]
    decode = FakeDecode(positional=True)
    async with cluster([decode], prefills, prefill_retries=retries) as c:
        out, finish, error = await stream(c)
        metrics = await metrics_text(c.base_url)
    assert error is None and out == expected_text(MAX_TOKENS) and finish == "length"
    assert counted(metrics, PREFILL_RETRIES) == prefill_calls[1]
    assert [len(p.seen.requests) for p in prefills] == prefill_calls
    fell_back = 'pdserve_gateway_local_fallbacks_total{reason="prefill_failed"}'
    assert counted(metrics, fell_back) == fallbacks
    (request,) = decode.seen.requests
    assert request.HasField("kv_transfer_params") == (not fallbacks)


async def test_prefill_failures_under_policy_fail_are_a_503_after_the_counted_retry() -> None:
    prefills = [failing_prefill(), failing_prefill()]
    decode = FakeDecode()
    async with (
        cluster([decode], prefills, prefill_failure_policy="fail") as c,
        httpx.AsyncClient(base_url=c.base_url, timeout=60) as http,
    ):
        body = {"model": served_name(), "prompt": PROMPT, "max_tokens": MAX_TOKENS}
        response = await http.post("/v1/completions", json=body)
        metrics = await metrics_text(c.base_url)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "worker_failed"
    assert [len(p.seen.requests) for p in prefills] == [1, 1]
    assert counted(metrics, PREFILL_RETRIES) == 1
    assert counted(metrics, "pdserve_gateway_local_fallbacks_total") == 0
    assert decode.seen.requests == []


class GatedPrefill(FakePrefill):
    """Holds every Prefill call until ``gate`` is set (a prefill engine with a full queue)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.arrived = 0

    async def Prefill(self, request, context):  # type: ignore[no-untyped-def]
        self.arrived += 1
        await self.gate.wait()
        return await super().Prefill(request, context)


async def test_a_full_prefill_queue_is_a_429_with_retry_after_counted() -> None:
    """One prefill worker holding one request with ``max_queue_per_worker=1``, and a decode
    worker free (two, so that the decode queue is not the limit): the next request is refused
    before any work, with reason prefill_queue; once the queue drains requests pass again."""
    prefill = GatedPrefill()
    decodes = [FakeDecode(), FakeDecode()]
    body = {"model": served_name(), "prompt": PROMPT, "max_tokens": 4}
    async with (
        cluster(decodes, [prefill], max_queue_per_worker=1, retry_after_s=7) as c,
        httpx.AsyncClient(base_url=c.base_url, timeout=60) as http,
    ):
        held = asyncio.ensure_future(http.post("/v1/completions", json=body))
        while prefill.arrived < 1:
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(http.post("/v1/completions", json=body))
        deadline = asyncio.get_running_loop().time() + 30
        while not second.done() and prefill.arrived < 2:  # refused, or it reached the worker
            assert asyncio.get_running_loop().time() < deadline, "no answer in 30 s"
            await asyncio.sleep(0.01)
        refused_at_once = second.done()
        prefill.gate.set()
        refused, first = await second, await held
        after = await http.post("/v1/completions", json=body)
        metrics = await metrics_text(c.base_url)
    assert refused_at_once, "the second request waited on the full prefill worker"
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "7"
    assert "prefill worker" in refused.json()["error"]["message"]
    assert first.status_code == 200 and after.status_code == 200
    assert prefill.arrived == 2, "the refused request never reached the prefill worker"
    assert counted(metrics, 'pdserve_gateway_rejected_total{reason="prefill_queue"}') == 1
    assert counted(metrics, 'pdserve_gateway_rejected_total{reason="decode_queue"}') == 0
    overloaded = {"endpoint": "completions", "outcome": "overloaded", "path": "none"}
    assert counted(metrics, REQUESTS, **overloaded) == 1
