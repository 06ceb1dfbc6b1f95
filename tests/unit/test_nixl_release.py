"""Abort, release and lease of NIXL hand-offs: which calls pdserve makes, and what vLLM 0.32's
NixlConnector does with them (its own scheduler code, tests/nixl_stand_in.py).

vLLM's mechanisms (paths under vllm/distributed/kv_transfer/kv_connector/v1/nixl/ unless
they say otherwise):
- a prefill aborted while it runs is never handed off; its blocks are freed at once
  (pull_scheduler.py:235-244);
- a finished prefill's blocks are held for ``kv_lease_duration`` (pull_scheduler.py:246-266),
  renewed by the decode engine's heartbeats (base_scheduler.py:199-238), freed when a decode
  engine's notification arrives or the lease ends (base_worker.py:3014-3062); a finished
  request can no longer be aborted (vllm/v1/core/sched/scheduler.py:2677-2681);
- a decode request that ends before its blocks were allocated (``do_remote_prefill`` still
  set) makes the decode engine notify the producer without reading (pull_scheduler.py:219-230,
  pull_worker.py:67-75 and 444-467); ``AsyncLLM.notify_kv_transfer_request_rejected`` submits
  such a request, already aborted (vllm/v1/engine/async_llm.py:924-950,
  vllm/v1/engine/core.py:548-551);
- a decode request aborted while its read runs is released by the read's own notification
  (pull_worker.py:441-442, 543-549).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.v1.request import RequestStatus

from decode_service.config import DecodeSettings
from decode_service.service import DecodeService
from kv_transfer import seal
from pdserve.worker import engine as worker_engine
from pdserve.worker.errors import InvalidRequest, KVTransferFailed
from pdserve.worker.handoff import to_message, to_params
from prefill_service.config import PrefillSettings
from prefill_service.service import PrefillService, handoff_request_params, tie_to_prompt
from protos.v1 import common_pb2
from tests import nixl_stand_in

PROMPT = list(range(200, 232))
SECRET = b"k" * 32


def producer_handoff(lease_s: int = nixl_stand_in.LEASE_S) -> tuple[Any, Any, dict]:
    """vLLM's producer after one finished prefill: (scheduler, request, kv_transfer_params)."""
    producer = nixl_stand_in.scheduler("prefill-0", "10.0.0.1", 5600, lease_s)
    params = SamplingParams(**handoff_request_params("gw-1", "nixl"))
    request = nixl_stand_in.request("p-1-0000abcd", PROMPT, params)
    producer.on_new_request(request)
    request.num_computed_tokens = len(PROMPT)
    request.append_output_token_ids(5)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, handoff = producer.request_finished(request, ([1, 2],))
    return producer, request, handoff


def decode_params(handoff: dict, secret: bytes | None = SECRET) -> dict:
    """What the decode worker's engine gets: tied, through the proto, a fresh dict."""
    return to_params(to_message(tie_to_prompt(handoff, PROMPT, "epoch", secret)))


# ---- vLLM's side ----------------------------------------------------------------------------


def test_a_prefill_aborted_while_running_frees_its_blocks_at_once() -> None:
    producer = nixl_stand_in.scheduler("prefill-0", "10.0.0.1", 5600)
    params = SamplingParams(**handoff_request_params("gw-1", "nixl"))
    request = nixl_stand_in.request("p-2-0000abcd", PROMPT, params)
    producer.on_new_request(request)
    request.status = RequestStatus.FINISHED_ABORTED  # what engine.abort() does
    assert producer.request_finished(request, ([1, 2],)) == (False, None)
    assert producer._reqs_need_send == {}
    assert "p-2-0000abcd" in producer.build_connector_meta(None).reqs_not_processed


def test_a_finished_prefill_is_held_for_the_workers_lease() -> None:
    settings = PrefillSettings(kv_connector="nixl", kv_lease_s=12.5)
    config = worker_engine.kv_transfer_config(settings, engine_id="prefill-0")
    lease = config.get_from_extra_config("kv_lease_duration", None)
    assert lease == 13, "--kv-lease-s, in whole seconds (rounded up)"
    producer, _, _ = producer_handoff(lease_s=lease)
    deadline = producer._reqs_need_send["p-1-0000abcd"]
    assert 12 < deadline - time.perf_counter() <= 13
    assert producer.build_connector_meta(None).reqs_to_send == {"p-1-0000abcd": deadline}


