"""Job numbers: one source for both announcements, and a bounded memory of those seen."""

from __future__ import annotations

from typing import Any

from kv_transfer import seal
from kv_transfer.registry import Owner, SeqWindow, serve_mac
from kv_transfer.scheduler import ConsumerScheduler, Endpoint, ProducerScheduler
from tests.unit.test_kv_scheduler import FakeBlock, FakeBlocks, FakeRequest


def test_a_number_is_new_once_whatever_came_between() -> None:
    window = SeqWindow(max_ahead=8)
    assert window.add(1) and not window.add(1)
    assert window.add(3) and window.add(4)  # the announcer runs ahead of the step path
    assert window.floor == 1 and window.above == {3, 4}
    assert not window.add(20)  # too far ahead: left to the step path
    assert window.add(2) and window.floor == 4 and window.above == set()
    for seq in range(5, 100_005):
        assert window.add(seq, force=True)
    assert window.floor == 100_004 and not window.above  # memory stays bounded
    assert all(window.seen(s) for s in (1, 2, 3, 50_000)) and not window.add(1)
    assert window.add(100_020, force=True)  # the in-order path is never refused
    assert window.seen(100_010)  # numbers it skipped count as seen


def test_the_scheduler_numbers_each_job_once_for_both_announcements() -> None:
    from vllm.v1.request import RequestStatus

    announced: list[tuple[Any, ...]] = []

    class Recorder:
        def announce(self, *args: Any) -> None:
            announced.append(args)

    producer = ProducerScheduler(Endpoint("p", "h", 1), announcer=Recorder())  # type: ignore[arg-type]
    capped = RequestStatus.FINISHED_LENGTH_CAPPED
    params = [
        producer.request_finished(FakeRequest(f"r{i}", 4, {"do_remote_decode": True}, capped), [i])[
            1
        ]
        for i in (1, 2)
    ]
    assert [p[seal.SEQ] for p in params if p] == [1, 2]
    assert [a[1] for a in announced] == [1, 2]
    meta = producer.build_meta(None)
    assert meta.serve_seqs == {"r1": 1, "r2": 2}
    assert meta.owner == (producer.epoch, producer.owner_key)
    # The decode side pulls with the hand-off's epoch and number.
    consumer = ConsumerScheduler(block_size=4)
    request = FakeRequest("d1", 4, {**params[0], "do_remote_prefill": True})  # type: ignore[dict-item]
    consumer.update_state_after_alloc(request, FakeBlocks(([FakeBlock(7)],)), 4)
    job = consumer.build_meta(
        type("Out", (), {"num_scheduled_tokens": {}, "scheduled_new_reqs": [],
                         "scheduled_cached_reqs": type("C", (), {"req_ids": [],
                                                                 "num_computed_tokens": []})()})()
    ).pull[0]  # fmt: skip
    assert (job.epoch, job.seq) == (producer.epoch, 1)


def test_only_the_engines_key_signs_an_announcement() -> None:
    owner = Owner()
    message = {"req": "r", "seq": 1, "epoch": "e", "blocks": [1], "digest": "", "key": ""}
    assert owner.signed({**message, "mac": "x"}) is None  # the key has not come yet
    assert owner.set("e", "k") and not owner.set("e2", "k2")
    assert owner.signed({**message, "mac": serve_mac("k", "e", "r", 1, [1], "", "")})
    assert not owner.signed({**message, "mac": serve_mac("other", "e", "r", 1, [1], "", "")})
    assert not owner.signed({**message, "seq": 2, "mac": serve_mac("k", "e", "r", 1, [1], "", "")})


def test_the_job_number_and_epoch_are_sealed() -> None:
    secret = b"s" * 32
    params = {"remote_request_id": "r", "remote_block_ids": [1], seal.DIGEST: "d",
              seal.EPOCH: "e1", seal.SEQ: 7}  # fmt: skip
    sealed = seal.seal(params, secret)
    assert seal.is_genuine(sealed, secret)
    assert not seal.is_genuine({**sealed, seal.SEQ: 8}, secret)
    assert not seal.is_genuine({k: v for k, v in sealed.items() if k != seal.SEQ}, secret)
    assert not seal.is_genuine({**sealed, seal.EPOCH: "e2"}, secret)
