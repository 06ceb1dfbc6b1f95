"""A worker whose served model or block-hash seed differ from the gateway's is refused: not
routed to, logged as an error, listed in /health, and accepted once it agrees."""

from __future__ import annotations

import logging

import httpx
import pytest

from pdserve.bench.fake_worker import FakeDecode, FakePrefill
from tests.helpers import gateway_cluster, served_name


async def test_mismatched_workers_are_refused_until_they_agree(
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefill, decode = FakePrefill(), FakeDecode()
    prefill.caps.index_keys.hash_seed = 7
    decode.caps.served_model_name = "another-model"
    body = {"model": served_name(), "prompt": "Hi", "max_tokens": 2}
    with caplog.at_level(logging.ERROR, logger="gateway.pool"):
        async with (
            gateway_cluster(prefill=prefill, decode=decode) as c,
            httpx.AsyncClient(base_url=c.base_url) as http,
        ):
            health = await http.get("/health")
            refused_reply = await http.post("/v1/completions", json=body)
            prefill.caps.index_keys.hash_seed = 42
            decode.caps.served_model_name = served_name()
            await c.gateway.pool.refresh()
            healthy = await http.get("/health")
            reply = await http.post("/v1/completions", json=body)
    assert health.status_code == 503
    refused = {w["role"]: w["reason"] for w in health.json()["refused_workers"]}
    assert refused["prefill"] == "hash seed 7 differs from the gateway's 42"
    assert refused["decode"].startswith("serves model 'another-model'")
    assert health.json()["healthy_decode_workers"] == 0
    assert refused_reply.status_code == 503
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("refusing to route to prefill worker" in m and "hash seed 7" in m for m in errors)
    assert healthy.status_code == 200 and healthy.json()["refused_workers"] == []
    assert reply.status_code == 200, reply.text
    assert len(prefill.seen.requests) == 1 and len(decode.seen.requests) == 1
