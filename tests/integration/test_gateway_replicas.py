"""Several gateways that agree: two real gateways on the same fake workers and one real
redis-server. They share their requests in flight (``gateway.shared_load``), so one does not
pile onto the worker the other keeps busy; a burst split across them spreads evenly; and the
turns of one conversation reach the same prefill worker whichever gateway each turn enters."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
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
from tests.helpers import GatedDecode, model_dir, served_name, tokenizer

BLOCK = 16  # the fakes' block size
SHARE_S = 0.05  # load_share_interval_s of both gateways


@dataclass
class Replicas:
    gateways: list[GatewayServer]
    store: RedisStore
    prefill: dict[str, FakePrefill]
    decode: dict[str, FakeDecode]
    servers: dict[str, GrpcServer]

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.gateways[i].http_port}"

    async def announce(self, *names: str) -> None:
        for name in names:
            role = "prefill" if name in self.prefill else "decode"
            address = f"127.0.0.1:{self.servers[name].port}"
            record = WorkerRecord(name, role, address, f"epoch-{name}", served_name(), BLOCK)
            await self.store.announce(record, ttl_s=60)

    async def until(self, prefill: int, decode: int) -> None:
        """Every gateway has this many healthy workers of each role."""
        async with httpx.AsyncClient() as client:
            for i in range(len(self.gateways)):
                for _ in range(200):
                    body = (await client.get(self.url(i) + "/health")).json()
                    got = (body["healthy_prefill_workers"], body["healthy_decode_workers"])
                    if got == (prefill, decode):
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError(f"gateway {i} never saw {prefill}/{decode}: {body}")

    def open_gates(self) -> None:
        for fake in self.decode.values():
            if isinstance(fake, GatedDecode):
                fake.gate.set()


@asynccontextmanager
async def replicas(
    redis_url: str, prefill: list[str], decode: dict[str, FakeDecode], announced: list[str],
    **overrides: object,
) -> AsyncIterator[Replicas]:  # fmt: skip
    """Two gateways on the same Redis; only the ``announced`` workers are registered at first."""
    fakes_p = {name: FakePrefill(cached_tokens=0) for name in prefill}
    servers = {}
    for name, fake in [*fakes_p.items(), *decode.items()]:
        fake.caps.worker_id = name
        servers[name] = await start_worker(fake)
    store = RedisStore(redis_url, timeout_s=5.0)
    result = Replicas([], store, fakes_p, decode, servers)
    await result.announce(*announced)
    settings = GatewaySettings(
        http_host="127.0.0.1", http_port=0, grpc_port=0, model=model_dir(), redis_url=redis_url,
        discovery_interval_s=0.1, disagg_min_uncached_tokens=0,
        **{"load_share_interval_s": SHARE_S, **overrides},  # type: ignore[arg-type]
    )  # fmt: skip
    try:
        for _ in range(2):
            gateway = GatewayServer(settings, tokenizer=tokenizer())
            result.gateways.append(gateway)
            await gateway.start()
        yield result
    finally:
        result.open_gates()
        for gateway in result.gateways:
            await gateway.stop(grace_s=0)
        await store.close()
        for server in servers.values():
            await server.stop(0)


def prompt(i: int) -> list[int]:
    return list(tokenizer().encode_text(f"Request number {i} asks about rivers and lakes."))


async def complete(url: str, ids: list[int]) -> httpx.Response:
    body = {"model": served_name(), "prompt": ids, "max_tokens": 4}
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(url + "/v1/completions", json=body)


def seen(fakes: dict[str, FakeDecode]) -> dict[str, int]:
    return {name: len(fake.seen.requests) for name, fake in fakes.items()}


async def eventually(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Whether ``condition`` holds within ``timeout_s`` (only a hang reaches the bound)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            return condition()
        await asyncio.sleep(0.01)
    return True


async def test_a_gateway_avoids_the_worker_another_gateway_keeps_busy(
    redis_server: RedisServer,
) -> None:
    k = m = 4
    decode: dict[str, FakeDecode] = {"d-x": GatedDecode(free=1), "d-y": GatedDecode(free=1)}
    async with replicas(redis_server.url, ["p-0"], decode, ["p-0", "d-x"]) as r:
        await r.until(prefill=1, decode=1)
        a, b = r.url(0), r.url(1)
        held = [asyncio.create_task(complete(a, prompt(i))) for i in range(k)]
        assert await eventually(lambda: seen(decode)["d-x"] == k)  # A: k streams open on X
        await r.announce("d-y")
        await r.until(prefill=1, decode=2)
        x_at_b = next(w for w in r.gateways[1].pool.decode if w.worker_id == "d-x")
        # B learns A's load within a few intervals (bounded wait; the routing below is checked).
        await eventually(lambda: x_at_b.peer_in_flight == k, timeout_s=10)
        held += [asyncio.create_task(complete(b, prompt(k + i))) for i in range(m)]
        assert await eventually(lambda: sum(seen(decode).values()) == k + m)
        # Fair share: (k + m) / 2 = 4 per worker; X already has A's k = 4, so B's share of
        # X is 0: every one of B's m requests goes to Y.
        assert seen(decode) == {"d-x": k, "d-y": m}
        r.open_gates()
        assert [reply.status_code for reply in await asyncio.gather(*held)] == [200] * (k + m)


async def test_a_burst_split_across_gateways_spreads_evenly(redis_server: RedisServer) -> None:
    per_gateway = 8
    decode: dict[str, FakeDecode] = {f"d-{i}": GatedDecode(free=1) for i in range(4)}
    prefill = ["p-0", "p-1"]
    async with replicas(redis_server.url, prefill, decode, [*prefill, *decode]) as r:
        await r.until(prefill=2, decode=4)
        burst = [
            asyncio.create_task(complete(r.url(i % 2), prompt(i))) for i in range(2 * per_gateway)
        ]
        total = 2 * per_gateway
        assert await eventually(lambda: sum(seen(decode).values()) == total)
        per_decode = seen(decode)
        per_prefill = {name: len(fake.seen.requests) for name, fake in r.prefill.items()}
        r.open_gates()
        assert [reply.status_code for reply in await asyncio.gather(*burst)] == [200] * total
    assert max(per_decode.values()) <= 1.5 * total / len(decode), per_decode
    assert max(per_prefill.values()) <= 1.5 * total / len(prefill), per_prefill


async def test_turns_of_a_conversation_alternating_gateways_reach_one_prefill_worker(
    redis_server: RedisServer,
) -> None:
    conversations, turns = 4, 6
    prefill = ["p-0", "p-1", "p-2"]
    decode: dict[str, FakeDecode] = {"d-0": FakeDecode(), "d-1": FakeDecode()}
    async with replicas(redis_server.url, prefill, decode, [*prefill, *decode]) as r:
        await r.until(prefill=3, decode=2)
        ids = [list(tokenizer().encode_text(f"Conversation {c} begins here. " * 4))
               for c in range(conversations)]  # fmt: skip
        first: dict[int, str] = {}
        later = same = 0
        for t in range(turns):
            for c in range(conversations):
                ids[c] += list(tokenizer().encode_text(f" Turn {t}: tell me more about {c}."))
                reply = await complete(r.url((t + c) % 2), ids[c])  # turns alternate gateways
                assert reply.status_code == 200, reply.text
                worker = reply.headers["x-pdserve-prefill-worker"]
                # What the worker's KV events would write: it now holds the turn's blocks.
                hashes = block_hashes(ids[c], BLOCK, seed=42)
                await r.store.apply(served_name(), worker, [BlockOps(stored=hashes)])
                if t == 0:
                    first[c] = worker
                else:
                    later += 1
                    same += worker == first[c]
        assert len(set(first.values())) > 1  # the conversations did not all start in one place
        assert same >= 0.95 * later, f"{same} of {later} later turns on the first turn's worker"
