"""``PdserveConnector``: the vLLM KV connector of pdserve (pull mode, NIXL-style params).

Load it with::

    KVTransferConfig(kv_connector="PdserveConnector", kv_connector_module_path=
                     "kv_transfer.connector", kv_role="kv_producer" | "kv_consumer",
                     kv_connector_extra_config={"kv_host": ..., "kv_port": ..., ...})

vLLM makes one instance in the EngineCore process (role SCHEDULER) and one per worker process
(role WORKER); this class only routes vLLM's hooks to the half that owns them
(``scheduler.ProducerScheduler`` / ``ConsumerScheduler`` and ``worker.WorkerSide``).

Extra config keys: ``kv_host`` (address decode workers use to reach this prefill worker),
``kv_bind_host`` (default 0.0.0.0), ``kv_port`` (producer's transfer port; TP rank r uses
kv_port + r), ``lease_s`` (30), ``register_wait_s`` (10), ``io_timeout_s`` (30),
``connect_timeout_s`` (3: a decode worker's connect and handshake to a prefill worker),
``compat`` (the description from ``kv_transfer.compat.describe``, filled in if absent),
``secret_file`` (file holding the deployment secret; "" = run open, see ``kv_transfer.auth``).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from kv_transfer import compat
from kv_transfer.agent_context import DEFAULT_PORT, agent_settings
from kv_transfer.announce import Announcer
from kv_transfer.auth import load_secret
from kv_transfer.lifecycle import LifecycleStats, NoPromMetrics
from kv_transfer.metadata import StepMetadata
from kv_transfer.scheduler import ConsumerScheduler, Endpoint, ProducerScheduler, new_owner
from kv_transfer.worker import WorkerSide

log = logging.getLogger(__name__)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError):
        return 0


class PdserveConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        self.is_producer = bool(transfer.is_kv_producer)
        if transfer.is_kv_producer and transfer.is_kv_consumer:
            raise ValueError("PdserveConnector needs kv_role kv_producer or kv_consumer, not both")
        port = int(extra.get("kv_port", DEFAULT_PORT))
        secret_file = str(extra.get("secret_file") or "")
        self.producer: ProducerScheduler | None = None
        self.consumer: ConsumerScheduler | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            secret = load_secret(secret_file)
            if self.is_producer:
                host = str(extra.get("kv_host") or "127.0.0.1")
                endpoint = Endpoint(str(transfer.engine_id), host, port)
                tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
                # The agents run on this host: reach them where they bind.
                bind = str(extra.get("kv_bind_host") or "0.0.0.0")
                local = "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind
                ports = [port + rank for rank in range(tp_size)]
                owner = new_owner()
                announcer = Announcer(local, ports, secret, owner)
                self.producer = ProducerScheduler(endpoint, secret, tp_size, announcer, owner)
            else:
                self.consumer = ConsumerScheduler(vllm_config.cache_config.block_size, secret)
            return
        rank = _tp_rank()
        self.worker = WorkerSide(
            role="producer" if self.is_producer else "consumer",
            compat=dict(extra.get("compat") or compat.describe(vllm_config)),
            agent_settings=agent_settings(extra, self.is_producer, rank, secret_file),
        )
        self.port_offset = rank
        self._started: StepMetadata | None = None  # the last metadata whose jobs started

    # ---------------------------------------------------------------- worker hooks
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's metadata, bound before its forward pass: its jobs start now.

        vLLM starts asynchronous loads (``start_load_kv``) after the forward pass, which on a
        GPU is only launched by then; on the CPU the pass has run to its end, so a pull
        started there finishes during the next step and its request computes a step later
        still. Started here, the transfer process pulls while the engine computes this step,
        and the request computes in the next one."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker is None or not isinstance(connector_metadata, StepMetadata):
            return
        if connector_metadata is self._started:
            return  # bound again: its jobs run already
        self._started = connector_metadata
        # TP rank r pulls from, and releases on, the producer's rank r (kv_port + r): every
        # rank's agent pins its own share of the blocks.
        for job in connector_metadata.pull:
            if job.port:
                job.port += self.port_offset
        for rel in connector_metadata.release:
            rel.port += self.port_offset
        self.worker.start_jobs(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # the step's jobs started when its metadata was bound

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous and complete before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None  # blocks are served from the cache itself, nothing to save

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        sending, recving, failed = self.worker.collect(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_report() if self.worker is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.producer is not None and self.producer.announcer is not None:
            self.producer.announcer.close()

    # ------------------------------------------------------------- scheduler hooks
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self.consumer is None:
            return 0, False
        return self.consumer.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.consumer is not None:
            self.consumer.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        half = self.producer or self.consumer
        assert half is not None
        return half.build_meta(scheduler_output)

    def on_new_request(self, request: Any) -> None:
        if self.consumer is not None:
            self.consumer.on_new_request(request)

    def update_connector_output(self, connector_output: Any) -> None:
        half = self.producer or self.consumer
        if half is not None:
            half.update_connector_output(connector_output)

    def get_kv_connector_stats(self) -> LifecycleStats | None:
        """Scheduler role: the blocks and leases held now (``kv_transfer.lifecycle``)."""
        half = self.producer or self.consumer
        return LifecycleStats(data=dict(half.lifecycle())) if half is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LifecycleStats:
        return LifecycleStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, *args: Any) -> NoPromMetrics:
        return NoPromMetrics(*args)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        if self.producer is not None:
            return self.producer.request_finished(request, block_ids)
        if self.consumer is not None:
            return self.consumer.request_finished(request)
        return False, None
