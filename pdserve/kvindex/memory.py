"""In-memory prefix index and registry, for unit tests and single-process runs."""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import Sequence

from pdserve.kvindex.epochs import may_claim, may_write
from pdserve.kvindex.interfaces import BlockOps, WorkerRecord


class MemoryIndex:
    """The same layout and fence rule as ``redis_store`` (``pdserve.kvindex.epochs``)."""

    def __init__(self) -> None:
        self.by_worker: dict[tuple[str, str], set[int]] = defaultdict(set)
        self.fences: dict[tuple[str, str], str] = {}

    def _fence(self, model: str, holder: str) -> str:
        return self.fences.get((model, holder), "")

    async def apply(
        self, model: str, worker: str, ops: Sequence[BlockOps], epoch: str = ""
    ) -> bool:
        if not may_write(epoch, self._fence(model, worker)):
            return False
        held = self.by_worker[(model, worker)]
        for op in ops:
            if op.cleared:
                held.clear()
            held.update(op.stored)
            held.difference_update(op.removed)
        if not held:
            del self.by_worker[(model, worker)]
        return True

    async def clear_worker(self, model: str, worker: str, epoch: str = "") -> bool:
        if not may_claim(epoch, self._fence(model, worker)):
            return False
        self.by_worker.pop((model, worker), None)
        self.fences.pop((model, worker), None)
        return True

    async def replace_worker(
        self, model: str, worker: str, hashes: Sequence[int], epoch: str = ""
    ) -> bool:
        if not await self.clear_worker(model, worker, epoch):
            return False
        if epoch:
            self.fences[(model, worker)] = epoch
        if hashes:
            self.by_worker[(model, worker)] = set(hashes)
        return True

    async def worker_block_count(self, model: str, worker: str) -> int:
        return len(self.by_worker.get((model, worker), ()))

    async def longest_prefixes(
        self, model: str, hashes: Sequence[int], workers: Sequence[str]
    ) -> dict[str, int]:
        counts = dict.fromkeys(workers, 0)
        for worker in workers:
            held = self.by_worker.get((model, worker), set())
            for h in hashes:
                if h not in held:
                    break
                counts[worker] += 1
        return counts


class MemoryRegistry:
    def __init__(self) -> None:
        self.records: dict[str, tuple[WorkerRecord, float]] = {}
        self.epoch = uuid.uuid4().hex

    async def registry_epoch(self) -> str:
        return self.epoch

    async def announce(self, record: WorkerRecord, ttl_s: float) -> None:
        self.records[record.worker_id] = (record, time.monotonic() + ttl_s)

    async def withdraw(self, worker_id: str) -> None:
        self.records.pop(worker_id, None)

    async def alive_workers(self) -> list[WorkerRecord]:
        now = time.monotonic()
        return [record for record, expiry in self.records.values() if expiry > now]
