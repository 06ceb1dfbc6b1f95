"""Hand-offs sealed to their prompt (``kv_transfer.seal``) and the consumer scheduler's check."""

from __future__ import annotations

from typing import Any

import pytest

from kv_transfer import seal
from kv_transfer.auth import new_secret
from kv_transfer.errors import PromptMismatch
from kv_transfer.scheduler import ConsumerScheduler
from pdserve.worker import handoff as proto_handoff
from tests.unit.test_kv_scheduler import FakeBlock, FakeBlocks, FakeRequest, meta_output

SECRET = new_secret().encode()
PROMPT_A = list(range(1000, 1300))
PROMPT_B = list(range(2000, 2300))  # same length: block counts agree, contents do not


def sealed(prompt: list[int], secret: bytes | None = SECRET) -> dict[str, Any]:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [4, 5, 6],
        "remote_engine_id": "prefill-0",
        "remote_request_id": "cmpl-1",
        "remote_host": "10.0.0.1",
        "remote_port": 15100,
        "remote_num_tokens": len(prompt),
        seal.TP_SIZE: 1,
        seal.DIGEST: seal.prompt_digest(prompt),
        seal.EPOCH: "e1",
    }
    return seal.seal(params, secret)


def through_the_wire(params: dict[str, Any]) -> dict[str, Any]:
    """As the gateway carries it: prefill's dict -> KvTransferParams -> decode's dict."""
    message = proto_handoff.to_message(params)
    return proto_handoff.to_params(type(message).FromString(message.SerializeToString()))


def test_a_genuine_hand_off_for_the_same_prompt_passes_after_the_proto_round_trip() -> None:
    seal.verify(through_the_wire(sealed(PROMPT_A)), PROMPT_A, SECRET)


def test_a_hand_off_for_another_prompt_is_refused() -> None:
    with pytest.raises(PromptMismatch, match="another prompt"):
        seal.verify(through_the_wire(sealed(PROMPT_A)), PROMPT_B, SECRET)
    with pytest.raises(PromptMismatch, match="300 tokens"):
        seal.verify(sealed(PROMPT_A), PROMPT_A[:200], SECRET)


@pytest.mark.parametrize(
    "change",
    [
        {seal.DIGEST: seal.prompt_digest(PROMPT_B)},  # re-pointed at another prompt
        {"remote_host": "attacker.example"},
        {"remote_block_ids": [4, 5, 7]},
        {"remote_request_id": "cmpl-2"},
        {seal.EPOCH: "e2"},
    ],
)
def test_an_altered_hand_off_is_refused(change: dict[str, Any]) -> None:
    params = {**sealed(PROMPT_A), **change}
    prompt = PROMPT_B if seal.DIGEST in change else PROMPT_A
    assert not seal.is_genuine(params, SECRET)
    with pytest.raises(PromptMismatch, match="not signed"):
        seal.verify(params, prompt, SECRET)


def test_another_deployments_or_an_unsigned_hand_off_is_refused() -> None:
    with pytest.raises(PromptMismatch, match="not signed"):
        seal.verify(sealed(PROMPT_A, new_secret().encode()), PROMPT_A, SECRET)
    with pytest.raises(PromptMismatch, match="not signed"):
        seal.verify(sealed(PROMPT_A, None), PROMPT_A, SECRET)


def test_without_a_secret_the_prompt_is_still_checked() -> None:
    seal.verify(sealed(PROMPT_A, None), PROMPT_A, None)
    with pytest.raises(PromptMismatch, match="another prompt"):
        seal.verify(sealed(PROMPT_A, None), PROMPT_B, None)
    no_digest = {k: v for k, v in sealed(PROMPT_A, None).items() if k != seal.DIGEST}
    with pytest.raises(PromptMismatch, match="which prompt"):
        seal.verify(no_digest, PROMPT_A, None)


def test_the_consumer_fails_a_mismatched_hand_off_without_pulling_anything() -> None:
    consumer = ConsumerScheduler(block_size=128, secret=SECRET)
    request = FakeRequest("d-1", 300, sealed(PROMPT_A), prompt_token_ids=PROMPT_B)
    consumer.on_new_request(request)
    blocks = FakeBlocks(([FakeBlock(7), FakeBlock(8), FakeBlock(9)],))
    consumer.update_state_after_alloc(request, blocks, 300)
    (job,) = consumer.build_meta(meta_output()).pull
    # No producer to contact: the worker reports a failed load at once, vLLM fails (or
    # recomputes) the request and caches none of these blocks.
    assert (job.host, job.port, job.remote_blocks) == ("", 0, [])
    assert job.local_blocks == [7, 8, 9] and "another prompt" in job.error
    assert consumer.to_release == []


def test_the_consumer_pulls_a_genuine_hand_off_and_names_its_digest() -> None:
    consumer = ConsumerScheduler(block_size=128, secret=SECRET)
    request = FakeRequest("d-2", 300, sealed(PROMPT_A), prompt_token_ids=PROMPT_A)
    consumer.update_state_after_alloc(request, FakeBlocks(([FakeBlock(7), FakeBlock(8)],)), 300)
    (job,) = consumer.build_meta(meta_output()).pull
    assert job.error == "" and job.digest == seal.prompt_digest(PROMPT_A)
