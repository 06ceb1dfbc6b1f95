"""The worker's KV-event sink between vLLM's own ZMQ event publisher and a real Redis index."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Literal

import pytest

from pdserve.cluster.redis_server import RedisServer
from pdserve.kvindex.epochs import new_epoch
from pdserve.kvindex.interfaces import BlockOps
from pdserve.kvindex.redis_store import RedisStore
from pdserve.runtime.tasks import cancel_and_wait
from pdserve.worker import kv_events
from pdserve.worker.block_mirror import BlockMirror
from pdserve.worker.config import WorkerSettings
from pdserve.worker.engine import EngineInfo
from pdserve.worker.kv_events import EventEndpoints, EventSink, events_config, to_ops
from pdserve.worker.registration import IndexLink, Load

M, W = "model", "prefill-0"


def stored(*hashes: int, parent: int | None = None) -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[],
                       block_size=128, lora_id=None, medium="GPU", lora_name=None)  # fmt: skip


def removed(*hashes: int) -> Any:
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


class Engine:
    """vLLM's ZmqEventPublisher, configured as pdserve configures the engine."""

    def __init__(self, endpoints: EventEndpoints | None = None, buffer_steps: int = 10_000) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        self.endpoints = endpoints or EventEndpoints.private()
        config = events_config(self.endpoints)
        self.publisher = ZmqEventPublisher(
            0, endpoint=config["endpoint"], replay_endpoint=config["replay_endpoint"],
            topic=config["topic"], buffer_steps=buffer_steps,
        )  # fmt: skip

    def step(self, *events: Any) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.publisher.publish(KVEventBatch(ts=0.0, events=list(events)))


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    s = RedisStore(redis_server.url, timeout_s=0.5)
    yield s
    await s.close()


@contextlib.asynccontextmanager
async def running(sink: EventSink) -> AsyncIterator[None]:
    task = asyncio.create_task(sink.run())
    try:
        yield
    finally:
        await cancel_and_wait(task)  # the sink talks to Redis (see pdserve.runtime.tasks)


async def until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_steps_published_before_the_sink_started_are_replayed(store: RedisStore) -> None:
    engine = Engine()
    engine.step(stored(1, 2))
    engine.step(stored(3), removed(2))
    await store.apply(M, W, [])  # nothing yet
    sink = EventSink(store, M, W, engine.endpoints)
    async with running(sink):
        await until(lambda: _count(store, [1, 3], 2))
        assert await _count(store, [1, 2], 1)  # block 2 was stored, then removed
        engine.step(stored(2))  # live after the catch-up
        await until(lambda: _count(store, [1, 2], 2))
    assert sink.last_seq == 2
    engine.publisher.shutdown()


async def test_the_sink_may_start_before_the_engine_binds(store: RedisStore) -> None:
    """As in a worker: the sink runs while the engine is still loading; nothing is bound on
    a port in the meantime, only paths in the worker's own directory."""
    endpoints = EventEndpoints.private()
    assert endpoints.publish.startswith("ipc://") and endpoints.replay.startswith("ipc://")
    assert endpoints.directory.stat().st_mode & 0o077 == 0  # nobody else's
    sink = EventSink(store, M, W, endpoints)
    async with running(sink):
        await asyncio.sleep(0)  # the sink task runs up to its first await: it has connected
        engine = Engine(endpoints)
        engine.step(stored(7))
        await until(lambda: _count(store, [7], 1))
    engine.publisher.shutdown()
    endpoints.remove()
    assert not endpoints.directory.exists()


