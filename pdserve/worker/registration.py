"""The worker's link to the shared record: heartbeat in the registry, KV events into the
prefix index, and the load both report. Active only when ``redis_url`` is set."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.kvindex.epochs import new_epoch
from pdserve.kvindex.interfaces import IndexUnavailable, WorkerRecord
from pdserve.kvindex.redis_store import RedisStore
from pdserve.runtime.supervise import start_task
from pdserve.runtime.tasks import cancel_and_wait
from pdserve.worker.config import WorkerSettings
from pdserve.worker.engine import EngineInfo
from pdserve.worker.kv_events import EventEndpoints, EventSink, events_config
from pdserve.worker.nixl_stats import step_totals

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
TTL_HEARTBEATS = 3  # missed heartbeats before a worker counts as dead


@dataclass
class Load:
    """Updated by the engine's stat logger (running, waiting, kv_usage, the KV connector's
    pinned_blocks and leases, engine_steps) and the service (in_flight)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    in_flight: int = 0
    # KV blocks held for transfers (prefill: pinned for decode workers; decode: allocated
    # for pulls) and the requests holding them (see kv_transfer.lifecycle).
    pinned_blocks: int = 0
    leases: int = 0
    # Engine steps so far: an engine with requests whose count stands still is hung.
    engine_steps: int = 0
    # vLLM's NIXL transfer statistics since the start (pdserve.worker.nixl_stats).
    kv_transfers: int = 0
    kv_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_failures: int = 0
    kv_leases_expired: int = 0
    # Core lending on a lending worker (pdserve.worker.core_lending): its table's counters.
    cpu_lent_steps: int = 0
    cpu_lend_wait_seconds: float = 0.0
    cpu_lend_reclaims: int = 0
    # LoRA requests, and those whose adapter the engine had to load first (WorkerService).
    lora_requests: int = 0
    lora_loads: int = 0

    def take_lending(self, totals: Any) -> None:
        """Take the lending table's counters of this worker's cores (a ``Record``)."""
        self.cpu_lent_steps = totals.lent_steps
        self.cpu_lend_wait_seconds = totals.waited_ns / 1e9
        self.cpu_lend_reclaims = totals.reclaimed

    def add_transfers(self, kv_connector_stats: dict[str, Any] | None) -> None:
        """Add one engine step's NIXL transfer statistics (none with pdserve's connector)."""
        step = step_totals(kv_connector_stats)
        if step is None:
            return
        self.kv_transfers += step.transfers
        self.kv_bytes += step.bytes
        self.kv_transfer_seconds += step.seconds
        self.kv_transfer_failures += step.failures
        self.kv_leases_expired += step.expired


def stat_logger_for(load: Load) -> Any:
    """A vLLM stat-logger factory that copies the scheduler's statistics into ``load``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    from kv_transfer.lifecycle import gauges

    class LoadLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kw: Any) -> None:
            if scheduler_stats is not None:  # one per engine step
                load.engine_steps += 1
                load.running = scheduler_stats.num_running_reqs
                load.waiting = scheduler_stats.num_waiting_reqs
                load.kv_usage = float(scheduler_stats.kv_cache_usage)
                held = gauges(scheduler_stats.kv_connector_stats)
                if held is not None:
                    load.pinned_blocks, load.leases = held
                load.add_transfers(scheduler_stats.kv_connector_stats)

        def log_engine_initialized(self) -> None:
            pass

    return LoadLogger


class IndexLink:
    def __init__(self, settings: WorkerSettings, load: Load) -> None:
        self.settings = settings
        self.load = load
        self.store = RedisStore(settings.redis_url, prefix=settings.redis_prefix)
        self.endpoints = EventEndpoints.private()
        self.epoch = new_epoch()  # made later than the previous life's in start()
        self.tasks: list[asyncio.Task[None]] = []
        self.record: WorkerRecord | None = None
        self.sink: EventSink | None = None
        self.loras: Callable[[], Awaitable[list[str]]] | None = None

    def kv_events_config(self) -> dict[str, Any]:
        return events_config(self.endpoints)

    async def start(
        self,
        info: EngineInfo,
        grpc_port: int,
        loras: Callable[[], Awaitable[list[str]]] | None = None,
    ) -> None:
        """``loras``: the LoRA adapters resident in the engine now, for every heartbeat."""
        s = self.settings
        self.loras = loras
        # Later than the previous life of this name even if its machine's clock was ahead:
        # the index's fence orders lives by epoch (pdserve.kvindex.epochs).
        with contextlib.suppress(IndexUnavailable):
            self.epoch = new_epoch(after=await self.store.recorded_epoch(s.name))
        self.record = WorkerRecord(
            worker_id=s.name, role=s.role, address=f"{s.reachable_host}:{grpc_port}",
            epoch=self.epoch, model=info.served_model_name, block_size=info.block_size,
            max_model_len=info.max_model_len, kv_compat=info.kv_compat,
        )  # fmt: skip
        # Announce (the new epoch) before any entry is written: a gateway reaping the previous
        # incarnation of this name then leaves the new entries alone.
        with contextlib.suppress(IndexUnavailable):
            await self.store.announce(self.record, HEARTBEAT_S * TTL_HEARTBEATS)
        sink = EventSink(
            self.store, info.served_model_name, s.name, self.endpoints, info.num_kv_blocks,
            epoch=self.epoch,
        )  # fmt: skip
        # Both restart after a failure (pdserve.runtime.supervise): the sink rewrites the
        # worker's whole set first, so a crash leaves no index frozen or stale.
        self.sink = sink
        self.tasks = [
            start_task(sink.run, "kv-event-sink"),
            start_task(self._heartbeat, "worker-heartbeat"),
        ]

    async def _heartbeat(self) -> None:
        assert self.record is not None
        warned = False
        while True:
            self.record.load = {k: float(v) for k, v in asdict(self.load).items()}
            if self.loras is not None:
                try:
                    self.record.loras = await self.loras()
                except Exception as exc:  # a stopping engine: the record keeps the last list
                    log.debug("cannot list the engine's LoRA adapters: %s", exc)
            try:
                await self.store.announce(self.record, HEARTBEAT_S * TTL_HEARTBEATS)
                warned = False
            except IndexUnavailable as exc:
                if not warned:
                    log.warning("cannot announce %s: %s (retrying)", self.settings.name, exc)
                warned = True
            await asyncio.sleep(HEARTBEAT_S)

    async def stop(self) -> None:
        for (
            task
        ) in self.tasks:  # talk to Redis: one cancel may be swallowed (pdserve.runtime.tasks)
            await cancel_and_wait(task)
        if self.record is not None:
            with contextlib.suppress(IndexUnavailable):
                await self.store.withdraw(self.settings.name)
                await self.store.clear_worker(self.record.model, self.settings.name, self.epoch)
        await self.store.close()
        self.endpoints.remove()
