"""The gateway routes only to workers that serve its model and key the prefix index as it
does (``gateway.pool.identity_mismatch``)."""

from __future__ import annotations

from gateway.pool import identity_mismatch
from protos.v1 import worker_pb2


def caps(model: str = "m", seed: int = 42, prefix: str = "pdserve") -> worker_pb2.Capabilities:
    keys = worker_pb2.PrefixIndexKeys(hash_seed=seed, redis_prefix=prefix)
    return worker_pb2.Capabilities(served_model_name=model, index_keys=keys)


def test_a_worker_that_agrees_is_accepted() -> None:
    assert identity_mismatch(caps(), "m", 42, "pdserve") == ""


def test_each_difference_is_named() -> None:
    assert "serves model 'other'" in identity_mismatch(caps(model="other"), "m", 42, "pdserve")
    assert "hash seed 7 differs from the gateway's 42" in identity_mismatch(
        caps(seed=7), "m", 42, "pdserve"
    )
    assert "Redis key prefix 'blue'" in identity_mismatch(caps(prefix="blue"), "m", 42, "pdserve")


def test_the_key_prefix_matters_only_when_the_gateway_uses_redis() -> None:
    assert identity_mismatch(caps(prefix="blue"), "m", 42, None) == ""


def test_a_worker_that_reports_no_keys_is_refused() -> None:
    bare = worker_pb2.Capabilities(served_model_name="m")
    assert "reports no hash seed" in identity_mismatch(bare, "m", 42, None)