async def test_a_sequence_gap_is_filled_from_the_replay_buffer(store: RedisStore) -> None:
    engine = Engine()
    # Not running: this test hands the sink its steps (a running one would also replay on
    # its own after a quiet second, and race the step below).
    sink = EventSink(store, M, W, engine.endpoints)
    await sink._rewrite()
    engine.step(stored(10))
    await sink._on_step(0, _encode(stored(10)))
    assert await _count(store, [10], 1)
    # steps 1 and 2 reach the buffer but not this sink (as if the message was lost)
    engine.publisher._buffer.append((1, _encode(stored(11))))
    engine.publisher._buffer.append((2, _encode(stored(12))))
    await sink._on_step(3, _encode(stored(13)))
    assert await store.longest_prefixes(M, [10, 11, 12, 13], [W]) == {W: 4}
    assert sink.last_seq == 3
    sink.context.term()
    engine.publisher.shutdown()


async def test_the_index_is_rebuilt_after_redis_comes_back(
    store: RedisStore, redis_server: RedisServer
) -> None:
    engine = Engine()
    sink = EventSink(store, M, W, engine.endpoints)
    async with running(sink):
        engine.step(stored(1))
        await until(lambda: _count(store, [1], 1))
        redis_server.stop()
        engine.step(stored(2))  # cannot be applied: the sink marks itself dirty
        await until(_true_when(lambda: sink.dirty))
        redis_server.start()  # empty Redis on the same port
        await until(lambda: _count(store, [1, 2], 2))
    engine.publisher.shutdown()


async def test_a_redis_restarted_empty_gets_the_whole_set_back_not_only_recent_steps(
    redis_server: RedisServer,
) -> None:
    """Redis restarts while the engine is quiet (no event write notices): the worker finds
    its entries gone and rewrites all of them, also those of steps that vLLM's replay buffer
    no longer holds; its registry record comes back with its heartbeat."""
    link = IndexLink(WorkerSettingsForTest(redis_url=redis_server.url, worker_id=W), Load())
    engine = Engine(link.endpoints, buffer_steps=3)  # only the last 3 steps can be replayed
    await link.start(engine_info(), grpc_port=1234)
    store = RedisStore(redis_server.url, timeout_s=0.5)
    try:
        engine.step(stored(5))  # once this is in, the sink is subscribed: nothing is dropped
        await until(lambda: _count(store, [5], 1))
        for h in range(1, 21):
            engine.step(stored(h * 10, h * 10 + 1))
        engine.step(removed(10, 11))
        expected = [5] + [h * 10 + k for h in range(2, 21) for k in (0, 1)]
        await until(lambda: _count(store, expected, len(expected)))
        await until(lambda: _count(store, [10], 0))  # the removal, the last step, is in too
        redis_server.stop()
        redis_server.start()  # empty, same port
        await until(lambda: _count(store, expected, len(expected)), timeout_s=10.0)
        assert await store.worker_block_count(M, W) == len(expected)
        await until(_true_when_async(lambda: _registered(store)), timeout_s=10.0)
        # and the index goes on following the engine
        engine.step(removed(200))
        await until(lambda: _count(store, [200, 201], 0))
        assert await store.worker_block_count(M, W) == len(expected) - 1
    finally:
        await link.stop()
        await store.close()
        engine.publisher.shutdown()


async def test_entries_reaped_by_a_gateway_are_written_again(store: RedisStore) -> None:
    engine = Engine()
    sink = EventSink(store, M, W, engine.endpoints, max_blocks=100)
    async with running(sink):
        engine.step(stored(1, 2, 3))
        await until(lambda: _count(store, [1, 2, 3], 3))
        assert sink.rewrites == 1  # at start: it clears what an earlier incarnation left
        await store.clear_worker(M, W)  # as a gateway does to a worker that missed heartbeats
        # Wait for the sink to count its rewrite, not only for the entries: Redis holds them
        # before the sink's call returns, and leaving the block then would cancel the sink
        # before it counts.
        await until(_true_when(lambda: sink.rewrites == 2))
        assert await _count(store, [1, 2, 3], 3)
    engine.publisher.shutdown()


