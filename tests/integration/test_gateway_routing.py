"""Registry discovery and cache-aware routing: a real gateway, fake workers (scripted), and a
real redis-server holding the registry and the prefix index."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from gateway.config import GatewaySettings
from gateway.server import GatewayServer
from pdserve.bench.fake_worker import FakeDecode, FakePrefill, start_worker
from pdserve.cluster.redis_server import RedisServer
from pdserve.kvindex.hashing import block_hashes
from pdserve.kvindex.interfaces import BlockOps, WorkerRecord
from pdserve.kvindex.redis_store import RedisStore
from pdserve.rpc.server import GrpcServer
from tests.helpers import counted, metrics_text, model_dir, served_name, tokenizer

BLOCK = 16  # the fakes' block size
TIER_CHUNK = 2 * BLOCK
TIER = "redis:127.0.0.1:6379/1"


@dataclass
class Fleet:
    gateway: GatewayServer
    store: RedisStore
    prefill: dict[str, FakePrefill]
    decode: dict[str, FakeDecode]
    servers: dict[str, GrpcServer]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"

    def record(self, name: str) -> WorkerRecord:
        role = "prefill" if name in self.prefill else "decode"
        address = f"127.0.0.1:{self.servers[name].port}"
        return WorkerRecord(name, role, address, f"epoch-{name}", served_name(), BLOCK)

    async def announce(self, *names: str) -> None:
        for name in names:
            await self.store.announce(self.record(name), ttl_s=60)

    async def until(self, prefill: int, decode: int) -> None:
        async with httpx.AsyncClient() as client:
            for _ in range(100):
                body = (await client.get(self.url + "/health")).json()
                if (body["healthy_prefill_workers"], body["healthy_decode_workers"]) == (
                    prefill, decode,
                ):  # fmt: skip
                    return
                await asyncio.sleep(0.05)
        raise AssertionError(f"pool never reached {prefill} prefill / {decode} decode: {body}")


@asynccontextmanager
async def fleet(redis_url: str, prefill: list[str], decode: list[str], tier: str = "",
                **overrides: object) -> AsyncIterator[Fleet]:  # fmt: skip
    """``tier``: every worker reports this shared KV tier, in chunks of ``TIER_CHUNK``."""
    fakes_p = {name: FakePrefill(cached_tokens=0) for name in prefill}
    fakes_d = {name: FakeDecode() for name in decode}
    servers = {}
    fakes: list[tuple[str, FakePrefill | FakeDecode]] = [*fakes_p.items(), *fakes_d.items()]
    for name, fake in fakes:
        fake.caps.worker_id = name
        fake.caps.kv_tier = tier
        fake.caps.kv_tier_chunk_tokens = TIER_CHUNK if tier else 0
        servers[name] = await start_worker(fake)
    settings = GatewaySettings(
        http_host="127.0.0.1", http_port=0, grpc_port=0, model=model_dir(), redis_url=redis_url,
        discovery_interval_s=0.1, **{"disagg_min_uncached_tokens": 0, **overrides},  # type: ignore[arg-type]
    )  # fmt: skip
    gateway = GatewayServer(settings, tokenizer=tokenizer())
    store = RedisStore(redis_url, timeout_s=5.0)
    result = Fleet(gateway, store, fakes_p, fakes_d, servers)
    await result.announce(*servers)
    await gateway.start()
    try:
        await result.until(len(prefill), len(decode))
        yield result
    finally:
        await gateway.stop(grace_s=0)
        await store.close()
        for server in servers.values():
            await server.stop(0)


def prompt_ids(text: str) -> list[int]:
    return list(tokenizer().encode_text(text))


async def complete(url: str, prompt: list[int]) -> httpx.Response:
    body = {"model": served_name(), "prompt": prompt, "max_tokens": 4}
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(url + "/v1/completions", json=body)


async def test_workers_are_discovered_ejected_and_admitted_while_running(
    redis_server: RedisServer,
) -> None:
    async with fleet(redis_server.url, ["p-a", "p-b"], ["d-0"]) as f:
        await f.store.withdraw("p-b")  # leaves (or its heartbeat expires)
        await f.until(prefill=1, decode=1)
        for _ in range(4):
            assert (await complete(f.url, prompt_ids("hello there"))).status_code == 200
        assert not f.prefill["p-b"].seen.requests
        await f.announce("p-b")
        await f.until(prefill=2, decode=1)


async def test_a_request_goes_to_the_prefill_worker_holding_its_prefix(
    redis_server: RedisServer,
) -> None:
    async with fleet(redis_server.url, ["p-a", "p-b"], ["d-0"]) as f:
        ids = prompt_ids("The history of the river begins in the mountains " * 8)
        hashes = block_hashes(ids, BLOCK, seed=42)
        assert len(hashes) >= 4
        await f.store.apply(served_name(), "p-b", [BlockOps(stored=hashes[:3])])
        await f.store.apply(served_name(), "p-a", [BlockOps(stored=hashes[:1])])
        f.prefill["p-b"].cached_tokens = 3 * BLOCK  # what its engine will report
        for _ in range(3):
            reply = await complete(f.url, ids)
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-pdserve-prefill-worker"] == "p-b"
            assert reply.headers["x-pdserve-decode-worker"] == "d-0"
        assert len(f.prefill["p-b"].seen.requests) == 3 and not f.prefill["p-a"].seen.requests
        metrics = await metrics_text(f.url)
        assert 'pdserve_gateway_prefix_predictions_total{result="exact"} 3.0' in metrics
        assert (
            'pdserve_gateway_routing_decisions_total{path="disaggregated",picker="prefix"} 3.0'
            in metrics
        )


async def test_short_uncached_part_is_computed_by_the_decode_worker(
    redis_server: RedisServer,
) -> None:
    async with fleet(
        redis_server.url,
        ["p-a"],
        ["d-0"],
    ) as f:
        f.gateway.settings.__dict__["disagg_min_uncached_tokens"] = 2 * BLOCK
        ids = prompt_ids("A conversation that the decode worker already holds. " * 6)
        hashes = block_hashes(ids, BLOCK, seed=42)
        await f.store.apply(served_name(), "d-0", [BlockOps(stored=hashes)])
        reply = await complete(f.url, ids)
        assert reply.status_code == 200
        assert reply.headers["x-pdserve-prefill-worker"] == "local"
        assert not f.prefill["p-a"].seen.requests
        assert not f.decode["d-0"].seen.requests[-1].HasField("kv_transfer_params")
        # an unknown prompt is long and uncached: it is disaggregated
        other = prompt_ids("Completely different words about mountains and lakes. " * 6)
        reply = await complete(f.url, other)
        assert reply.headers["x-pdserve-prefill-worker"] == "p-a"


async def test_routing_headers_can_be_turned_off(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, ["p-a"], ["d-0"], routing_headers=False) as f:
        reply = await complete(f.url, prompt_ids("hello"))
        assert reply.status_code == 200
        assert not any(h.startswith("x-pdserve-") for h in reply.headers)


async def test_killing_redis_during_a_load_test_fails_no_request(
    redis_server: RedisServer,
) -> None:
    async with fleet(redis_server.url, ["p-a", "p-b"], ["d-0"]) as f:
        ids = prompt_ids("Load test prompt with enough words to fill blocks. " * 4)

        async def wave() -> list[int]:
            replies = await asyncio.gather(*(complete(f.url, ids) for _ in range(20)))
            return [r.status_code for r in replies]

        statuses = await wave()
        redis_server.stop()
        statuses += await wave()
        await asyncio.sleep(0.5)  # discovery notices; the pool keeps its workers
        statuses += await wave()
        redis_server.start()  # empty: no worker has announced itself again yet
        await asyncio.sleep(0.5)  # discovery reads the empty registry: the pool keeps them
        statuses += await wave()
        assert statuses == [200] * 80
        metrics = await metrics_text(f.url)
        errors = [line for line in metrics.splitlines()
                  if line.startswith("pdserve_gateway_prefix_index_errors_total")]  # fmt: skip
        assert errors and float(errors[0].split()[-1]) > 0


async def tier_blocks(f: Fleet, hashes: list[int], expected: int) -> int:
    """The tier's leading blocks of ``hashes`` in Redis, once they reach ``expected`` (the
    gateway writes them in the background) or after a while."""
    holder = "tier:" + TIER
    for _ in range(100):
        held = (await f.store.longest_prefixes(served_name(), hashes, [holder]))[holder]
        if held == expected:
            break
        await asyncio.sleep(0.02)
    return held


async def test_a_prompt_in_the_shared_tier_is_predicted_for_every_worker_and_corrected(
    redis_server: RedisServer,
) -> None:
    async with fleet(redis_server.url, ["p-a", "p-b"], ["d-0"], tier=TIER) as f:
        ids = prompt_ids("The tier keeps what one worker computed for all of them. " * 8)
        hashes = block_hashes(ids, BLOCK, seed=42)
        whole = len(ids) // TIER_CHUNK * TIER_CHUNK
        assert whole >= 2 * TIER_CHUNK
        first = await complete(f.url, ids)  # computed from scratch: the tier gets its chunks
        assert first.status_code == 200, first.text
        assert await tier_blocks(f, hashes, whole // BLOCK) == whole // BLOCK
        for fake in f.prefill.values():  # what LMCache serves either worker now
            fake.cached_tokens = whole
        workers = set()
        for _ in range(2):  # no worker holds the prompt itself: the tier makes them equal
            reply = await complete(f.url, ids)
            workers.add(reply.headers["x-pdserve-prefill-worker"])
        assert workers == {"p-a", "p-b"}
        metrics = await metrics_text(f.url)
        assert counted(metrics, "pdserve_gateway_predicted_cached_tokens_total") == 2 * whole
        assert 'pdserve_gateway_prefix_predictions_total{result="exact"} 3.0' in metrics
        # The tier evicted all but its first chunk: the prediction is corrected once.
        for fake in f.prefill.values():
            fake.cached_tokens = TIER_CHUNK
        assert (await complete(f.url, ids)).status_code == 200
        assert await tier_blocks(f, hashes, TIER_CHUNK // BLOCK) == TIER_CHUNK // BLOCK
        assert (await complete(f.url, ids)).status_code == 200
        metrics = await metrics_text(f.url)
        assert counted(metrics, "pdserve_gateway_tier_index_corrections_total") == 1
        assert 'pdserve_gateway_prefix_predictions_total{result="over"} 1.0' in metrics
        assert 'pdserve_gateway_prefix_predictions_total{result="exact"} 4.0' in metrics


async def test_a_decode_worker_computing_the_prompt_writes_nothing_to_its_tier(
    redis_server: RedisServer,
) -> None:
    """A decode worker's LMCache (vLLM role kv_consumer) retrieves but never stores: a prompt
    it computed itself (the local path) is not in the tier, and the index must not say so."""
    async with fleet(redis_server.url, ["p-a"], ["d-0"], tier=TIER,
                     disagg_min_uncached_tokens=10_000) as f:  # fmt: skip
        ids = prompt_ids("Short enough to be computed where it is decoded. " * 6)
        hashes = block_hashes(ids, BLOCK, seed=42)
        whole = len(ids) // TIER_CHUNK * TIER_CHUNK
        assert whole
        reply = await complete(f.url, ids)
        assert reply.headers["x-pdserve-prefill-worker"] == "local"
        assert await tier_blocks(f, hashes, whole // BLOCK) == 0
        assert not f.prefill["p-a"].seen.requests
