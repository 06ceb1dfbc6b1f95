"""Worker discovery from the Redis registry: workers announce themselves with a heartbeat,
the gateway reads the live ones every ``discovery_interval_s`` and reconciles its pool, and
forgets the prefix-index entries of workers whose heartbeat expired. While Redis is
unreachable the pool keeps the workers it knows (and their health checks go on)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from gateway.pool import WorkerPool
from pdserve.kvindex.interfaces import IndexUnavailable, WorkerRecord, WorkerRegistry
from pdserve.kvindex.redis_store import RedisStore
from pdserve.runtime.supervise import start_task
from pdserve.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# Workers announce themselves every HEARTBEAT_S (2 s) and count as gone after 3 missed: after
# a registry reset, every live worker has announced itself again well within this.
REGISTRY_RESET_GRACE_S = 15.0


class RegistryDiscovery:
    def __init__(
        self, pools: WorkerPool | Sequence[WorkerPool], registry: WorkerRegistry, interval_s: float
    ) -> None:
        # One pool per served model: a record goes to the pool of the model it serves, else
        # to the first (which refuses it and says why in /health).
        self.pools = [pools] if isinstance(pools, WorkerPool) else list(pools)
        self.pool = self.pools[0]
        self.registry = registry
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._down = False
        self._epoch: str | None = None
        self._keep_until = 0.0  # after a registry reset: keep healthy workers until then

    async def start(self, first_pass_s: float) -> None:
        """First sync, bounded by ``first_pass_s`` (a slow registry or worker must not keep
        the gateway from starting: the loop catches up), then the discovery loop."""
        try:
            await asyncio.wait_for(self.sync(), first_pass_s)
        except TimeoutError:
            log.warning("first worker discovery did not finish in %.1f s; continuing", first_pass_s)
        # A failed pass restarts the loop (pdserve.runtime.supervise): discovery goes on.
        self._task = start_task(self._loop, "gateway-discovery")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)  # one cancel may be swallowed (pdserve.runtime.tasks)

    async def sync(self) -> None:
        try:
            epoch = await self.registry.registry_epoch()
            if isinstance(self.registry, RedisStore):
                view = await self.registry.registry_view()  # one read for both
                records = [record for record, alive in view if alive]
                for worker in await self.registry.reap_dead(view):
                    log.warning("worker %s missed its heartbeats; its index entries are gone",
                                worker)  # fmt: skip
            else:
                records = await self.registry.alive_workers()
        except IndexUnavailable as exc:
            if not self._down:
                log.warning("worker registry unreachable (%s); keeping the known workers", exc)
            self._down = True
            return
        if self._down:
            log.info("worker registry reachable again")
        self._down = False
        if self._epoch is not None and epoch != self._epoch:
            log.warning(
                "the worker registry lost its data (Redis restarted?): known workers stay while "
                "they answer their health checks, for %.0f s, until they announce themselves",
                REGISTRY_RESET_GRACE_S,
            )
            self._keep_until = time.monotonic() + REGISTRY_RESET_GRACE_S
        self._epoch = epoch
        keep = time.monotonic() < self._keep_until
        if len(self.pools) == 1:
            await self.pool.reconcile(records, keep_missing=keep)
            return
        of_model = {pool.model_name: pool for pool in self.pools}
        shares: dict[WorkerPool, list[WorkerRecord]] = {pool: [] for pool in self.pools}
        for record in records:
            shares[of_model.get(record.model, self.pool)].append(record)
        await asyncio.gather(
            *(pool.reconcile(share, keep_missing=keep) for pool, share in shares.items())
        )

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.sync()
