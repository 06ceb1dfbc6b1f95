"""The registry, the prefix index, the KV tier's entries, discovery and routing on a real
Redis Cluster: 3 masters with one replica each on loopback (``LocalRedisCluster``), started
once for the module, logged into as an ACL user with a password (``redis+cluster://`` URL).
The last test kills a master and fails it over under load."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager

import pytest
import redis

from gateway.metrics import GatewayMetrics
from gateway.routing.kv_tier import TierIndex
from pdserve.cluster.redis_cluster import LocalRedisCluster
from pdserve.kvindex.epochs import new_epoch
from pdserve.kvindex.hashing import block_hashes
from pdserve.kvindex.interfaces import BlockOps, PrefixIndex, WorkerRecord
from pdserve.kvindex.keys import GROUPS
from pdserve.kvindex.redis_store import RedisStore
from tests.helpers import counted, metrics_text, served_name
from tests.integration.test_gateway_routing import BLOCK, complete, fleet, prompt_ids
from tests.unit.test_kvindex_fence import CASES

M = "model-a"
PASSWORD = "cluster secret: /@?"
# A master is declared failed after the node timeout (1 s) and its replica elected soon after;
# a bound only a hang reaches.
FAILOVER_BOUND_S = 20.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRedisCluster]:
    with LocalRedisCluster(masters=3, replicas=1, password=PASSWORD) as c:
        yield c


@pytest.fixture
def empty(cluster: LocalRedisCluster) -> LocalRedisCluster:
    """The module's cluster, emptied: every test starts from no keys."""
    for node in cluster.nodes:
        if node.process is not None:
            with cluster.client(node) as c:
                if c.info("replication")["role"] == "master":
                    c.flushall()
    return cluster


@asynccontextmanager
async def opened(cluster: LocalRedisCluster) -> AsyncIterator[RedisStore]:
    store = RedisStore(cluster.url, timeout_s=5.0)
    try:
        yield store
    finally:
        await store.close()


async def test_the_url_selects_the_cluster_client_and_the_acl_user(
    empty: LocalRedisCluster,
) -> None:
    async with opened(empty) as store:
        assert isinstance(store.client, redis.asyncio.RedisCluster)
        await store.registry_epoch()  # the client learns the cluster on its first call
        assert len(store.client.get_primaries()) == 3
    anonymous = redis.Redis(port=empty.nodes[0].port, socket_timeout=5)
    with pytest.raises(redis.exceptions.NoPermissionError):
        anonymous.get("x")
    anonymous.close()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
async def test_the_fence_rule_as_in_memory(
    empty: LocalRedisCluster, case: Callable[[PrefixIndex], Awaitable[None]]
) -> None:
    async with opened(empty) as store:
        await case(store)


async def test_a_models_index_spreads_over_the_masters(empty: LocalRedisCluster) -> None:
    workers = [f"w{i}" for i in range(64)]
    async with opened(empty) as store:
        for i, w in enumerate(workers):
            assert await store.replace_worker(
                M, w, list(range(i % 7)), new_epoch(), first_blocks=[0]
            )
        ports = {empty.master_of(store.keys.holder_blocks(M, w)).port for w in workers}
        assert len(ports) == 3 < GROUPS  # the groups' slots lie on every master
        got = await store.longest_prefixes(M, [0, 1, 2, 3, 4, 5], workers)
    assert got == {w: min(i % 7, 6) for i, w in enumerate(workers)}


async def test_registry_announce_expire_withdraw_and_reap(empty: LocalRedisCluster) -> None:
    epoch = new_epoch()
    async with opened(empty) as store:
        await store.announce(WorkerRecord("p0", "prefill", "a:1", epoch, M), ttl_s=0.3)
        await store.announce(WorkerRecord("p1", "prefill", "a:2", new_epoch(), M), ttl_s=30)
        await store.replace_worker(M, "p0", [1, 2], epoch, first_blocks=[1])
        assert {r.worker_id for r in await store.alive_workers()} == {"p0", "p1"}
        assert await store.recorded_epoch("p0") == epoch
        deadline = time.monotonic() + 10
        while "p0" not in await store.reap_dead():  # reaped once its heartbeat expired
            assert time.monotonic() < deadline, "p0 was never reaped"
            await asyncio.sleep(0.05)
        assert await store.longest_prefixes(M, [1, 2], ["p0"]) == {"p0": 0}
        assert [r.worker_id for r in await store.alive_workers()] == ["p1"]
        await store.withdraw("p1")
        assert await store.alive_workers() == []
        first = await store.registry_epoch()
        assert await store.registry_epoch() == first