def rejected_request(params: dict, request_id: str = "release-1") -> Any:
    """The request ``notify_kv_transfer_request_rejected`` submits (async_llm.py:933-950)."""
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(params)})
    return nixl_stand_in.request(request_id, [0], sampling)


def test_a_rejected_handoff_makes_the_decode_engine_notify_without_reading() -> None:
    _, _, handoff = producer_handoff()
    consumer = nixl_stand_in.scheduler("decode-0", "10.0.0.2", 5601)
    request = rejected_request(decode_params(handoff))
    consumer.on_new_request(request)  # scheduler.add_request (vllm/v1/core/sched/scheduler.py)
    request.status = RequestStatus.FINISHED_ABORTED  # abort_immediately (core.py:548-551)
    assert consumer.request_finished(request, ([],)) == (False, None)
    assert consumer._heartbeat_by_engine == {}, "no more lease renewals for it"
    meta = consumer.build_connector_meta(None)
    job = meta.reqs_to_recv["release-1"]
    # Nothing to read into, nothing awaited: the worker only notifies the producer
    # (pull_worker.py:67-75, 444-467), for the producer's request id.
    assert [list(g) for g in job.local_block_ids] == [] and not job.awaiting_kvs
    assert job.remote.request_id == "p-1-0000abcd" and job.remote.engine_id == "prefill-0"
    assert (job.remote.host, job.remote.port) == ("10.0.0.1", 5600)


def queued_decode(request_id: str) -> tuple[Any, Any]:
    """A decode engine's NIXL scheduler with one request, queued, that brings a hand-off."""
    _, _, handoff = producer_handoff()
    consumer = nixl_stand_in.scheduler("decode-0", "10.0.0.2", 5601)
    sampling = SamplingParams(
        max_tokens=8, extra_args={"kv_transfer_params": decode_params(handoff)}
    )
    request = nixl_stand_in.request(request_id, PROMPT, sampling)
    consumer.on_new_request(request)
    return consumer, request


def test_a_decode_request_aborted_while_queued_also_notifies() -> None:
    consumer, request = queued_decode("d-1-0000beef")
    assert "prefill-0" in consumer._heartbeat_by_engine  # renewing the lease while queued
    request.status = RequestStatus.FINISHED_ABORTED
    consumer.request_finished(request, ([],))
    assert consumer._heartbeat_by_engine == {}
    assert consumer.build_connector_meta(None).reqs_to_recv["d-1-0000beef"].local_block_ids == []


def test_a_decode_request_aborted_during_its_read_is_left_to_the_read() -> None:
    consumer, request = queued_decode("d-2-0000beef")
    consumer.update_state_after_alloc(request, nixl_stand_in.blocks([4, 5]), len(PROMPT))
    consumer.build_connector_meta(None)  # the read starts
    request.status = RequestStatus.FINISHED_ABORTED
    assert consumer.request_finished(request, ([4, 5],)) == (False, None)
    assert consumer.build_connector_meta(None).reqs_to_recv == {}, "no second notification"


# ---- pdserve's side: which calls the services make -------------------------------------------


class FakeEngine:
    """Records the AsyncLLM calls of a service; ``outputs`` are what ``generate`` yields."""

    def __init__(
        self,
        outputs: list[Any] | None = None,
        hold_s: float = 0.0,
        hold_until: Callable[[], bool] | None = None,
    ) -> None:
        self.outputs = outputs or []
        self.hold_s = hold_s
        self.hold_until = hold_until  # the request stays queued until this holds (or 30 s)
        self.calls: list[tuple[str, Any, ...]] = []
        self.errored = False

    async def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))

    async def notify_kv_transfer_request_rejected(self, request_id: str, params: dict) -> None:
        self.calls.append(("notify_rejected", request_id, params))

    async def generate(
        self, prompt: Any, sampling: Any, request_id: str, **kw: Any
    ) -> AsyncIterator[Any]:
        self.calls.append(("generate", request_id, sampling))
        await asyncio.sleep(self.hold_s)
        deadline = time.monotonic() + 30
        while self.hold_until is not None and not self.hold_until():
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.005)
        for output in self.outputs:
            yield output


