"""Gateway start-up: it listens before it knows its workers, and a registry that never
answers cannot keep it from starting (the first discovery pass is bounded)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from gateway.config import GatewaySettings
from gateway.discovery import RegistryDiscovery
from gateway.server import GatewayServer
from pdserve.kvindex.interfaces import WorkerRecord
from tests.helpers import model_dir, tokenizer

HANG_GUARD_S = 60.0  # far above the bound: only a hang reaches it


class StuckRegistry:
    """A registry whose ``alive_workers`` blocks until ``release`` is set (never, if not)."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def announce(self, record: WorkerRecord, ttl_s: float) -> None:
        pass

    async def withdraw(self, worker_id: str) -> None:
        pass

    async def registry_epoch(self) -> str:
        return "stuck"

    async def alive_workers(self) -> list[WorkerRecord]:
        self.asked.set()
        await self.release.wait()
        return []


@asynccontextmanager
async def gateway_with(registry: StuckRegistry) -> AsyncIterator[GatewayServer]:
    settings = GatewaySettings(
        http_host="127.0.0.1", http_port=0, grpc_port=0, model=model_dir(),
        redis_url="redis://127.0.0.1:1/0", discovery_interval_s=3600, control_timeout_s=0.5,
    )  # fmt: skip
    gateway = GatewayServer(settings, tokenizer=tokenizer())
    assert gateway.store is not None
    await gateway.store.close()
    gateway.discovery = RegistryDiscovery(gateway.pool, registry, settings.discovery_interval_s)
    try:
        yield gateway
    finally:
        registry.release.set()
        await gateway.stop(grace_s=0)


async def test_the_gateway_listens_while_its_first_discovery_is_still_running() -> None:
    registry = StuckRegistry()
    async with gateway_with(registry) as gateway:
        starting = asyncio.create_task(gateway.start())
        await asyncio.wait_for(registry.asked.wait(), HANG_GUARD_S)
        # Discovery has begun and not finished: HTTP already answers (no worker yet: 503).
        assert gateway.http_port and gateway.grpc_port
        async with httpx.AsyncClient() as client:
            reply = await client.get(f"http://127.0.0.1:{gateway.http_port}/health")
        assert reply.status_code == 503 and reply.json()["healthy_decode_workers"] == 0
        assert not starting.done()
        registry.release.set()
        await asyncio.wait_for(starting, HANG_GUARD_S)


async def test_a_registry_that_never_answers_does_not_stop_the_start() -> None:
    registry = StuckRegistry()
    async with gateway_with(registry) as gateway:
        await asyncio.wait_for(gateway.start(), HANG_GUARD_S)
        assert registry.asked.is_set() and not registry.release.is_set()
        async with httpx.AsyncClient() as client:
            reply = await client.get(f"http://127.0.0.1:{gateway.http_port}/health")
        assert reply.status_code == 503


async def test_the_gateway_is_unready_until_vllms_front_end_can_render(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's front end builds while the gateway already listens: /health and gRPC health
    say not ready (the body: renderer "starting") until it can render, then ready."""
    import threading

    from gateway import service as service_module
    from pdserve.bench.fake_worker import FakeDecode, start_worker

    built = threading.Event()
    real = service_module.shared_renderer

    def slow(model: str, args: list[str]) -> object:
        built.wait(HANG_GUARD_S)
        return real(model, args)

    monkeypatch.setattr(service_module, "shared_renderer", slow)
    worker = await start_worker(FakeDecode())
    settings = GatewaySettings(
        http_host="127.0.0.1", http_port=0, grpc_port=0, model=model_dir(),
        decode_workers=[f"127.0.0.1:{worker.port}"], control_timeout_s=1.0,
    )  # fmt: skip
    gateway = GatewayServer(settings, tokenizer=tokenizer())
    starting = asyncio.create_task(gateway.start())
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            while not gateway.http_port or not gateway.pool.healthy_decode():
                await asyncio.sleep(0.05)
            url = f"http://127.0.0.1:{gateway.http_port}/health"
            waiting = await http.get(url)
            assert waiting.status_code == 503, waiting.text
            assert waiting.json()["renderer"] == "starting"
            assert not starting.done()
            built.set()
            await asyncio.wait_for(starting, HANG_GUARD_S)
            ready = await http.get(url)
        assert ready.status_code == 200 and ready.json()["renderer"] == "ready"
    finally:
        built.set()
        await asyncio.gather(starting, return_exceptions=True)
        await gateway.stop(grace_s=0)
        await worker.stop(0)
