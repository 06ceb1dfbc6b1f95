"""Load shared between gateways (``gateway.shared_load``) on a real redis-server: what one
gateway publishes the others count, its own entry excepted; a peer that stops writing ages
out; long-dead entries are deleted; with Redis down sharing pauses and resumes; a crashed
loop restarts; the same exchange works on a real 3-master Redis Cluster."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.asyncio.cluster import RedisCluster

from gateway.shared_load import DROP_AFTER_S, MARGIN_S, SharedLoad
from pdserve.cluster.redis_cluster import LocalRedisCluster
from pdserve.cluster.redis_server import RedisServer
from pdserve.kvindex.keys import Keys
from pdserve.kvindex.redis_store import RedisStore
from pdserve.runtime import supervise

INTERVAL = 0.05
KEY = Keys("pdserve").inflight


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    store = RedisStore(redis_server.url, timeout_s=1.0)
    yield store
    await store.close()


class Gateway:
    """One gateway's side: its own counts, and what it was told of the others'."""

    def __init__(self, client: aioredis.Redis, name: str) -> None:
        self.mine: dict[str, int] = {}
        self.told: dict[str, int] = {}
        self.shared = SharedLoad(client, KEY, INTERVAL, lambda: dict(self.mine), self._apply,
                                 registry=CollectorRegistry(), own_id=name)  # fmt: skip

    def _apply(self, totals: Mapping[str, int]) -> None:
        self.told = dict(totals)


async def test_each_gateway_counts_the_others_and_not_itself(store: RedisStore) -> None:
    a, b, c = (Gateway(store.client, name) for name in ("gw-a", "gw-b", "gw-c"))
    a.mine, b.mine, c.mine = {"d-0": 3}, {"d-0": 1, "p-0": 2}, {}
    for g in (a, b, c):
        await g.shared.exchange()
    await a.shared.exchange()
    assert a.told == {"d-0": 1, "p-0": 2}  # b's only: its own 3 are not counted twice
    assert b.told == {"d-0": 3}
    assert c.told == {"d-0": 4, "p-0": 2}
    assert a.shared.live_peers._value.get() == 2
    raw = await store.client.hgetall(KEY)
    assert set(raw) == {b"gw-a", b"gw-b", b"gw-c"}
    assert json.loads(raw[b"gw-c"])["w"] == {}  # only non-zero counts are written
    assert 0 < await store.client.pttl(KEY) <= DROP_AFTER_S * 1000  # gone with every gateway


async def test_a_gateway_that_stops_writing_ages_out(store: RedisStore) -> None:
    a, b = Gateway(store.client, "gw-a"), Gateway(store.client, "gw-b")
    b.mine = {"d-0": 5}
    await b.shared.exchange()  # b's last write: then it dies
    await a.shared.exchange()
    seen_at = time.monotonic()
    assert a.told == {"d-0": 5}
    while a.told:
        await asyncio.sleep(INTERVAL)
        await a.shared.exchange()
        assert time.monotonic() - seen_at < 30, "a dead gateway's counts never aged out"
    # Not before three of its intervals: a live gateway's write may be late by that much.
    assert time.monotonic() - seen_at >= 3 * INTERVAL + MARGIN_S
    assert a.shared.live_peers._value.get() == 0
    b.mine = {"d-0": 1}
    await b.shared.exchange()  # alive again: counted again
    await a.shared.exchange()
    assert a.told == {"d-0": 1}


async def test_a_pause_of_the_readers_own_loop_does_not_drop_its_peers(
    store: RedisStore,
) -> None:
    a, b = Gateway(store.client, "gw-a"), Gateway(store.client, "gw-b")
    b.mine = {"d-0": 2}
    await b.shared.exchange()
    await a.shared.exchange()
    await asyncio.sleep(3 * INTERVAL + MARGIN_S + 0.1)  # neither ran (one stalled process)
    await a.shared.exchange()  # b may not have run since: one quiet read is not enough
    assert a.told == {"d-0": 2}
    await a.shared.exchange()  # a second one, and b still silent: gone
    assert a.told == {}


async def test_long_dead_and_malformed_entries(store: RedisStore) -> None:
    dead = {"t": time.time() - DROP_AFTER_S - 1, "i": INTERVAL, "w": {"d-0": 7}}
    await store.client.hset(KEY, mapping={"gw-dead": json.dumps(dead), "gw-odd": "not json"})
    a = Gateway(store.client, "gw-a")
    await a.shared.exchange()
    assert a.told == {}
    assert not await store.client.hexists(KEY, "gw-dead")  # deleted by the first reader
    assert await store.client.hexists(KEY, "gw-odd")  # not ours to judge: only skipped


async def test_closing_removes_the_own_entry(store: RedisStore) -> None:
    a, b = Gateway(store.client, "gw-a"), Gateway(store.client, "gw-b")
    b.mine = {"d-0": 2}
    await b.shared.exchange()
    await b.shared.close()
    await a.shared.exchange()
    assert a.told == {}


async def test_redis_down_pauses_sharing_and_it_resumes(
    redis_server: RedisServer, store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = Gateway(store.client, "gw-a"), Gateway(store.client, "gw-b")
    b.mine = {"d-0": 4}
    await b.shared.exchange()
    await a.shared.exchange()
    assert a.told == {"d-0": 4}
    redis_server.stop()
    seen_at = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gateway.shared_load"):
        while a.told:  # the peer's counts age out although nothing can be read
            await asyncio.sleep(INTERVAL)
            await a.shared.exchange()  # never raises
            assert time.monotonic() - seen_at < 30, "counts never aged out with Redis down"
        for _ in range(3):
            await a.shared.exchange()
    paused = [r for r in caplog.records if "paused" in r.getMessage()]
    assert len(paused) == 1  # logged once, not once per interval
    assert a.shared.failures._value.get() >= 4
    redis_server.start()  # empty: each gateway writes its entry again
    await b.shared.exchange()
    await a.shared.exchange()
    assert a.told == {"d-0": 4}


async def test_the_loop_restarts_after_a_crash(store: RedisStore) -> None:
    a, b = Gateway(store.client, "gw-a"), Gateway(store.client, "gw-b")
    crashes = []

    def local() -> dict[str, int]:
        if not crashes:
            crashes.append(1)
            raise RuntimeError("injected")
        return {"d-0": 1}

    b.shared._local = local
    before = supervise.restarts["gateway-shared-load"]
    b.shared.start()
    try:
        for _ in range(3000):  # 30 s: only a dead loop reaches it
            await a.shared.exchange()
            if a.told:
                break
            await asyncio.sleep(0.01)
        assert a.told == {"d-0": 1}
        assert supervise.restarts["gateway-shared-load"] == before + 1
    finally:
        await b.shared.close()


async def test_it_works_on_a_redis_cluster() -> None:
    """One key, so one slot: the pipeline is one node's, on a cluster client too."""
    with LocalRedisCluster(masters=3, replicas=0) as cluster:
        client = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        try:
            a, b = Gateway(client, "gw-a"), Gateway(client, "gw-b")
            a.mine, b.mine = {"d-0": 2}, {"d-0": 1, "p-0": 1}
            await a.shared.exchange()
            await b.shared.exchange()
            await a.shared.exchange()
            assert (a.told, b.told) == ({"d-0": 1, "p-0": 1}, {"d-0": 2})
            await b.shared.close()
            await a.shared.exchange()
            assert a.told == {}
        finally:
            await client.aclose()