def output(token: int, finished: bool, reason: str | None = None) -> Any:
    completion = SimpleNamespace(token_ids=[token], text="x", logprobs=None,
                                 finish_reason=reason, stop_reason=None)  # fmt: skip
    return SimpleNamespace(outputs=[completion], finished=finished, kv_transfer_params=None,
                           num_cached_tokens=0, prompt_logprobs=None, metrics=None)  # fmt: skip


def decode_service(engine: FakeEngine, connector: str = "nixl", lease_s: float = 30.0) -> Any:
    settings = DecodeSettings(kv_connector=connector, kv_lease_s=lease_s)
    info = SimpleNamespace(max_model_len=4096)
    service = DecodeService(engine, settings, info)
    service.secret = SECRET
    return service


@pytest.fixture
def tcp_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Calls of our connector's TCP release / renew / release_by_key (none under NIXL)."""
    calls: list[tuple[str, str]] = []
    for module, name in (("decode_service.service", "release"), ("decode_service.service", "renew"),
                         ("prefill_service.service", "release_by_key")):  # fmt: skip

        def record(host: str, port: int, request: str, *, secret: Any, name: str = name) -> bool:
            calls.append((name, request))
            return True

        monkeypatch.setattr(f"{module}.{name}", record)
    return calls


def params(max_tokens: int = 4) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens)


async def drain(service: Any, handoff: dict | None, prompt: list[int] = PROMPT) -> list[Any]:
    return [event async for event in service.decode("d-1", prompt, params(), handoff)]


async def test_a_handoff_the_decode_worker_refuses_is_released_through_its_engine(
    tcp_calls: list[tuple[str, str]],
) -> None:
    _, _, handoff = producer_handoff()
    engine = FakeEngine()
    service = decode_service(engine)
    service.info.max_model_len = len(PROMPT)  # the prompt does not fit: refused before the engine
    with pytest.raises(InvalidRequest):
        await drain(service, decode_params(handoff))
    ((name, release_id, sent),) = engine.calls
    assert name == "notify_rejected" and release_id.startswith("release-")
    assert sent["do_remote_prefill"] is True
    assert (sent["remote_engine_id"], sent["remote_request_id"]) == ("prefill-0", "p-1-0000abcd")
    assert (sent["remote_host"], sent["remote_port"], sent["tp_size"]) == ("10.0.0.1", 5600, 1)
    assert tcp_calls == [], "no pdserve TCP release on the NIXL path"
    # What vLLM does with exactly this request: see test_a_rejected_handoff_makes_...
    consumer = nixl_stand_in.scheduler("decode-0", "10.0.0.2", 5601)
    request = rejected_request(sent, release_id)
    consumer.on_new_request(request)
    request.status = RequestStatus.FINISHED_ABORTED
    consumer.request_finished(request, ([],))
    assert consumer.build_connector_meta(None).reqs_to_recv[release_id].remote.request_id == (
        "p-1-0000abcd"
    )


async def test_abort_with_a_handoff_aborts_and_releases(tcp_calls: list[tuple[str, str]]) -> None:
    _, _, handoff = producer_handoff()
    engine = FakeEngine()
    service = decode_service(engine)
    assert await service.abort("gw-7", decode_params(handoff))
    assert [c[0] for c in engine.calls] == ["abort", "notify_rejected"]
    assert engine.calls[0] == ("abort", "gw-7")
    assert engine.calls[1][2]["remote_request_id"] == "p-1-0000abcd"
    # Plain aborts (the gateway's for a request the engine has) leave the release to vLLM.
    engine.calls.clear()
    await service.abort("gw-8")
    assert engine.calls == [("abort", "gw-8")]
    # A hand-off sealed with another secret is never acted on.
    engine.calls.clear()
    await service.abort("gw-9", decode_params(handoff, secret=b"x" * 32))
    assert engine.calls == [("abort", "gw-9")]
    assert tcp_calls == []


