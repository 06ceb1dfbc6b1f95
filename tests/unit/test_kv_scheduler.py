"""Scheduler halves of the connector, driven with minimal stand-ins for vLLM's objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kv_transfer import seal
from kv_transfer.client import RELEASE_KEY
from kv_transfer.metadata import TransferReport
from kv_transfer.scheduler import ConsumerScheduler, Endpoint, ProducerScheduler


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    status: Any = None
    prompt_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_token_ids = self.prompt_token_ids or list(range(self.num_prompt_tokens))


@dataclass
class FakeBlock:
    block_id: int
    block_hash: int | None = None


@dataclass
class FakeBlocks:
    blocks: tuple[list[FakeBlock], ...] = field(default_factory=tuple)

    def get_unhashed_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]


def handoff(blocks: list[int], num_tokens: int) -> dict[str, Any]:
    """A hand-off for a prompt of ``num_tokens`` tokens (ids 0..n-1, as ``FakeRequest``)."""
    return {
        "do_remote_prefill": True,
        "remote_block_ids": blocks,
        "remote_request_id": "p-1",
        "remote_host": "127.0.0.1",
        "remote_port": 15100,
        "remote_num_tokens": num_tokens,
        seal.DIGEST: seal.prompt_digest(range(num_tokens)),
    }


def output(
    report: TransferReport | None = None,
    recving: set[str] | None = None,
    sending: set[str] | None = None,
) -> Any:
    """A step's connector output as vLLM's scheduler receives it."""
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(
        finished_sending=sending, finished_recving=recving, kv_connector_worker_meta=report
    )


def test_producer_pins_finished_prompts_and_queues_them_for_serving() -> None:
    from vllm.v1.request import RequestStatus

    producer = ProducerScheduler(Endpoint("prefill-0", "10.0.0.1", 15100))
    request = FakeRequest(
        "r-1", 300, {"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED
    )
    delay, params = producer.request_finished(request, [3, 4, 8])
    assert delay is True and params is not None
    assert params["remote_block_ids"] == [3, 4, 8] and params["remote_request_id"] == "r-1"
    assert (params["remote_host"], params["remote_port"]) == ("10.0.0.1", 15100)
    assert producer.build_meta(None).serve == {"r-1": [3, 4, 8]}
    assert producer.build_meta(None).serve == {}  # each job is sent once


def test_producer_does_not_pin_aborted_or_plain_requests() -> None:
    from vllm.v1.request import RequestStatus

    producer = ProducerScheduler(Endpoint("p", "h", 1))
    aborted = FakeRequest("a", 10, {"do_remote_decode": True}, RequestStatus.FINISHED_ABORTED)
    assert producer.request_finished(aborted, [1]) == (False, None)
    plain = FakeRequest("b", 10, None, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert producer.request_finished(plain, [1]) == (False, None)


def test_consumer_pulls_only_the_blocks_its_prefix_cache_lacks() -> None:
    consumer = ConsumerScheduler(block_size=128)
    request = FakeRequest("d-1", 300, handoff([10, 11, 12], 300))
    consumer.on_new_request(request)
    # the first block is a local prefix hit: 172 tokens to load, asynchronously
    assert consumer.get_num_new_matched_tokens(request, 128) == (172, True)
    assert consumer.get_num_new_matched_tokens(request, 128) == (172, True)  # no side effects
    blocks = FakeBlocks(([FakeBlock(0, block_hash=99), FakeBlock(5), FakeBlock(6)],))
    consumer.update_state_after_alloc(request, blocks, 172)
    meta = consumer.build_meta(
        SimpleNamespace(
            num_scheduled_tokens={},
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        )
    )
    assert len(meta.pull) == 1
    job = meta.pull[0]
    assert (job.remote_blocks, job.local_blocks) == ([11, 12], [5, 6])
    # exactly one transfer per request: a second allocation pass changes nothing
    consumer.update_state_after_alloc(request, blocks, 0)
    assert consumer.build_meta(meta_output()).pull == [] and consumer.to_release == []


def meta_output(scheduled: dict[str, int] | None = None, new: list[Any] | None = None) -> Any:
    return SimpleNamespace(
        num_scheduled_tokens=scheduled or {},
        scheduled_new_reqs=new or [],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
    )


def test_consumer_releases_the_prefill_blocks_when_it_needs_none() -> None:
    consumer = ConsumerScheduler(block_size=128)
    request = FakeRequest("d-2", 100, handoff([3], 100))
    consumer.update_state_after_alloc(request, FakeBlocks(([],)), 0)
    meta = consumer.build_meta(meta_output())
    assert [(r.host, r.port, r.remote_req_id) for r in meta.release] == [
        ("127.0.0.1", 15100, "p-1")
    ]


def test_consumer_reports_what_the_engine_computed_and_received() -> None:
    consumer = ConsumerScheduler(block_size=128)
    request = FakeRequest("d-3", 200, handoff([1, 2], 200))
    consumer.on_new_request(request)
    consumer.update_state_after_alloc(request, FakeBlocks(([FakeBlock(7), FakeBlock(8)],)), 200)
    consumer.build_meta(meta_output())
    report = TransferReport({"d-3": {"ok": True, "bytes": 4096, "blocks": 2, "seconds": 0.01}})
    consumer.update_connector_output(output(report, recving={"d-3"}))
    # after the load vLLM schedules the last prompt token, then decodes
    new = [SimpleNamespace(req_id="d-3", num_computed_tokens=199)]
    consumer.build_meta(meta_output({"d-3": 1}, new))
    _, params = consumer.request_finished(request)
    assert params is not None
    stats = params["pdserve"]
    assert stats["prompt_computed"] == 1 and stats["received_tokens"] == 200
    assert stats["received_bytes"] == 4096 and stats["received_blocks"] == 2
    assert stats["transfer_error"] == ""


def test_a_failed_pull_is_reported_with_its_error() -> None:
    consumer = ConsumerScheduler(block_size=128)
    request = FakeRequest("d-4", 50, handoff([1], 50))
    consumer.on_new_request(request)
    consumer.update_state_after_alloc(request, FakeBlocks(([FakeBlock(3)],)), 50)
    report = TransferReport({"d-4": {"ok": False, "error": "peer closed", "blocks": 1}})
    consumer.update_connector_output(output(report, recving={"d-4"}))
    _, params = consumer.request_finished(request)
    assert params is not None
    assert params["pdserve"]["transfer_error"] == "peer closed"
    assert params["pdserve"]["received_tokens"] == 0


def test_a_hand_off_with_too_few_blocks_fails_only_that_request() -> None:
    consumer = ConsumerScheduler(block_size=128)
    request = FakeRequest("d-5", 300, handoff([1], 300))
    consumer.update_state_after_alloc(request, FakeBlocks(([FakeBlock(4), FakeBlock(5)],)), 300)
    (job,) = consumer.build_meta(meta_output()).pull
    assert "prefill offers 1" in job.error


def test_producer_counts_pinned_blocks_until_vllm_frees_them() -> None:
    from vllm.v1.request import RequestStatus

    producer = ProducerScheduler(Endpoint("p", "h", 1))
    assert producer.lifecycle() == {"pinned_blocks": 0, "leases": 0}
    done = RequestStatus.FINISHED_LENGTH_CAPPED
    params = {"do_remote_decode": True, RELEASE_KEY: "gw-1"}
    producer.request_finished(FakeRequest("a", 300, dict(params), done), [1, 2, 3])
    producer.request_finished(FakeRequest("b", 100, {"do_remote_decode": True}, done), [4])
    aborted = FakeRequest("c", 10, {"do_remote_decode": True}, RequestStatus.FINISHED_ABORTED)
    producer.request_finished(aborted, [5])
    assert producer.lifecycle() == {"pinned_blocks": 4, "leases": 2}
    meta = producer.build_meta(None)
    assert meta.serve_keys == {"a": "gw-1", "b": ""}  # the service releases "a" by its own id
    producer.update_connector_output(output(sending={"a"}))
    assert producer.lifecycle() == {"pinned_blocks": 1, "leases": 1}
    producer.update_connector_output(output(sending={"b"}))
    assert producer.lifecycle() == {"pinned_blocks": 0, "leases": 0}


def test_consumer_counts_hand_offs_and_pulled_blocks_until_received() -> None:
    consumer = ConsumerScheduler(block_size=128)
    request = FakeRequest("d-6", 300, handoff([1, 2, 3], 300))
    consumer.on_new_request(request)
    consumer.on_new_request(FakeRequest("local", 10))  # no hand-off: not counted
    assert consumer.lifecycle() == {"pinned_blocks": 0, "leases": 1}  # queued
    blocks = FakeBlocks(([FakeBlock(7), FakeBlock(8), FakeBlock(9)],))
    consumer.update_state_after_alloc(request, blocks, 300)
    assert consumer.lifecycle() == {"pinned_blocks": 3, "leases": 1}  # being pulled
    # aborted while pulling: vLLM keeps the blocks until the worker reports the pull ended
    consumer.request_finished(request)
    assert consumer.lifecycle() == {"pinned_blocks": 3, "leases": 1}
    assert consumer.build_meta(meta_output()).release == []  # the pull itself ends the job
    consumer.update_connector_output(output(recving={"d-6"}))
    assert consumer.lifecycle() == {"pinned_blocks": 0, "leases": 0}


def test_a_request_aborted_before_its_pull_leaves_the_hand_off_to_the_gateway() -> None:
    """The gateway may hand it on to another decode worker; it releases it when the request
    ends (tests/integration/test_handoff_retry.py)."""
    consumer = ConsumerScheduler(block_size=128)
    request = FakeRequest("d-7", 300, handoff([1, 2, 3], 300))
    consumer.on_new_request(request)
    consumer.request_finished(request)  # aborted while queued: never allocated
    assert consumer.lifecycle() == {"pinned_blocks": 0, "leases": 0}
    assert consumer.build_meta(meta_output()).release == []


def test_a_step_s_pulls_start_when_its_metadata_is_bound_before_the_forward_pass() -> None:
    """vLLM binds a step's metadata before its forward pass and calls ``start_load_kv`` after
    it (for asynchronous loads): on the CPU the pass has ended by then, so the pulls must
    start at the binding, once per step, each on its TP rank's port."""
    from kv_transfer.connector import PdserveConnector
    from kv_transfer.metadata import PullJob, ReleaseJob, StepMetadata

    started: list[StepMetadata] = []
    connector = object.__new__(PdserveConnector)
    connector.worker = SimpleNamespace(start_jobs=started.append)  # type: ignore[assignment]
    connector.port_offset = 1
    connector._started = None
    meta = StepMetadata(
        pull=[PullJob("r1", "10.0.0.2", 15100, "p1", [3, 4], [7, 8])],
        release=[ReleaseJob("10.0.0.2", 15100, "p0")],
    )
    connector.bind_connector_metadata(meta)
    assert started == [meta]  # before the forward pass, when nothing else has run
    connector.start_load_kv(None)  # after the forward pass: nothing more to start
    connector.bind_connector_metadata(meta)  # bound again: not pulled twice
    assert started == [meta]
    assert meta.pull[0].port == 15101 and meta.release[0].port == 15101  # rank 1, once
    empty = StepMetadata()
    connector.bind_connector_metadata(empty)
    assert started == [meta, empty]

    scheduler = object.__new__(PdserveConnector)  # the scheduler's instance has no worker half
    scheduler.worker = None
    scheduler.bind_connector_metadata(StepMetadata(pull=[PullJob("r2", "h", 1, "p", [1], [2])]))