async def test_the_gateways_tier_entries(empty: LocalRedisCluster) -> None:
    holder = "tier:redis:10.0.0.5:6379/1"
    async with opened(empty) as store:
        tiers = TierIndex(store, GatewayMetrics(), max_blocks=1000)
        tiers.store(M, holder, [11, 12, 13])
        await tiers.close()
        got = await store.longest_prefixes(M, [11, 12, 13], [holder, "p0"])
        assert got == {holder: 3, "p0": 0}
        tiers.correct(M, holder, [12, 13])
        await tiers.close()
        assert await store.longest_prefixes(M, [11, 12, 13], [holder]) == {holder: 1}


async def test_discovery_and_prefix_routing_through_a_gateway(empty: LocalRedisCluster) -> None:
    async with fleet(empty.url, ["p-a", "p-b"], ["d-0"]) as f:
        ids = prompt_ids("The history of the river begins in the mountains " * 8)
        hashes = block_hashes(ids, BLOCK, seed=42)
        await f.store.apply(served_name(), "p-b", [BlockOps(stored=hashes[:3])])
        f.prefill["p-b"].cached_tokens = 3 * BLOCK
        for _ in range(3):
            reply = await complete(f.url, ids)
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-pdserve-prefill-worker"] == "p-b"
        await f.store.withdraw("p-b")
        await f.until(prefill=1, decode=1)


async def test_a_master_killed_under_load_fails_no_request_and_routing_recovers(
    empty: LocalRedisCluster,
) -> None:
    """Kill -9 the master of the slot holding the cached prefix's holder; requests go on
    through the failover (routed by load while the index cannot answer) and none fails; once
    the replica took over, a lookup predicts the cached prefix again."""
    async with fleet(empty.url, ["p-a", "p-b"], ["d-0"]) as f:
        model = served_name()
        ids = prompt_ids("The history of the river begins in the mountains " * 8)
        hashes = block_hashes(ids, BLOCK, seed=42)
        other = prompt_ids("Unrelated load that no worker holds a prefix of. " * 8)
        key = f.store.keys.holder_blocks(model, "p-b")
        await f.store.apply(model, "p-b", [BlockOps(stored=hashes[:3])])
        f.prefill["p-b"].cached_tokens = 3 * BLOCK
        victim = empty.master_of(key)
        await asyncio.to_thread(replicated, empty, key)
        assert await predicted(f.url, ids) == 3 * BLOCK

        statuses: list[int] = []
        stop = asyncio.Event()

        async def load() -> None:
            while not stop.is_set():
                replies = await asyncio.gather(*(complete(f.url, other) for _ in range(4)))
                statuses.extend(r.status_code for r in replies)

        task = asyncio.create_task(load())
        victim.kill()
        deadline = time.monotonic() + FAILOVER_BOUND_S
        recovered = False
        while not recovered and time.monotonic() < deadline:
            recovered = await predicted(f.url, ids, statuses) == 3 * BLOCK
        stop.set()
        await task
        assert recovered, f"prefix routing did not come back in {FAILOVER_BOUND_S} s"
        assert empty.master_of(key).port != victim.port  # the replica took over
        metrics = await metrics_text(f.url)
        assert counted(metrics, "pdserve_gateway_prefix_index_errors_total") > 0  # it was down
        assert len(statuses) > 4 and set(statuses) == {200}


async def predicted(url: str, ids: list[int], statuses: list[int] | None = None) -> float:
    """Send ``ids`` through the gateway at ``url``: the cached tokens its lookup predicted (0:
    none, or the index could not answer). The load beside it predicts 0 (no prefix held)."""
    before = counted(await metrics_text(url), "pdserve_gateway_predicted_cached_tokens_total")
    reply = await complete(url, ids)
    if statuses is not None:
        statuses.append(reply.status_code)
    assert reply.status_code == 200, reply.text
    after = counted(await metrics_text(url), "pdserve_gateway_predicted_cached_tokens_total")
    return after - before


def replicated(cluster: LocalRedisCluster, key: str) -> None:
    """Wait until the replica of ``key``'s master holds it (replication is asynchronous)."""
    with cluster.client(cluster.master_of(key)) as c:
        port = c.info("replication")["slave0"]["port"]
    replica = next(n for n in cluster.nodes if n.port == port)
    deadline = time.monotonic() + 10
    with cluster.client(replica) as c:
        c.execute_command("READONLY")
        while not c.exists(key):
            assert time.monotonic() < deadline, "the replica never got the key"
            time.sleep(0.01)
