"""Where a prompt is computed under ``disagg_policy`` (``gateway.routing.split``): fake
workers, a real gateway. With a prefill worker that serves one prompt at a time, a burst
queues there; the adaptive policy computes some of those prompts on the decode worker (no
hand-off reaches it), which the static policy never does, and a TPOT objective the decode
worker's streams would miss keeps them off it. Every choice is counted."""

from __future__ import annotations

import asyncio

import httpx

from pdserve.bench.fake_worker import FakeDecode, FakePrefill
from tests.helpers import REQUESTS, counted, gateway_cluster, metrics_text

BODY = {"prompt": "Tell me a story about a cat.", "max_tokens": 4}
SPLIT = "pdserve_gateway_split_decisions_total"
BURST = 6
REASONS = {
    "decode_worker": ("decode_idle", "within_tpot"),
    "prefill_worker": ("static", "learning", "prefill_sooner", "streams_unguarded", "tpot_guard"),
}


def chosen(metrics: str, where: str, reason: str = "") -> float:
    """Choices counted for ``where`` (and ``reason``; empty: every reason)."""
    reasons = [reason] if reason else REASONS[where]
    return sum(counted(metrics, f'{SPLIT}{{reason="{r}",where="{where}"}}') for r in reasons)


async def burst(policy: str, tpot_ms: float) -> tuple[str, FakeDecode]:
    """One request that measures the workers, then ``BURST`` at once; /metrics after."""
    prefill = FakePrefill(serve_s=0.2)  # one prompt at a time, 200 ms each
    decode = FakeDecode(delay_s=0.01)
    async with (
        gateway_cluster(prefill=prefill, decode=decode, disagg_policy=policy,
                        slo_tpot_ms=tpot_ms) as c,
        httpx.AsyncClient(base_url=c.base_url, timeout=30) as http,
    ):  # fmt: skip
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200
        replies = await asyncio.gather(
            *(http.post("/v1/completions", json=BODY) for _ in range(BURST))
        )
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return await metrics_text(c.base_url), decode


async def test_a_queue_on_the_prefill_worker_sends_prompts_to_the_decode_worker() -> None:
    metrics, decode = await burst("adaptive", tpot_ms=1000)
    # The first request measures the prefill worker; the burst then finds it queued.
    assert chosen(metrics, "prefill_worker", "learning") >= 1
    local = chosen(metrics, "decode_worker")
    assert local >= 2, metrics
    assert chosen(metrics, "decode_worker", "within_tpot") >= 1, metrics
    # Those prompts reached the decode worker without a hand-off and were served there.
    without = [r for r in decode.seen.requests if not r.HasField("kv_transfer_params")]
    assert len(without) == local
    ok_local = {"endpoint": "completions", "outcome": "ok", "path": "local"}
    assert counted(metrics, REQUESTS, **ok_local) == local


async def test_the_static_policy_always_uses_the_prefill_worker() -> None:
    metrics, decode = await burst("static", tpot_ms=1000)
    assert chosen(metrics, "decode_worker") == 0
    assert chosen(metrics, "prefill_worker", "static") == 1 + BURST
    assert all(r.HasField("kv_transfer_params") for r in decode.seen.requests)


async def test_streams_that_would_miss_their_tpot_are_not_stalled() -> None:
    # 1 ms a token: every decode step (10 ms) already misses it, so no stall is allowed.
    metrics, _ = await burst("adaptive", tpot_ms=1)
    assert chosen(metrics, "decode_worker", "within_tpot") == 0
    assert chosen(metrics, "prefill_worker", "tpot_guard") >= 1, metrics