async def test_abort_of_a_request_the_engine_has_leaves_the_release_to_vllm(
    tcp_calls: list[tuple[str, str]],
) -> None:
    _, _, handoff = producer_handoff()
    engine = FakeEngine([output(7, False), output(8, True, "length")], hold_s=0.2)
    service = decode_service(engine)
    running = asyncio.ensure_future(drain(service, decode_params(handoff)))
    await asyncio.sleep(0.05)  # the engine has the request now
    await service.abort("d-1", decode_params(handoff))
    await running
    assert [c[0] for c in engine.calls] == ["generate", "abort"], "no notification of ours"


async def test_an_abort_that_overtakes_its_decode_call_releases_and_refuses_it_later(
    tcp_calls: list[tuple[str, str]],
) -> None:
    """The gateway's Abort may reach the worker before the Decode call it follows: the
    hand-off is released then, so the late call must not read blocks the producer freed."""
    _, _, handoff = producer_handoff()
    engine = FakeEngine([output(7, True, "length")])
    service = decode_service(engine)
    await service.abort("d-1", decode_params(handoff))
    assert [c[0] for c in engine.calls] == ["abort", "notify_rejected"]
    with pytest.raises(InvalidRequest, match="released"):
        await drain(service, decode_params(handoff))
    assert [c[0] for c in engine.calls] == ["abort", "notify_rejected"], (
        "not run, not released again"
    )


async def test_a_successful_decode_releases_nothing_and_renews_nothing(
    tcp_calls: list[tuple[str, str]],
) -> None:
    """vLLM's own read notification frees the producer's blocks; its decode engine renews the
    lease by heartbeats while the request is queued: pdserve makes no call of its own."""
    _, _, handoff = producer_handoff()
    engine = FakeEngine([output(7, False), output(8, True, "length")], hold_s=0.1)
    service = decode_service(engine, lease_s=0.03)  # pdserve's keeper would renew every 10 ms
    events = await drain(service, decode_params(handoff))
    assert events[-1].finish_reason == "length"
    assert [c[0] for c in engine.calls] == ["generate"]
    sent = engine.calls[0][2].extra_args["kv_transfer_params"]
    assert sent["do_remote_prefill"] is True and sent["remote_request_id"] == "p-1-0000abcd"
    assert tcp_calls == []


async def test_our_connector_keeps_renewing_and_releasing_over_tcp(
    tcp_calls: list[tuple[str, str]],
) -> None:
    """The contrast: the same requests with pdserve's connector use its TCP protocol."""
    ours = {"remote_host": "127.0.0.1", "remote_port": 15100, "remote_request_id": "r-1"}
    handoff = seal.seal(ours, SECRET)
    # Queued until the keeper has renewed (every 10 ms): however busy the machine.
    engine = FakeEngine([output(7, True, "length")], hold_until=lambda: bool(tcp_calls))
    service = decode_service(engine, connector="pdserve", lease_s=0.03)
    service._check_handoff = lambda handoff, token_ids: None  # not what this test is about
    await drain(service, handoff)
    assert ("renew", "r-1") in tcp_calls
    await service.abort("gw-1", handoff)
    assert ("release", "r-1") in tcp_calls and not [
        c for c in engine.calls if c[0] == "notify_rejected"
    ]


async def test_a_failed_read_is_an_error_and_is_left_to_the_lease(
    tcp_calls: list[tuple[str, str]],
) -> None:
    _, _, handoff = producer_handoff()
    engine = FakeEngine([output(0, True, "error")])
    service = decode_service(engine)
    with pytest.raises(KVTransferFailed):
        await drain(service, decode_params(handoff))
    assert [c[0] for c in engine.calls] == ["generate"], "no notification: reads may be in flight"
    assert tcp_calls == []


@pytest.mark.parametrize(("connector", "released"), [("nixl", []), ("pdserve", ["gw-3"])])
async def test_prefill_abort_stops_the_prompt_and_only_our_connector_unpins(
    tcp_calls: list[tuple[str, str]], connector: str, released: list[str]
) -> None:
    engine = FakeEngine()
    settings = PrefillSettings(kv_connector=connector)
    service = PrefillService(engine, settings, SimpleNamespace(max_model_len=4096))
    found = await service.abort("gw-3")
    assert engine.calls == [("abort", "gw-3")]
    assert [r for name, r in tcp_calls if name == "release_by_key"] == released
    assert found is bool(released)
