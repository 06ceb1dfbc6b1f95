"""The gateway with workers whose hand-offs are vLLM NixlConnector's (their kv_compat says so),
through real grpc.aio fake workers: which Abort calls carry a hand-off to release, and that a
NIXL hand-off is given to one decode worker only.

vLLM's producer frees a prompt's blocks once a decode engine has read them or notified it
(vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py:642-693), and cannot release
a finished prompt itself (vllm/v1/core/sched/scheduler.py:2677-2681): the release goes through
a decode worker (decode_service.service, tests/unit/test_nixl_release.py).
"""

from __future__ import annotations

import asyncio

import httpx

from pdserve.bench.fake_worker import FakeDecode, FakePrefill, start_worker
from tests.helpers import counted, gateway_cluster, metrics_text, served_name
from tests.integration.test_gateway_recovery import MAX_TOKENS, PROMPT, stream_text

NIXL = "NixlConnector/14/pull/vllm-0.32.0"


def nixl(worker: FakePrefill | FakeDecode) -> FakePrefill | FakeDecode:
    worker.caps.kv_compat["connector"] = NIXL
    return worker


async def test_a_nixl_handoff_is_not_given_to_a_second_decode_worker() -> None:
    """The first decode worker fails before its first token: it may have read the blocks, so
    the retry computes the prompt itself; the failed call's Abort brings the hand-off."""
    failing = nixl(FakeDecode(positional=True, fail_after=0))
    healthy = nixl(FakeDecode(positional=True))
    server = await start_worker(healthy)
    try:
        async with gateway_cluster(
            prefill=nixl(FakePrefill()),
            decode=failing,
            extra_decode=[f"127.0.0.1:{server.port}"],
            retry_backoff_s=0.01,
        ) as c:
            out, finish, usage = await stream_text(c)
            metrics = await metrics_text(c.base_url)
            await asyncio.wait_for(failing.seen.aborted.wait(), 10)
    finally:
        await server.stop(0)
    assert finish == "length" and usage["completion_tokens"] == MAX_TOKENS
    (tried,), (retried,) = failing.seen.requests, healthy.seen.requests
    assert tried.HasField("kv_transfer_params")
    assert not retried.HasField("kv_transfer_params"), "computed locally, not read again"
    assert list(retried.prompt_token_ids) == PROMPT and out
    assert counted(metrics, "pdserve_gateway_local_fallbacks_total") == 1
    assert counted(metrics, 'pdserve_gateway_local_fallbacks_total{reason="handoff_spent"}') == 1
    (released,) = failing.seen.releases
    assert released == (tried.request_id, tried.kv_transfer_params)


async def test_our_handoffs_are_still_retried_on_another_decode_worker() -> None:
    """The contrast with pdserve's connector (no kv_compat "connector" of NIXL): reused."""
    failing = FakeDecode(positional=True, fail_after=0)
    healthy = FakeDecode(positional=True)
    server = await start_worker(healthy)
    try:
        async with gateway_cluster(
            decode=failing, extra_decode=[f"127.0.0.1:{server.port}"], retry_backoff_s=0.01
        ) as c:
            await stream_text(c)
            await asyncio.wait_for(failing.seen.aborted.wait(), 10)
    finally:
        await server.stop(0)
    assert (
        healthy.seen.requests[0].kv_transfer_params == failing.seen.requests[0].kv_transfer_params
    )
    assert failing.seen.releases == []


async def cancel_mid_stream(prefill: FakePrefill, decode: FakeDecode) -> None:
    decode.pieces = [(100 + i, f" w{i}") for i in range(200)]
    async with gateway_cluster(prefill=prefill, decode=decode) as c:
        async with httpx.AsyncClient(base_url=c.base_url) as http:
            body = {"model": served_name(), "prompt": PROMPT, "max_tokens": 150, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                [await anext(lines) for _ in range(4)]
        await asyncio.wait_for(decode.seen.aborted.wait(), 5)
        await asyncio.wait_for(prefill.seen.aborted.wait(), 5)


async def test_a_cancelled_request_brings_its_nixl_handoff_to_the_decode_workers_abort() -> None:
    """The decode worker releases it only if its engine never got the request (else vLLM does:
    tests/unit/test_nixl_release.py); the prefill worker's Abort stops a prompt still running."""
    prefill, decode = nixl(FakePrefill()), nixl(FakeDecode(delay_s=0.05))
    await cancel_mid_stream(prefill, decode)
    (call,) = decode.seen.requests
    assert decode.seen.releases == [(call.request_id, call.kv_transfer_params)]
    assert prefill.seen.aborts == [call.request_id] and prefill.seen.releases == []


async def test_with_our_connector_the_prefill_workers_abort_releases() -> None:
    prefill, decode = FakePrefill(), FakeDecode(delay_s=0.05)
    await cancel_mid_stream(prefill, decode)
    assert decode.seen.releases == [] and decode.seen.aborts == [decode.seen.requests[0].request_id]
    assert prefill.seen.aborts == [decode.seen.requests[0].request_id]
