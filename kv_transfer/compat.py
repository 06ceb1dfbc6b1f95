"""What two workers must agree on before KV blocks move between them.

``describe`` is computed from the engine's ``VllmConfig`` (and, in the worker, from the KV
tensors themselves). The gateway compares the prefill and decode workers' descriptions from
their capabilities before pairing them, and the prefill worker's transfer process compares
them again on every pull, so a mismatch is always a clear error, never garbage in the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from kv_transfer.errors import IncompatibleWorkers

# Bumped when the meaning of the bytes on the wire or of a hand-off changes.
WIRE_VERSION = "2"
# Weights identity: bytes sampled per weight file (start, end and evenly spaced chunks).
_SAMPLE_CHUNK = 64 * 1024
_SAMPLE_CHUNKS = 16
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")

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
            "rope_scaling",
            "rope_parameters",
            "partial_rotary_factor",
            "max_position_embeddings",
            "sliding_window",
            "layer_types",
            "quantization_config",
            "torch_dtype",
        )
    }
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def weights_identity(model: str, revision: str | None = None) -> str:
    """A short hash that differs between two sets of weights, cheap even for huge models.

    For a local model directory: every weight file's name and size, and ``_SAMPLE_CHUNKS``
    chunks of its bytes (first, last and evenly spaced): fine-tuned weights of the same shapes
    differ in every chunk, so a rolling upgrade cannot pair old and new workers, while reading
    ~1 MiB per file keeps this fast on multi-GB checkpoints. Index and config files are
    hashed whole. For a hub name: the name and revision (the hub pins the content).
    """
    root = Path(model)
    h = hashlib.sha256()
    if not root.is_dir():
        h.update(f"{model}@{revision or 'main'}".encode())
        return h.hexdigest()[:16]
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        name = str(path.relative_to(root))
        if path.name.endswith(_WEIGHT_SUFFIXES):
            h.update(name.encode() + b"\0" + str(path.stat().st_size).encode() + b"\0")
            _sample(path, h)
        elif path.name.endswith(".index.json") or path.name == "config.json":
            h.update(name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _sample(path: Path, h: Any) -> None:
    size = path.stat().st_size
    with path.open("rb") as f:
        step = max(size // _SAMPLE_CHUNKS, 1)
        for offset in sorted({*range(0, size, step), max(size - _SAMPLE_CHUNK, 0)}):
            f.seek(offset)
            h.update(f.read(_SAMPLE_CHUNK))


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


def handoff_connector(kv_transfer_config: Any) -> str:
    """The class name of the connector that moves hand-offs: the engine's connector, or under
    vLLM's MultiConnector (a KV tier beneath) its first child (the tier is reported apart, as
    ``kv_tier``)."""
    name = str(kv_transfer_config.kv_connector)
    if name == "MultiConnector":
        extra = kv_transfer_config.kv_connector_extra_config or {}
        children = extra.get("connectors") or [{}]
        name = str(children[0].get("kv_connector") or name)
    return name


def connector_identity(vllm_config: Any) -> str:
    """Which protocol moves this engine's KV blocks, and in which version: two workers must
    speak the same one. Ours: its wire version. vLLM's NixlConnector: its own version and
    vLLM's, both of which its handshake requires to be equal
    (vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py:145-204), and pull mode."""
    config = getattr(vllm_config, "kv_transfer_config", None)
    name = handoff_connector(config) if config is not None else "PdserveConnector"
    if name in ("NixlConnector", "NixlPullConnector"):
        from vllm import __version__ as vllm_version
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NIXL_CONNECTOR_VERSION,
        )

        return f"NixlConnector/{NIXL_CONNECTOR_VERSION}/pull/vllm-{vllm_version}"
    if name == "PdserveConnector":
        return f"PdserveConnector/{WIRE_VERSION}"
    return name


def kv_cache_layout(vllm_config: Any) -> str:
    """The KV cache layout as far as the configuration decides it: an explicit choice, else
    the one the connector requires (NIXL: LBHNC except for MLA,
    nixl/connector.py:143-161, applied by vllm/distributed/kv_transfer/kv_connector/utils.py:
    47-60), else "auto" (the engine core resolves it from the attention backend)."""
    chosen = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if chosen:
        return str(chosen)
    if getattr(vllm_config, "kv_transfer_config", None) is None:
        return "auto"
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

    return str(get_kv_connector_cache_layout(vllm_config) or "auto")


def describe(vllm_config: Any) -> dict[str, str]:
    """The compatibility description of an engine, from its configuration."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    description = {
        "connector": connector_identity(vllm_config),
        "model": model_fingerprint(model.hf_config),
        "weights": weights_identity(str(model.model), getattr(model, "revision", None)),
        "quantization": str(getattr(model, "quantization", None) or "none"),
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "block_size": str(vllm_config.cache_config.block_size),
        "num_layers": str(model.get_num_layers(parallel)),
        "num_kv_heads": str(model.get_num_kv_heads(parallel)),
        "head_size": str(model.get_head_size()),
        "tensor_parallel_size": str(parallel.tensor_parallel_size),
        "platform": str(current_platform.device_type),
        "attention_isa": attention_isa(vllm_config),
        "kv_cache_layout": kv_cache_layout(vllm_config),
        "kv_cache_layout_env": os.environ.get("VLLM_KV_CACHE_LAYOUT", "") or "-",
    }
    if not current_platform.is_cpu():
        # The attention backend decides how a GPU block is laid out; NIXL's handshake requires
        # the same on both sides (metadata.py:185-199). "auto": vLLM picks it per GPU.
        backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        description["attention_backend"] = str(getattr(backend, "name", backend) or "auto")
    return description


def layer_bytes(block_bytes: list[int]) -> str:
    """Bytes per block of every layer, compactly ("12x4096" or "4096,8192,..."): two workers
    with the same total but another split over layers must not exchange blocks."""
    if block_bytes and len(set(block_bytes)) == 1:
        return f"{len(block_bytes)}x{block_bytes[0]}"
    text = ",".join(map(str, block_bytes))
    return text if len(text) <= 200 else hashlib.sha256(text.encode()).hexdigest()[:16]


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
