"""A prefill request shaped for vLLM's NixlConnector, and its hand-off through pdserve to a
decode engine, run through vLLM 0.32's own code (tests/nixl_stand_in.py): its stop check
(vllm/v1/core/sched/utils.py:98-119), its SamplingParams (vllm/sampling_params.py:772-800) and
the NIXL scheduler (vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py,
base_scheduler.py), on the producer and on the consumer side.
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams, envs
from vllm.v1.core.sched.utils import check_stop
from vllm.v1.request import RequestStatus

from kv_transfer import seal
from kv_transfer.errors import PromptMismatch
from pdserve.worker import engine
from pdserve.worker.handoff import to_message, to_params
from prefill_service.config import PrefillSettings
from prefill_service.service import handoff_request_params, tie_to_prompt
from tests import nixl_stand_in

PROMPT = list(range(100, 140))
EOS, OTHER_EOS = 2, 7  # the tokenizer's EOS and one more from the generation config
SECRET = b"s" * 32


def shaped(connector: str = "nixl") -> SamplingParams:
    """The prefill request's parameters as the engine sees them: the model's generation config
    applied (vLLM does this to every request: EOS ids join the stop set unless ignore_eos)."""
    params = SamplingParams(**handoff_request_params("gw-1", connector))
    params.update_from_generation_config({"eos_token_id": [EOS, OTHER_EOS]}, EOS)
    return params


@pytest.mark.parametrize("first_token", [EOS, OTHER_EOS, 42])
def test_the_prefill_request_ends_length_capped_whatever_its_first_token(first_token: int) -> None:
    request = nixl_stand_in.request("p-1", PROMPT, shaped())
    request.append_output_token_ids(first_token)
    assert check_stop(request, max_model_len=4096)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.kv_transfer_params == {"do_remote_decode": True}


def test_without_ignore_eos_a_first_eos_token_would_end_it_as_stopped() -> None:
    """Why ``ignore_eos``: the EOS check comes before the length check (utils.py:104-119);
    vLLM 0.32's NIXL producer hands off STOPPED requests too, earlier ones did not."""
    fields = handoff_request_params("gw-1", "nixl")
    params = SamplingParams(**{**fields, "ignore_eos": False})
    params.update_from_generation_config({"eos_token_id": [EOS]}, EOS)
    request = nixl_stand_in.request("p-1", PROMPT, params)
    request.append_output_token_ids(EOS)
    assert check_stop(request, max_model_len=4096)
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_only_our_connector_gets_a_release_key() -> None:
    assert handoff_request_params("gw-1", "nixl")["extra_args"] == {
        "kv_transfer_params": {"do_remote_decode": True}
    }
    ours = handoff_request_params("gw-1", "pdserve")["extra_args"]["kv_transfer_params"]
    assert ours["do_remote_decode"] is True and "gw-1" in ours.values()
    fields = handoff_request_params("gw-1", "nixl")
    assert (fields["max_tokens"], fields["ignore_eos"], fields["detokenize"]) == (1, True, False)


def finished_prefill(producer: object, prompt: list[int]) -> tuple[bool, dict]:
    """vLLM's producer side for one shaped request: admitted, prompt computed, first token
    sampled (length cap), finished (pull_scheduler.py:191-292)."""
    request = nixl_stand_in.request("p-1-0000abcd", prompt, shaped())
    producer.on_new_request(request)  # type: ignore[attr-defined]
    request.num_computed_tokens = len(prompt)
    request.append_output_token_ids(EOS)
    assert check_stop(request, max_model_len=4096)
    return producer.request_finished(request, ([3, 4, 5],))  # type: ignore[attr-defined]


def test_the_nixl_producer_hands_off_the_shaped_request() -> None:
    producer = nixl_stand_in.scheduler("prefill-0", "10.0.0.1", 5600)
    delay_free, params = finished_prefill(producer, PROMPT)
    assert delay_free, "the blocks stay until a decode engine has read them, or the lease ends"
    assert "p-1-0000abcd" in producer._reqs_need_send
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == ([3, 4, 5],)
    assert (params["remote_host"], params["remote_port"]) == ("10.0.0.1", 5600)
    assert params["remote_engine_id"] == "prefill-0"
    assert params["remote_request_id"] == "p-1-0000abcd"
    assert params["remote_num_tokens"] == len(PROMPT)
    assert params["tp_size"] == 1


