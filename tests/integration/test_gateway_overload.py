"""Overload without self-amplification: queued prefills are not timed out into a second
computation, and a gateway in front of saturated workers answers 429 instead of piling on."""

from __future__ import annotations

import asyncio

import httpx

from pdserve.bench.fake_worker import FakePrefill
from tests.helpers import REQUESTS, GatedDecode, counted, gateway_cluster

BODY = {"prompt": "The same prompt every time", "max_tokens": 4}


async def test_queued_prefills_get_deadlines_that_follow_the_queue() -> None:
    """The fake prefill worker serves one prompt per second, in order. Four prompts sent at
    once wait up to 4 s, twice the 2 s floor: with a fixed deadline the last two would time
    out and be computed again on the decode worker (a local fallback)."""
    prefill = FakePrefill(serve_s=1.0)
    async with (
        gateway_cluster(prefill=prefill, prefill_timeout_s=2.0) as c,
        httpx.AsyncClient(base_url=c.base_url, timeout=60) as http,
    ):
        warm = await http.post("/v1/completions", json=BODY)  # measures the worker's rate
        replies = await asyncio.gather(*(http.post("/v1/completions", json=BODY) for _ in "1234"))
        metrics = (await http.get("/metrics")).text
    assert warm.status_code == 200
    assert [r.status_code for r in replies] == [200] * 4
    assert {r.headers["x-pdserve-prefill-worker"] for r in replies} == {"fake-role_prefill"}
    assert counted(metrics, "pdserve_gateway_local_fallbacks_total") == 0
    assert len(prefill.seen.requests) == 5  # every prompt computed once, by the prefill worker
    assert counted(metrics, "pdserve_gateway_prefill_deadline_seconds_count") == 5
    # The last of the four had three prompts ahead: its deadline was over the floor.
    assert counted(metrics, 'pdserve_gateway_prefill_deadline_seconds_bucket{le="2.5"}') < 5


async def test_saturated_decode_worker_gets_429_with_retry_after_counted() -> None:
    async with (
        gateway_cluster(decode=GatedDecode(), max_queue_per_worker=1, retry_after_s=3) as c,
        httpx.AsyncClient(base_url=c.base_url, timeout=60) as http,
    ):
        slow = asyncio.ensure_future(http.post("/v1/completions", json=BODY))
        while not c.decode or not c.decode.seen.requests:  # the first one is on the worker
            await asyncio.sleep(0.01)
        refused = await http.post("/v1/completions", json=BODY)
        assert isinstance(c.decode, GatedDecode)
        c.decode.gate.set()  # only now the first one may finish
        assert (await slow).status_code == 200
        after = await http.post("/v1/completions", json=BODY)
        metrics = (await http.get("/metrics")).text
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "3"
    assert "decode worker" in refused.json()["error"]["message"]
    assert after.status_code == 200
    assert counted(metrics, 'pdserve_gateway_rejected_total{reason="decode_queue"}') == 1
    overloaded = {"endpoint": "completions", "outcome": "overloaded", "path": "none"}
    assert counted(metrics, REQUESTS, **overloaded) == 1