async def test_an_older_life_stops_writing_once_a_newer_life_rewrote(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker restarted under the same name while its old life still publishes (a
    zombie, or its last steps in flight): the old life's writes are dropped by the index's
    fence, and its sink writes no more; the new life's entries stay exactly its own."""
    # No periodic count check: only the fence can tell the old life that it lost the holder.
    monkeypatch.setattr(kv_events, "CHECK_S", 3600.0)
    old_epoch = new_epoch()
    old_engine, new_engine = Engine(), Engine()
    old = EventSink(store, M, W, old_engine.endpoints, epoch=old_epoch)
    new = EventSink(store, M, W, new_engine.endpoints, epoch=new_epoch(after=old_epoch))
    async with running(old):
        old_engine.step(stored(1, 2, 3))
        await until(lambda: _count(store, [1, 2, 3], 3))
        async with running(new):
            new_engine.step(stored(7))
            await until(lambda: _count(store, [7], 1))
            old_engine.step(stored(4), removed(7))  # the old life's late step
            await until(_true_when(lambda: old.fenced and old.applied_steps == 2))
            assert await store.worker_block_count(M, W) == 1
            assert await _count(store, [7], 1)
            new_engine.step(stored(8))
            await until(lambda: _count(store, [7, 8], 2))
    old_engine.publisher.shutdown()
    new_engine.publisher.shutdown()


def test_the_copy_follows_the_index_operations_and_stays_within_the_engine() -> None:
    mirror = BlockMirror(max_blocks=3)
    assert mirror.apply([BlockOps(stored=[1, 2]), BlockOps(stored=[3], removed=[1])]) == []
    assert mirror.hashes() == [2, 3]
    assert mirror.apply([BlockOps(stored=[4, 2, 5])]) == [3]  # 2 stored again: not the oldest
    assert mirror.hashes() == [4, 2, 5]
    assert mirror.apply([BlockOps(cleared=True, stored=[9])]) == []
    assert mirror.hashes() == [9]


def test_a_prompts_first_block_is_known_from_its_event_and_kept_for_rewrites() -> None:
    ops = to_ops([stored(1, 2), stored(3, parent=2), stored(7)])
    assert [op.first_blocks for op in ops] == [[1], (), [7]]
    mirror = BlockMirror(max_blocks=4)
    mirror.apply(ops)
    assert sorted(mirror.first_blocks()) == [1, 7]
    mirror.apply([BlockOps(removed=[7]), BlockOps(stored=[8, 9], starts_prompt=False)])
    assert mirror.first_blocks() == []  # 7 removed; 1 dropped as the oldest beyond 4 blocks


def _encode(event: Any) -> bytes:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[event]))


def _true_when(check: Any) -> Any:
    async def predicate() -> bool:
        return bool(check())

    return predicate


class WorkerSettingsForTest(WorkerSettings):
    @property
    def role(self) -> Literal["prefill", "decode"]:
        return "prefill"


def engine_info() -> EngineInfo:
    return EngineInfo(model="m", served_model_name=M, block_size=128, max_model_len=2048,
                      num_kv_blocks=1000, dtype="float32", kv_connector="PdserveConnector",
                      kv_compat={})  # fmt: skip


def _true_when_async(check: Any) -> Any:
    async def predicate() -> bool:
        try:
            return bool(await check())
        except Exception:
            return False

    return predicate


async def _registered(store: RedisStore) -> bool:
    return W in [record.worker_id for record in await store.alive_workers()]


async def _count(store: RedisStore, hashes: list[int], want: int) -> bool:
    try:
        return (await store.longest_prefixes(M, hashes, [W]))[W] == want
    except Exception:
        return False


def test_a_lora_adapters_blocks_are_indexed_under_their_own_hashes() -> None:
    """vLLM's hashes of an adapter's blocks name the adapter (tests/unit/test_block_hashes.py):
    the index holds them as any, and a lookup finds them only for the same adapter."""
    from vllm.distributed.kv_events import BlockStored

    lora = BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=[],
                       block_size=128, lora_id=1, medium="GPU", lora_name="colors")  # fmt: skip
    (ops,) = to_ops([lora])
    assert ops.stored == [7, 8] and ops.starts_prompt
