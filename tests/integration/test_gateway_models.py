"""Several base models behind one gateway (``gateway.models``), against fake workers found in
a real redis-server: each model has its own prefill and decode pool, discovered by the model
name its workers serve; a request goes to the pool of its ``model`` (none: the first model),
an adapter's to the pool of the base model whose workers serve it; ``/v1/models`` lists every
base model and its adapters; a name nobody serves is vLLM's 404; ``/health`` counts each
model's workers. The real engines' answers are the e2e tier's (tests/e2e/test_models.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest

from gateway.config import GatewaySettings
from gateway.server import GatewayServer
from pdserve.bench.fake_worker import FakeDecode, FakePrefill, start_worker
from pdserve.cluster.redis_server import RedisServer
from pdserve.kvindex.interfaces import WorkerRecord
from pdserve.kvindex.redis_store import RedisStore
from protos.v1 import generate_pb2
from tests.helpers import REQUESTS, counted, metrics_text, model_dir, served_name, tokenizer
from tests.integration.test_gateway_grpc import _generate

SECOND = "second-model"
ADAPTER = "second-colors"


@dataclass
class Fleet:
    gateway: GatewayServer
    fakes: dict[str, FakePrefill | FakeDecode]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"

    def served(self, name: str) -> int:
        return len(self.fakes[name].seen.requests)


@asynccontextmanager
async def two_models(redis_url: str, shared: str = "", **overrides: Any) -> AsyncIterator[Fleet]:
    """A gateway serving the default model and ``SECOND`` (the same directory under another
    name), each with one fake prefill and one fake decode worker announced in Redis, and one
    decode worker of a model the gateway does not serve. ``shared``: a static LoRA adapter of
    that name on every worker of both models."""
    fakes: dict[str, FakePrefill | FakeDecode] = {
        "p-a": FakePrefill(cached_tokens=0), "d-a": FakeDecode(),
        "p-b": FakePrefill(cached_tokens=0), "d-b": FakeDecode(), "d-x": FakeDecode(),
    }  # fmt: skip
    models = {"a": served_name(), "b": SECOND, "x": "nobody-serves-it"}
    store = RedisStore(redis_url, timeout_s=5.0)
    servers = []
    try:
        for name, fake in fakes.items():
            fake.caps.worker_id = name
            fake.caps.served_model_name = models[name[-1]]
            if shared and name[-1] in "ab":
                fake.caps.lora_adapters.add(name=shared, path=f"/adapters/{name[-1]}", rank=8)
            server = await start_worker(fake)
            servers.append(server)
            role = "prefill" if name.startswith("p") else "decode"
            address = f"127.0.0.1:{server.port}"
            record = WorkerRecord(name, role, address, f"e-{name}", models[name[-1]], 16)
            await store.announce(record, ttl_s=60)
        settings = GatewaySettings(
            http_host="127.0.0.1", http_port=0, grpc_port=0, model=model_dir(),
            redis_url=redis_url, discovery_interval_s=0.1, disagg_min_uncached_tokens=0,
            extra_models=[f"{SECOND}={model_dir()}"], **overrides,
        )  # fmt: skip
        gateway = GatewayServer(settings, tokenizer=tokenizer())
        await gateway.start()
        try:
            yield Fleet(gateway, fakes)
        finally:
            await gateway.stop(grace_s=0)
    finally:
        await store.close()
        for server in servers:
            await server.stop(0)


async def _until_healthy(base_url: str, decode: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base_url) as http:
        for _ in range(200):
            body: dict[str, Any] = (await http.get("/health")).json()
            if body["healthy_decode_workers"] == decode:
                return body
            await asyncio.sleep(0.05)
    raise AssertionError(f"never {decode} healthy decode workers: {body}")


async def _chat(base_url: str, model: str | None, path: str = "/v1/chat/completions") -> Any:
    body: dict[str, Any] = {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    if path == "/v1/completions":
        body = {"max_tokens": 4, "prompt": "Hi"}
    if model is not None:
        body["model"] = model
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        return await http.post(path, json=body)


async def test_each_model_is_served_by_its_own_pool(redis_server: RedisServer) -> None:
    async with two_models(redis_server.url) as fleet:
        health = await _until_healthy(fleet.base_url, 2)
        async with httpx.AsyncClient(base_url=fleet.base_url) as http:
            models = (await http.get("/v1/models")).json()["data"]
        first = await _chat(fleet.base_url, served_name())
        second = await _chat(fleet.base_url, SECOND)
        default = await _chat(fleet.base_url, None, "/v1/completions")
        second_text = await _chat(fleet.base_url, SECOND, "/v1/completions")
        unknown = await _chat(fleet.base_url, "nobody-serves-it")
        served = {name: fleet.served(name) for name in fleet.fakes}
        metrics = await metrics_text(fleet.base_url)
    assert [(m["id"], m["parent"]) for m in models] == [(served_name(), None), (SECOND, None)]
    assert all(m["max_model_len"] > 0 for m in models)
    assert first.status_code == second.status_code == default.status_code == 200, second.text
    assert (first.json()["model"], second.json()["model"]) == (served_name(), SECOND)
    assert second_text.json()["model"] == SECOND
    # each request prefilled and decoded by its model's workers only
    assert served == {"p-a": 2, "d-a": 2, "p-b": 2, "d-b": 2, "d-x": 0}
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    # the gateway's request metrics per model
    models_ok = (served_name(), SECOND)
    by_model = {model: counted(metrics, REQUESTS, model=model, outcome="ok") for model in models_ok}
    assert by_model == {served_name(): 2, SECOND: 2}
    # the unknown model's 404, counted once, under the first model (whose service answered it)
    assert counted(metrics, REQUESTS, model=served_name(), path="none", outcome="invalid") == 1
    assert counted(metrics, REQUESTS) == 5
    ttft = "pdserve_gateway_time_to_first_token_seconds_count"
    assert counted(metrics, ttft, model=SECOND) == 2
    assert health["models"] == {
        served_name(): {"healthy_decode_workers": 1, "healthy_prefill_workers": 1},
        SECOND: {"healthy_decode_workers": 1, "healthy_prefill_workers": 1},
    }
    refused = health["refused_workers"]
    assert [r["reason"] for r in refused] == [
        f"serves model 'nobody-serves-it', the gateway serves {served_name()!r}"
    ]


async def test_grpc_routes_by_model_and_lists_every_model(
    redis_server: RedisServer,
) -> None:
    async with two_models(redis_server.url) as fleet:
        await _until_healthy(fleet.base_url, 2)
        target = f"127.0.0.1:{fleet.gateway.grpc_port}"
        request = generate_pb2.GenerateRequest(model=SECOND, text="Hi")
        request.params.max_tokens = 3
        messages, _ = await _generate(target, request)
        listed = await _list_models(target)
    assert messages[-1].finish_reason == "length"
    assert (fleet.served("d-b"), fleet.served("d-a")) == (1, 0)
    assert listed == [served_name(), SECOND]


async def _list_models(target: str) -> list[str]:
    import grpc

    from protos.v1 import generate_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        reply = await stub.ListModels(generate_pb2.ListModelsRequest())
    return [m.id for m in reply.models]


async def test_an_adapter_belongs_to_the_base_model_whose_workers_serve_it(
    redis_server: RedisServer,
) -> None:
    async with two_models(redis_server.url, allow_runtime_lora_updating=True) as fleet:
        await _until_healthy(fleet.base_url, 2)
        async with httpx.AsyncClient(base_url=fleet.base_url, timeout=60) as http:
            load = {"lora_name": ADAPTER, "lora_path": "/a/b", "base_model_name": SECOND}
            loaded = await http.post("/v1/load_lora_adapter", json=load)
            models = (await http.get("/v1/models")).json()["data"]
            bad = {"lora_name": "x", "lora_path": "/a/b", "base_model_name": "no-such-base"}
            unknown_base = await http.post("/v1/load_lora_adapter", json=bad)
            twice = {"lora_name": ADAPTER, "lora_path": "/a/b"}  # on the first model as well
            on_both = await http.post("/v1/load_lora_adapter", json=twice)
        adapted = await _chat(fleet.base_url, ADAPTER)
        lora = [r.params.lora_name for r in fleet.fakes["d-b"].seen.requests]
    assert loaded.status_code == 200, loaded.text
    names = {name: [a.name for a in f.caps.lora_adapters] for name, f in fleet.fakes.items()}
    assert names == {"p-a": [], "d-a": [], "p-b": [ADAPTER], "d-b": [ADAPTER], "d-x": []}
    assert [(m["id"], m["parent"]) for m in models] == [
        (served_name(), None), (SECOND, None), (ADAPTER, SECOND)
    ]  # fmt: skip
    assert unknown_base.status_code == 404
    assert unknown_base.json()["error"]["param"] == "base_model_name"
    assert on_both.status_code == 400 and f"an adapter of the model `{SECOND}`" in on_both.text
    assert adapted.status_code == 200 and adapted.json()["model"] == ADAPTER
    assert lora == [ADAPTER] and fleet.served("d-a") == 0


async def test_an_adapter_name_two_base_models_serve_is_refused_naming_both(
    redis_server: RedisServer,
) -> None:
    async with two_models(redis_server.url, shared="colors") as fleet:
        await _until_healthy(fleet.base_url, 2)
        reply = await _chat(fleet.base_url, "colors")
        base = await _chat(fleet.base_url, SECOND)
        request = generate_pb2.GenerateRequest(model="colors", text="Hi")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _generate(f"127.0.0.1:{fleet.gateway.grpc_port}", request)
        served = {name: fleet.served(name) for name in fleet.fakes}
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "model"
    assert f"base models (`{served_name()}`, `{SECOND}`)" in error["message"]
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    # nothing went to either model's workers for it; a base model's request still does
    assert base.status_code == 200
    assert served == {"p-a": 0, "d-a": 0, "p-b": 1, "d-b": 1, "d-x": 0}


def test_several_models_need_the_registry() -> None:
    with pytest.raises(ValueError, match="needs redis_url"):
        GatewaySettings(model=model_dir(), extra_models=[f"{SECOND}={model_dir()}"])


@pytest.mark.parametrize(
    ("extra", "error"),
    [(["no-equals-sign"], "is not name=dir"), ([f"{SECOND}=/a", f"{SECOND}=/b"], "served twice")],
)
def test_extra_models_are_checked(extra: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        settings = GatewaySettings(model=model_dir(), redis_url="redis://x", extra_models=extra)
        settings.served_models()
