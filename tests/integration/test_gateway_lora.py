"""LoRA adapters through the gateway against fake workers: the workers' adapters (their
capabilities) are models of the gateway (``/v1/models`` lists them with their ``parent``, as
vLLM does); a request for one carries its name to the prefill and the decode worker and goes
only to workers that serve it at the same path, a base request carries none; an unknown name is
vLLM's 404. The real adapter's output, compared with ``vllm serve --enable-lora``, is the e2e
tier's (tests/e2e/test_lora.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from pdserve.bench.fake_worker import FakeDecode, FakePrefill, start_worker
from protos.v1 import common_pb2, generate_pb2
from tests.helpers import gateway_cluster, served_name
from tests.integration.test_gateway_grpc import _generate

ADAPTER = "colors"
PATH = "/adapters/colors"


def serving(worker: Any, path: str = PATH) -> Any:
    worker.caps.lora_adapters.add(name=ADAPTER, path=path, rank=8)
    return worker


@asynccontextmanager
async def running(*fakes: Any) -> AsyncIterator[list[str]]:
    """``fakes`` served on free ports while the block runs; yields their addresses."""
    servers = [await start_worker(w) for w in fakes]
    try:
        yield [f"127.0.0.1:{s.port}" for s in servers]
    finally:
        for server in servers:
            await server.stop(0)


async def _chat(base_url: str, model: str, **body: Any) -> httpx.Response:
    request = {"model": model, "messages": [{"role": "user", "content": "Hi"}], **body}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        return await http.post("/v1/chat/completions", json={"max_tokens": 4, **request})


async def test_an_adapter_is_a_model_whose_name_reaches_both_workers() -> None:
    prefill, decode = serving(FakePrefill()), serving(FakeDecode())
    async with gateway_cluster(prefill=prefill, decode=decode) as c:
        async with httpx.AsyncClient(base_url=c.base_url, timeout=60) as http:
            models = (await http.get("/v1/models")).json()["data"]
        adapted = await _chat(c.base_url, ADAPTER)
        base = await _chat(c.base_url, served_name())
        unknown = await _chat(c.base_url, "no-such-adapter")
    assert [(m["id"], m["parent"], m["root"]) for m in models[1:]] == [
        (ADAPTER, served_name(), PATH)
    ]
    assert models[0]["id"] == served_name() and models[0]["parent"] is None
    assert models[1]["max_model_len"] is None  # as vLLM lists an adapter
    assert adapted.status_code == 200, adapted.text
    assert adapted.json()["model"] == ADAPTER and base.json()["model"] == served_name()
    names = [r.params.lora_name for r in prefill.seen.requests]
    assert names == [ADAPTER, ""]
    assert [r.params.lora_name for r in decode.seen.requests] == [ADAPTER, ""]
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


async def test_adapter_requests_go_only_to_workers_serving_it_at_its_path() -> None:
    holder, other, elsewhere = serving(FakeDecode()), FakeDecode(), serving(FakeDecode(), "/x")
    async with (
        running(other, elsewhere) as extra,
        gateway_cluster(prefill=serving(FakePrefill()), decode=holder, extra_decode=extra) as c,
    ):
        adapted = [await _chat(c.base_url, ADAPTER) for _ in range(6)]
        base = [await _chat(c.base_url, served_name()) for _ in range(6)]
    assert all(r.status_code == 200 for r in adapted + base)
    assert [r.params.lora_name for r in holder.seen.requests].count(ADAPTER) == 6
    assert all(not r.params.lora_name for w in (other, elsewhere) for r in w.seen.requests)
    # the base model's requests still use every worker
    assert other.seen.requests and elsewhere.seen.requests


async def test_adapter_requests_prefer_workers_where_the_adapter_is_resident() -> None:
    """Two prefill and two decode workers serve the adapter; one of each reports it resident
    in its engine's LoRA cache (the others would load it first): the adapter's requests go
    there, the base model's to both (gateway.routing.prefix, lora_residency_weight)."""
    holders = serving(FakePrefill()), serving(FakeDecode())
    others = serving(FakePrefill()), serving(FakeDecode())
    for worker in holders:
        worker.caps.resident_lora_adapters.append(ADAPTER)
    async with (
        running(*others) as (other_prefill, other_decode),
        gateway_cluster(
            prefill=holders[0],
            decode=holders[1],
            extra_prefill=[other_prefill],
            extra_decode=[other_decode],
            picker="prefix",  # the default with Redis, which has no part in this
        ) as c,
    ):
        adapted = [await _chat(c.base_url, ADAPTER) for _ in range(6)]
        base = [await _chat(c.base_url, served_name()) for _ in range(6)]
    assert all(r.status_code == 200 for r in adapted + base)
    for holder, other in zip(holders, others, strict=True):
        assert [r.params.lora_name for r in holder.seen.requests].count(ADAPTER) == 6
        assert [r.params.lora_name for r in other.seen.requests if r.params.lora_name] == []
        assert other.seen.requests, "the base model's requests still use every worker"