def test_the_side_channel_comes_from_the_workers_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's environment is what vLLM's scheduler reads for its side channel
    (base_scheduler.py:76-80: envs.VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT)."""
    settings = PrefillSettings(kv_connector="nixl", advertise_host="10.0.0.1", nixl_port=5607)
    for key, value in engine.nixl_env(settings).items():
        monkeypatch.setenv(key, value)
    assert envs.VLLM_NIXL_SIDE_CHANNEL_HOST == "10.0.0.1"
    assert envs.VLLM_NIXL_SIDE_CHANNEL_PORT == 5607


def through_pdserve(params: dict, prompt: list[int], secret: bytes | None = SECRET) -> dict:
    """Prefill worker → gateway → decode worker: tied to the prompt, sent as the typed proto
    message, made a fresh dict for the decode engine."""
    tied = tie_to_prompt(params, prompt, "epoch-1", secret)
    return to_params(to_message(tied))


def test_the_handoff_reaches_the_decode_engine_as_vllm_expects() -> None:
    producer = nixl_stand_in.scheduler("prefill-0", "10.0.0.1", 5600)
    _, params = finished_prefill(producer, PROMPT)
    received = through_pdserve(params, PROMPT)
    seal.verify(received, PROMPT, SECRET)  # the decode worker's check passes

    consumer = nixl_stand_in.scheduler("decode-0", "10.0.0.2", 5601)
    decode = nixl_stand_in.request(
        "d-1-0000beef",
        PROMPT,
        SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": received}),
    )
    consumer.on_new_request(decode)
    # Heartbeats to the producer keep its lease while the request waits (base_scheduler.py:
    # 199-238): they need the producer's engine id, host, port and tp_size from the hand-off.
    heartbeat = consumer._heartbeat_by_engine["prefill-0"]
    assert (heartbeat.host, heartbeat.port, heartbeat.tp_size) == ("10.0.0.1", 5600, 1)
    assert heartbeat.req_ids == {"p-1-0000abcd"}
    # The whole prompt comes from the producer, asynchronously (pull_scheduler.py:59-65).
    assert consumer.get_num_new_matched_tokens(decode, 0) == (len(PROMPT), True)
    consumer.update_state_after_alloc(decode, nixl_stand_in.blocks([7, 8, 9]), len(PROMPT))
    assert decode.kv_transfer_params["do_remote_prefill"] is False, "one transfer only"
    meta = consumer.build_connector_meta(scheduler_output=None)
    remote = meta.reqs_to_recv["d-1-0000beef"].remote
    assert remote.engine_id == "prefill-0" and remote.request_id == "p-1-0000abcd"
    assert (remote.host, remote.port) == ("10.0.0.1", 5600)
    assert [list(group) for group in remote.block_ids] == [[3, 4, 5]]
    assert [list(group) for group in meta.reqs_to_recv["d-1-0000beef"].local_block_ids] == [
        [7, 8, 9]
    ]


def test_a_nixl_handoff_is_refused_for_another_prompt_or_when_altered() -> None:
    producer = nixl_stand_in.scheduler("prefill-0", "10.0.0.1", 5600)
    _, params = finished_prefill(producer, PROMPT)
    received = through_pdserve(params, PROMPT)
    other = [*PROMPT[:-1], 999]
    with pytest.raises(PromptMismatch, match="another prompt"):
        seal.verify(received, other, SECRET)
    for key, value in (("remote_host", "203.0.113.9"), ("tp_size", 2), ("remote_port", 1)):
        with pytest.raises(PromptMismatch, match="not signed"):
            seal.verify({**received, key: value}, PROMPT, SECRET)
    # Without a deployment secret the digest still catches a mix-up.
    open_handoff = through_pdserve(params, PROMPT, secret=None)
    seal.verify(open_handoff, PROMPT, None)
    with pytest.raises(PromptMismatch):
        seal.verify(open_handoff, other, None)


def test_our_connectors_signed_text_is_unchanged() -> None:
    """The NIXL fields are signed only when present: our own hand-offs keep their seal."""
    ours = {
        "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h",
        "remote_port": 1, "remote_block_ids": [1, 2], "remote_num_tokens": 3,
        seal.TP_SIZE: 1, seal.DIGEST: "d", seal.EPOCH: "x",
    }  # fmt: skip
    assert seal._signed_text(ours) == '["e","r","h",1,[1,2],3,1,"d","x"]'
