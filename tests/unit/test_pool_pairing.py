"""The pool's pairing check: workers grouped by kv_compat, each pair of groups compared once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gateway import pool as pool_module
from gateway.config import GatewaySettings
from gateway.pool import WorkerPool
from protos.v1 import worker_pb2


def _caps(**compat: str) -> worker_pb2.Capabilities:
    return worker_pb2.Capabilities(kv_compat={"dtype": "float32", "block_size": "16", **compat})


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    seen: list[Any] = []
    real = pool_module.pairing_problem

    def counted(p: worker_pb2.Capabilities, d: worker_pb2.Capabilities) -> str:
        seen.append((p, d))
        return real(p, d)

    monkeypatch.setattr(pool_module, "pairing_problem", counted)
    yield seen


async def test_a_mixed_fleet_refuses_exactly_the_pairs_across_groups(calls: list[Any]) -> None:
    prefill = [f"10.0.0.{i}:1" for i in range(3)]
    decode = [f"10.0.1.{i}:1" for i in range(2)]
    pool = WorkerPool(GatewaySettings(model="m", prefill_workers=prefill, decode_workers=decode))
    try:
        for w in [*pool.prefill[:2], *pool.decode]:
            w.capabilities = _caps()
        pool.prefill[2].capabilities = _caps(dtype="bfloat16")
        pool._check_compat()
        unpaired = pool.unpaired()
        assert [(p, d) for p, d, _ in unpaired] == [("10.0.0.2:1", d) for d in decode]
        assert all("dtype (prefill bfloat16, decode float32)" in why for _, _, why in unpaired)
        assert pool.compatible(pool.prefill[0], pool.decode[1])
        assert not pool.compatible(pool.prefill[2], pool.decode[0])
        assert len(calls) == 1  # one pair of groups, not one call per pair of workers
        pool.prefill[2].capabilities = _caps()  # the worker restarted with the fleet's dtype
        pool._check_compat()
        assert pool.unpaired() == [] and pool.compatible(pool.prefill[2], pool.decode[0])
    finally:
        await pool.close()


async def test_a_large_uniform_fleet_compares_nothing(calls: list[Any]) -> None:
    prefill = [f"10.0.0.{i}:1" for i in range(128)]
    decode = [f"10.0.1.{i}:1" for i in range(128)]
    pool = WorkerPool(GatewaySettings(model="m", prefill_workers=prefill, decode_workers=decode))
    try:
        for w in [*pool.prefill, *pool.decode]:
            w.capabilities = _caps()
        pool._check_compat()
        assert pool.unpaired() == [] and calls == []
    finally:
        await pool.close()