async def test_without_a_worker_serving_the_adapter_no_request_is_served_with_the_base() -> None:
    """The adapter is known (a decode worker reports it), but that worker is gone."""
    gone = serving(FakeDecode())
    server = await start_worker(gone)
    async with gateway_cluster(
        prefill=serving(FakePrefill()),
        decode=FakeDecode(),
        extra_decode=[f"127.0.0.1:{server.port}"],
        health_interval_s=0.2,
    ) as c:
        assert (await _chat(c.base_url, ADAPTER)).status_code == 200
        await server.stop(0)
        codes = []
        for _ in range(100):
            reply = await _chat(c.base_url, ADAPTER)
            codes.append(reply.status_code)
            if reply.status_code == 404:
                break
        base = c.decode.seen.requests if c.decode else []
    # the request on the dying worker fails (503: no other worker serves the adapter); once
    # the worker is out, no healthy worker has the adapter: no such model
    assert set(codes) <= {503, 404} and codes[-1] == 404, codes
    assert all(not r.params.lora_name for r in base)


async def test_grpc_names_the_adapter_by_model_and_a_clients_own_lora_name_is_ignored() -> None:
    decode = serving(FakeDecode())
    async with gateway_cluster(prefill=serving(FakePrefill()), decode=decode) as c:
        params = common_pb2.SamplingParams(max_tokens=2, lora_name=ADAPTER)
        base = generate_pb2.GenerateRequest(model=served_name(), text="Hi", params=params)
        await _generate(c.grpc_target, base)
        await _generate(c.grpc_target, generate_pb2.GenerateRequest(model=ADAPTER, text="Hi"))
    assert [r.params.lora_name for r in decode.seen.requests] == ["", ADAPTER]


async def test_a_migration_stays_among_the_workers_serving_the_adapter() -> None:
    """The adapter's decode worker dies mid-stream: its continuation moves to the other worker
    serving the adapter, though a worker without it comes first and is as idle."""
    dying = serving(FakeDecode(positional=True, fail_after=1))
    without, holder = FakeDecode(positional=True), serving(FakeDecode(positional=True))
    async with (
        running(without, holder) as extra,
        gateway_cluster(
            prefill=serving(FakePrefill()),
            decode=dying,
            extra_decode=extra,
            retry_backoff_s=0.01,
        ) as c,
    ):
        # route the first call to the dying worker: the others look busy for a moment
        for worker in c.gateway.pool.decode[1:]:
            worker.in_flight += 10
        reply = await _chat(c.base_url, ADAPTER, max_tokens=6)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 6
    assert dying.seen.requests and not without.seen.requests
    (moved,) = holder.seen.requests
    assert moved.params.lora_name == ADAPTER


async def _admin(base_url: str, action: str, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        return await http.post(f"/v1/{action}_lora_adapter", json=body)


async def test_an_adapter_loaded_and_unloaded_at_run_time_on_every_worker() -> None:
    prefill, decode = FakePrefill(), FakeDecode()
    async with gateway_cluster(
        prefill=prefill, decode=decode, allow_runtime_lora_updating=True
    ) as c:
        loaded = await _admin(c.base_url, "load", lora_name="late", lora_path="/a/late")
        again = await _admin(c.base_url, "load", lora_name="late", lora_path="/a/late")
        base = await _admin(c.base_url, "load", lora_name=served_name(), lora_path="/a")
        adapted = await _chat(c.base_url, "late")
        unloaded = await _admin(c.base_url, "unload", lora_name="late")
        gone = await _chat(c.base_url, "late")
        unknown = await _admin(c.base_url, "unload", lora_name="late")
    assert loaded.status_code == 200 and loaded.text == (
        "Success: LoRA adapter 'late' added successfully."
    )
    assert again.status_code == 400 and "has already been loaded" in again.text
    assert base.status_code == 400 and "conflicts with a served base model" in base.text
    assert adapted.status_code == 200 and adapted.json()["model"] == "late"
    assert [r.params.lora_name for r in decode.seen.requests] == ["late"]
    assert [r.params.lora_name for r in prefill.seen.requests] == ["late"]
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    assert gone.status_code == 404 and unknown.status_code == 404
    assert not decode.caps.lora_adapters and not prefill.caps.lora_adapters


async def test_a_worker_that_cannot_load_is_not_routed_the_adapter() -> None:
    refusing, taking = FakeDecode(), FakeDecode()
    refusing.refuse_adapters = True
    server = await start_worker(taking)
    try:
        async with gateway_cluster(
            decode=refusing,
            extra_decode=[f"127.0.0.1:{server.port}"],
            allow_runtime_lora_updating=True,
        ) as c:
            loaded = await _admin(c.base_url, "load", lora_name="late", lora_path="/a/late")
            replies = [await _chat(c.base_url, "late") for _ in range(4)]
    finally:
        await server.stop(0)
    assert loaded.status_code == 503, loaded.text
    assert "1 of 3 workers could not load" in loaded.json()["error"]["message"]
    assert all(r.status_code == 200 for r in replies)
    assert len(taking.seen.requests) == 4 and not refusing.seen.requests


async def test_the_run_time_endpoints_need_the_setting() -> None:
    async with gateway_cluster() as c:
        reply = await _admin(c.base_url, "load", lora_name="late", lora_path="/a/late")
    assert reply.status_code == 404
