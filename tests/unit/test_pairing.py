"""Pairing rules: what a worker reports about how it moves KV blocks (``kv_transfer.compat``),
and why the gateway refuses a pair (``gateway.pairing``).

vLLM facts relied on: NixlConnector requires the LBHNC layout except for MLA models
(vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py:143-161), applied through
``get_kv_connector_cache_layout`` (vllm/distributed/kv_transfer/kv_connector/utils.py:47-60);
its handshake requires the same vLLM and connector version (nixl/metadata.py:54, 145-204).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NIXL_CONNECTOR_VERSION

from gateway.pairing import pairing_problem
from kv_transfer import CONNECTOR_MODULE, CONNECTOR_NAME, compat
from protos.v1 import worker_pb2


def config(kv: KVTransferConfig | None, use_mla: bool = False, layout: str | None = None) -> Any:
    return SimpleNamespace(
        kv_transfer_config=kv,
        model_config=SimpleNamespace(use_mla=use_mla),
        cache_config=SimpleNamespace(kv_cache_layout=layout),
    )


NIXL = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer")
OURS = KVTransferConfig(
    kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_consumer"
)
TIERED_NIXL = KVTransferConfig(
    kv_connector="MultiConnector",
    kv_role="kv_producer",
    kv_connector_extra_config={
        "connectors": [
            {"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
            {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_producer"},
        ]
    },
)


def test_the_connector_key_names_the_handoff_connector_and_its_version() -> None:
    nixl = f"NixlConnector/{NIXL_CONNECTOR_VERSION}/pull/vllm-{vllm.__version__}"
    assert compat.connector_identity(config(NIXL)) == nixl
    assert compat.connector_identity(config(TIERED_NIXL)) == nixl, "the tier does not count"
    assert compat.connector_identity(config(OURS)) == f"PdserveConnector/{compat.WIRE_VERSION}"
    assert compat.handoff_connector(TIERED_NIXL) == "NixlConnector"


def test_the_layout_key_includes_what_the_connector_requires() -> None:
    assert compat.kv_cache_layout(config(NIXL)) == "LBHNC"
    assert compat.kv_cache_layout(config(NIXL, use_mla=True)) == "auto"  # MLA: any layout
    assert compat.kv_cache_layout(config(OURS)) == "auto"  # resolved by the engine core
    assert compat.kv_cache_layout(config(OURS, layout="LBNHC")) == "LBNHC"


def caps(**kv_compat: str) -> worker_pb2.Capabilities:
    base = {"model": "m", "dtype": "bfloat16", "block_size": "16", "kv_cache_layout": "auto"}
    return worker_pb2.Capabilities(kv_compat={**base, **kv_compat})


def test_a_nixl_prefill_and_a_pdserve_decode_are_refused_with_the_reason() -> None:
    nixl = compat.connector_identity(config(NIXL))
    prefill = caps(connector=nixl, kv_cache_layout="LBHNC")
    decode = caps(connector="PdserveConnector/2")
    why = pairing_problem(prefill, decode)
    assert f"connector (prefill {nixl}, decode PdserveConnector/2)" in why
    assert "same --kv-connector" in why
    assert "kv_cache_layout (prefill LBHNC, decode auto)" in why
    assert pairing_problem(prefill, prefill) == ""


def test_other_differences_are_named_with_both_values() -> None:
    why = pairing_problem(caps(dtype="float16"), caps(attention_backend="FLASHINFER"))
    assert "dtype (prefill float16, decode bfloat16)" in why
    assert "attention_backend (prefill <missing>, decode FLASHINFER)" in why
