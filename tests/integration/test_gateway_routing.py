"""Registry discovery and cache-aware routing: a real gateway, fake workers (scripted), and a
real redis-server holding the registry and the prefix index."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest

from gateway.config import GatewaySettings
from gateway.server import GatewayServer
from pdserve.fake_worker import FakeDecode, FakePrefill, start_worker
from pdserve.grpc_server import GrpcServer
from pdserve.kvindex.hashing import block_hashes
from pdserve.kvindex.interfaces import BlockOps, WorkerRecord
from pdserve.kvindex.redis_store import RedisStore
from pdserve.redis_server import RedisServer
from tests.helpers import model_dir, served_name, tokenizer

BLOCK = 16  # the fakes' block size


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


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
async def fleet(redis_url: str, prefill: list[str], decode: list[str], **overrides: object
                ) -> AsyncIterator[Fleet]:  # fmt: skip
    fakes_p = {name: FakePrefill(cached_tokens=0) for name in prefill}
    fakes_d = {name: FakeDecode() for name in decode}
    servers = {}
    fakes: list[tuple[str, FakePrefill | FakeDecode]] = [*fakes_p.items(), *fakes_d.items()]
    for name, fake in fakes:
        fake.caps.worker_id = name
        servers[name] = await start_worker(fake)
    settings = GatewaySettings(
        http_host="127.0.0.1", http_port=0, grpc_port=0, model=model_dir(), redis_url=redis_url,
        discovery_interval_s=0.1, **{"disagg_min_uncached_tokens": 0, **overrides},  # type: ignore[arg-type]
    )  # fmt: skip
    gateway = GatewayServer(settings, tokenizer=tokenizer())
    store = RedisStore(redis_url, timeout_s=0.5)
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


async def metrics_text(url: str) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(url + "/metrics")).text


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
