"""The kv_transfer_params dict <-> KvTransferParams message conversion."""

from __future__ import annotations

from pdserve.worker import handoff


def test_typed_fields_round_trip_and_role_flags_are_reset() -> None:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [4, 5, 9],
        "remote_engine_id": "prefill-0",
        "remote_request_id": "r-1a2b",
        "remote_host": "10.0.0.2",
        "remote_port": 15100,
        "remote_num_tokens": 300,
        "remote_prefill_cached_tokens": 128,
        "tp_size": 1,
    }
    message = handoff.to_message(params)
    assert list(message.remote_block_ids) == [4, 5, 9]
    assert message.remote_port == 15100 and message.remote_prefill_cached_tokens == 128
    back = handoff.to_params(message)
    assert back == params  # extra fields survive, flags set for the decode side
    assert back is not params


def test_per_group_block_ids_travel_untouched() -> None:
    params = {"remote_block_ids": [[1, 2], [7]], "remote_request_id": "x"}
    back = handoff.to_params(handoff.to_message(params))
    assert back["remote_block_ids"] == [[1, 2], [7]]
