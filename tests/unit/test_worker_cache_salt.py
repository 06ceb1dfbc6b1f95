"""A cache salt on the worker side: vLLM's prompt carries it, and a KV tier's chunk keys."""

from __future__ import annotations

from pdserve.worker.sampling import (
    TIER_SALT_TAG,
    cache_salt,
    engine_prompt,
    salted_transfer_params,
    to_vllm,
)
from protos.v1 import common_pb2


def test_the_salt_reaches_vllms_prompt() -> None:
    assert engine_prompt([1, 2], "a") == {"prompt_token_ids": [1, 2], "cache_salt": "a"}
    assert "cache_salt" not in engine_prompt([1, 2], None)
    assert cache_salt(common_pb2.SamplingParams(cache_salt="a")) == "a"
    assert cache_salt(common_pb2.SamplingParams()) is None


def test_a_tier_keys_a_salted_requests_chunks_apart() -> None:
    import torch
    from lmcache.integration.vllm.utils import extract_request_configs_from_sampling_params
    from lmcache.utils import CacheEngineKey

    handoff = {"do_remote_decode": True}
    assert salted_transfer_params(handoff, "a", tier=False) is handoff
    assert salted_transfer_params(None, None, tier=True) is None
    tagged = salted_transfer_params(handoff, "a", tier=True)
    assert tagged == {"do_remote_decode": True, TIER_SALT_TAG: "a"}

    def key(transfer: dict | None) -> CacheEngineKey:
        params = to_vllm(
            common_pb2.SamplingParams(max_tokens=1),
            100,
            10,
            extra_args={"kv_transfer_params": transfer},
        )
        configs = extract_request_configs_from_sampling_params(params)
        return CacheEngineKey("m", 1, 0, 1234, torch.float32, request_configs=configs)

    plain = key(handoff)
    salted = key(tagged)
    other = key(salted_transfer_params(handoff, "b", tier=True))
    assert len({plain, salted, other}) == 3  # the same chunk of tokens, three keys
    assert salted == key(salted_transfer_params(handoff, "a", tier=True))


def test_a_prefill_carries_the_salt_to_its_tier_only_with_a_tier() -> None:
    from prefill_service.service import handoff_request_params

    def transfer(salt: str | None, tier: bool) -> dict:
        params = handoff_request_params("r", "pdserve", salt, tier)
        return dict(params["extra_args"]["kv_transfer_params"])

    assert transfer("a", True)[TIER_SALT_TAG] == "a"
    assert TIER_SALT_TAG not in transfer("a", False)
    assert TIER_SALT_TAG not in transfer(None, True)
    assert transfer("a", True)["do_remote_decode"] is True
