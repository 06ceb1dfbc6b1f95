"""What two workers must agree on before KV blocks move between them.

``describe`` is computed from the engine's ``VllmConfig`` (and, in the worker, from the KV
tensors themselves). The gateway compares the prefill and decode workers' descriptions from
their capabilities before pairing them, and the prefill worker's transfer process compares
them again on every pull, so a mismatch is always a clear error, never garbage in the cache.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kv_transfer.errors import IncompatibleWorkers

# Keys that describe one side only and may differ between a prefill and a decode worker.
LOCAL_KEYS = frozenset({"num_blocks"})


def model_fingerprint(hf_config: Any) -> str:
    """A short hash of the model configuration fields that shape the KV cache."""
    fields = {
        key: getattr(hf_config, key, None)
        for key in (
            "architectures",
            "model_type",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "rope_theta",
        )
    }
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def attention_isa(vllm_config: Any) -> str:
    """The CPU attention kernel's ISA ("amx", "vec", "vec16", ...); "-" off the CPU.

    The ISA decides how K and V are packed inside a block, so blocks are only exchangeable
    between workers that pack them the same way.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "-"
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model = vllm_config.model_config
    return str(
        _get_attn_isa(
            model.dtype,
            vllm_config.cache_config.block_size,
            model.get_head_size(),
            vllm_config.cache_config.cache_dtype,
        )
    )


def describe(vllm_config: Any) -> dict[str, str]:
    """The compatibility description of an engine, from its configuration."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return {
        "model": model_fingerprint(model.hf_config),
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "block_size": str(vllm_config.cache_config.block_size),
        "num_layers": str(model.get_num_layers(parallel)),
        "num_kv_heads": str(model.get_num_kv_heads(parallel)),
        "head_size": str(model.get_head_size()),
        "tensor_parallel_size": str(parallel.tensor_parallel_size),
        "platform": str(current_platform.device_type),
        "attention_isa": attention_isa(vllm_config),
    }


def mismatches(ours: dict[str, str], theirs: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Keys whose values differ (a key missing on one side counts as a difference)."""
    keys = (set(ours) | set(theirs)) - LOCAL_KEYS
    return {
        key: (ours.get(key, "<missing>"), theirs.get(key, "<missing>"))
        for key in sorted(keys)
        if ours.get(key) != theirs.get(key)
    }


def check(ours: dict[str, str], theirs: dict[str, str], who: str = "peer") -> None:
    """Raise IncompatibleWorkers naming every differing key."""
    diff = mismatches(ours, theirs)
    if diff:
        detail = ", ".join(f"{k}: ours={a} {who}={b}" for k, (a, b) in diff.items())
        raise IncompatibleWorkers(f"KV caches are not exchangeable with this {who}: {detail}")
