"""Which prefill and decode workers may be paired: their ``kv_compat`` descriptions (from
``kv_transfer.compat.describe``: connector and version, model, weights, dtype, block size, KV
layout, ...) must be equal, or the decode worker could not use the prefill worker's blocks.
``pairing_problem`` says why a pair cannot, in words a user can act on."""

from __future__ import annotations

from protos.v1 import worker_pb2


def kv_compat_diff(a: worker_pb2.Capabilities, b: worker_pb2.Capabilities) -> list[str]:
    """Keys whose values differ between the two workers' ``kv_compat`` (missing counts)."""
    keys = set(a.kv_compat) | set(b.kv_compat)
    return sorted(k for k in keys if a.kv_compat.get(k) != b.kv_compat.get(k))


# What a difference in a kv_compat key means for the user, where it is not self-evident.
COMPAT_HINTS = {
    "connector": "the workers move KV caches with different connectors or versions (give "
    "every worker the same --kv-connector: pdserve on CPUs, nixl on GPUs, and the same pdserve "
    "and vLLM versions)",
    "kv_cache_layout": "their KV caches are laid out differently (an explicit layout on one "
    "side, or a connector that requires one: NIXL requires LBHNC)",
    "kv_cache_layout_env": "VLLM_KV_CACHE_LAYOUT differs",
    "attention_backend": "their attention backends differ (--attention-backend)",
    "platform": "one runs on a GPU, the other on a CPU",
}


def single_use_handoffs(prefill: worker_pb2.Capabilities | None) -> bool:
    """Whether the hand-offs of this prefill worker are read once and cannot be released by
    the prefill worker: vLLM's NixlConnector frees a prompt's blocks as soon as the first
    decode engine has read them (nixl/pull_worker.py:642-693), so a second decode worker given
    the same hand-off could read reused blocks; and a finished prompt can no longer be aborted
    (vllm/v1/core/sched/scheduler.py:2677-2681), so its blocks are released only by a decode
    engine. Our connector refuses a second pull and unpins on the prefill worker's Abort."""
    if prefill is None:
        return False
    return prefill.kv_compat.get("connector", "").startswith("Nixl")


def pairing_problem(prefill: worker_pb2.Capabilities, decode: worker_pb2.Capabilities) -> str:
    """Why these two workers cannot exchange KV blocks ("" when they can): each differing
    ``kv_compat`` key with both values, and what it means."""
    parts = []
    for key in kv_compat_diff(prefill, decode):
        p = prefill.kv_compat.get(key, "<missing>")
        d = decode.kv_compat.get(key, "<missing>")
        hint = f": {COMPAT_HINTS[key]}" if key in COMPAT_HINTS else ""
        parts.append(f"{key} (prefill {p}, decode {d}){hint}")
    return "; ".join(parts)
