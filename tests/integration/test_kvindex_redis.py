"""The prefix index and worker registry on a real redis-server (free loopback port)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from pdserve.cluster.redis_server import RedisServer
from pdserve.kvindex.epochs import new_epoch
from pdserve.kvindex.interfaces import BlockOps, IndexUnavailable, PrefixIndex, WorkerRecord
from pdserve.kvindex.keys import GROUPS, group_of
from pdserve.kvindex.memory import MemoryIndex
from pdserve.kvindex.redis_store import RedisStore
from tests.unit.test_kvindex_fence import CASES

M = "model-a"


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    s = RedisStore(redis_server.url)
    yield s
    await s.close()


async def test_events_build_the_longest_prefix_per_worker(store: RedisStore) -> None:
    await store.apply(M, "p0", [BlockOps(stored=[1, 2, 3])])
    await store.apply(M, "p1", [BlockOps(stored=[1, 2]), BlockOps(stored=[9])])
    await store.apply(M, "p1", [BlockOps(removed=[2])])
    counts = await store.longest_prefixes(M, [1, 2, 3, 4], ["p0", "p1", "p2"])
    assert counts == {"p0": 3, "p1": 1, "p2": 0}
    # the leading run stops at the first miss even if later blocks are held
    assert await store.longest_prefixes(M, [7, 1, 2], ["p0"]) == {"p0": 0}
    # models do not see each other's blocks
    assert await store.longest_prefixes("model-b", [1], ["p0"]) == {"p0": 0}


async def test_clearing_removes_exactly_one_workers_entries(store: RedisStore) -> None:
    await store.apply(M, "p0", [BlockOps(stored=[1, 2])])
    await store.apply(M, "p1", [BlockOps(stored=[1, 2])])
    await store.clear_worker(M, "p0")
    assert await store.longest_prefixes(M, [1, 2], ["p0", "p1"]) == {"p0": 0, "p1": 2}
    # a step that starts with AllBlocksCleared then stores again
    await store.apply(M, "p1", [BlockOps(cleared=True, stored=[5])])
    assert await store.longest_prefixes(M, [1], ["p1"]) == {"p1": 0}
    assert await store.longest_prefixes(M, [5], ["p1"]) == {"p1": 1}
    keys = {k for k in await store.client.keys("*model-a*")}
    starts = store.keys.group_starts(M, group_of("p1"))
    assert keys == {
        k.encode()
        for k in (store.keys.holder_blocks(M, "p1"), store.keys.holder_starts(M, "p1"), starts)
    }  # p0's entries, its first blocks and their entries in its group's starts are all gone
    assert await store.client.zrange(starts, 0, -1) == [(5).to_bytes(8, "big") + b"p1"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
async def test_the_fence_rule_as_in_memory(
    store: RedisStore, case: Callable[[PrefixIndex], Awaitable[None]]
) -> None:
    await case(store)


async def test_a_holder_is_one_set_of_8_byte_hashes_in_its_groups_slot(store: RedisStore) -> None:
    epoch = new_epoch()
    await store.replace_worker(M, "p0", [1, 2**64 - 1], epoch, first_blocks=[1])
    blocks, fence = store.keys.holder_blocks(M, "p0"), store.keys.fence(M, "p0")
    assert await store.client.smembers(blocks) == {(1).to_bytes(8, "big"), b"\xff" * 8}
    assert await store.client.get(fence) == epoch.encode()
    first, starts = store.keys.holder_starts(M, "p0"), store.keys.group_starts(M, group_of("p0"))
    assert await store.client.smembers(first) == {(1).to_bytes(8, "big")}
    assert await store.client.zrange(starts, 0, -1) == [(1).to_bytes(8, "big") + b"p0"]
    assert set(await store.client.keys("*")) == {k.encode() for k in (blocks, fence, first, starts)}
    tag = f"{{pdserve:{M}:g{group_of('p0')}}}"
    assert all(k.startswith(tag) for k in (blocks, fence, first, starts))  # one slot: one script
    assert len({group_of(f"worker-{i}") for i in range(256)}) == GROUPS


async def test_matches_the_in_memory_index_on_a_random_history(store: RedisStore) -> None:
    import random

    rng = random.Random(7)
    memory = MemoryIndex()
    workers = ["a", "b", "c"]
    for _ in range(200):
        worker = rng.choice(workers)
        op = BlockOps(
            stored=rng.sample(range(30), rng.randint(0, 5)),
            removed=rng.sample(range(30), rng.randint(0, 3)),
            cleared=rng.random() < 0.05,
            starts_prompt=rng.random() < 0.7,
        )
        for index in (memory, store):
            await index.apply(M, worker, [op])
    for _ in range(50):
        hashes = rng.sample(range(30), rng.randint(1, 8))
        assert await store.longest_prefixes(M, hashes, workers) == await memory.longest_prefixes(
            M, hashes, workers
        )


async def test_concurrent_gateways_read_one_consistent_index(redis_server: RedisServer) -> None:
    writer, readers = RedisStore(redis_server.url), [RedisStore(redis_server.url) for _ in range(3)]
    try:
        chain = list(range(100, 140))

        async def write() -> None:
            for i in range(0, len(chain), 4):  # each step stores the next 4 blocks atomically
                await writer.apply(M, "p0", [BlockOps(stored=chain[i : i + 4])])

        async def read(reader: RedisStore) -> list[int]:
            seen = []
            for _ in range(60):
                seen.append((await reader.longest_prefixes(M, chain, ["p0"]))["p0"])
            return seen

        _, *observed = await asyncio.gather(write(), *(read(r) for r in readers))
        for seen in observed:
            assert all(n % 4 == 0 for n in seen), seen  # never half a step
            assert seen == sorted(seen)  # a reader never goes back in time
        assert all([(await r.longest_prefixes(M, chain, ["p0"]))["p0"] == 40 for r in readers])
    finally:
        for s in (writer, *readers):
            await s.close()


async def test_registry_heartbeats_expire_and_epochs_must_match(store: RedisStore) -> None:
    record = WorkerRecord("prefill-0", "prefill", "10.0.0.1:50100", "epoch-1", M, 128)
    await store.announce(record, ttl_s=2.0)
    assert [r.worker_id for r in await store.alive_workers()] == ["prefill-0"]
    deadline = asyncio.get_running_loop().time() + 10
    while await store.alive_workers():  # no heartbeat since: dead once the TTL runs out
        assert asyncio.get_running_loop().time() < deadline, "the heartbeat never expired"
        await asyncio.sleep(0.1)
    await store.announce(record, ttl_s=5)
    restarted = WorkerRecord("prefill-0", "prefill", "10.0.0.1:50100", "epoch-2", M, 128)
    await store.client.hset(store.keys.workers, "prefill-0", restarted.to_json())
    assert await store.alive_workers() == []  # record and heartbeat of different incarnations
    await store.announce(restarted, ttl_s=5)
    assert [r.epoch for r in await store.alive_workers()] == ["epoch-2"]
    await store.withdraw("prefill-0")
    assert await store.alive_workers() == []


async def test_dead_workers_are_reaped_with_exactly_their_entries(store: RedisStore) -> None:
    await store.announce(WorkerRecord("p0", "prefill", "a:1", "e0", M), ttl_s=0.2)
    await store.announce(WorkerRecord("p1", "prefill", "a:2", "e1", M), ttl_s=30)
    await store.replace_worker(M, "p0", [1, 2], "e0", first_blocks=[1])
    await store.replace_worker(M, "p1", [1], "e1", first_blocks=[1])
    await asyncio.sleep(0.4)
    assert await store.reap_dead() == ["p0"]
    assert await store.longest_prefixes(M, [1, 2], ["p0", "p1"]) == {"p0": 0, "p1": 1}
    assert [r.worker_id for r in await store.alive_workers()] == ["p1"]
    assert await store.reap_dead() == []
    assert await store.client.get(store.keys.fence(M, "p0")) is None  # nothing left of it


async def test_a_worker_restarted_under_the_same_name_is_not_reaped(store: RedisStore) -> None:
    await store.announce(WorkerRecord("p0", "prefill", "a:1", "old", M), ttl_s=0.2)
    await asyncio.sleep(0.4)
    records = await store._records()  # a gateway has read the dead record...
    await store.announce(WorkerRecord("p0", "prefill", "a:1", "new", M), ttl_s=30)
    await store.replace_worker(
        M, "p0", [7], "new", first_blocks=[7]
    )  # ...the new incarnation works...
    ((record, alive),) = records
    assert not alive
    # ...and the reap of the old one is a no-op, in both of its slots
    keys = [store.keys.holder_blocks(M, "p0"), store.keys.fence(M, "p0")]
    assert await store._reap_index(keys=keys, args=[record.epoch, record.worker_id]) == 0
    keys = [store.keys.workers, store.keys.alive("p0")]
    assert await store._reap_record(keys=keys, args=["p0", record.epoch]) == 0
    assert await store.longest_prefixes(M, [7], ["p0"]) == {"p0": 1}
    assert [r.epoch for r in await store.alive_workers()] == ["new"]


async def test_unreachable_redis_is_a_clear_error_and_recovers(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, timeout_s=5.0)  # refused at once: not a wait
    try:
        await store.apply(M, "p0", [BlockOps(stored=[1])])
        redis_server.stop()
        with pytest.raises(IndexUnavailable, match="Redis is unavailable"):
            await store.longest_prefixes(M, [1], ["p0"])
        redis_server.start()  # same port, empty data (no persistence)
        assert await store.longest_prefixes(M, [1], ["p0"]) == {"p0": 0}
    finally:
        await store.close()


async def test_the_first_call_after_a_redis_restart_succeeds(redis_server: RedisServer) -> None:
    """Every pooled connection is stale once Redis restarts (the server closed it): a call
    that gets one reconnects and goes through, rather than failing once per connection."""
    store = RedisStore(redis_server.url, timeout_s=2.0)
    try:
        # Several connections in the pool, each used once and idle now.
        await asyncio.gather(*(store.apply(M, f"p{n}", [BlockOps(stored=[n])]) for n in range(8)))
        redis_server.stop()
        redis_server.start()  # same port, empty data (no persistence)
        for n in range(8):
            assert await store.longest_prefixes(M, [n], [f"p{n}"]) == {f"p{n}": 0}
    finally:
        await store.close()


async def test_a_lookup_loads_its_script_again_when_the_server_lost_it(store: RedisStore) -> None:
    """A lookup's packed command names its script by hash; a server without it (flushed,
    restarted, failed over) gets it again and the lookup still answers."""
    await store.apply(M, "p0", [BlockOps(stored=[1, 2], starts_prompt=True)])
    assert await store.longest_prefixes(M, [1, 2, 3], ["p0", "p1"]) == {"p0": 2, "p1": 0}
    await store.client.script_flush()
    assert await store.longest_prefixes(M, [1, 2, 3], ["p1", "p0"]) == {"p1": 0, "p0": 2}
    assert await store.longest_prefixes(M, [1, 2, 3], ["p0", "p0"]) == {"p0": 2}
