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
        self.first: dict[tuple[str, str], set[int]] = defaultdict(set)  # prompts' first blocks
        self.fences: dict[tuple[str, str], str] = {}

    def _fence(self, model: str, holder: str) -> str:
        return self.fences.get((model, holder), "")

    async def apply(
        self, model: str, worker: str, ops: Sequence[BlockOps], epoch: str = ""
    ) -> bool:
        if not may_write(epoch, self._fence(model, worker)):
            return False
        held, first = self.by_worker[(model, worker)], self.first[(model, worker)]
        for op in ops:
            if op.cleared:
                held.clear()
                first.clear()
            held.update(op.stored)
            first.update(op.first_blocks)
            held.difference_update(op.removed)
            first.difference_update(op.removed)
        if not held:
            del self.by_worker[(model, worker)]
        if not first:
            del self.first[(model, worker)]
        return True

    async def clear_worker(self, model: str, worker: str, epoch: str = "") -> bool:
        if not may_claim(epoch, self._fence(model, worker)):
            return False
        self.by_worker.pop((model, worker), None)
        self.first.pop((model, worker), None)
        self.fences.pop((model, worker), None)
        return True

    async def replace_worker(
        self,
        model: str,
        worker: str,
        hashes: Sequence[int],
        epoch: str = "",
        first_blocks: Sequence[int] = (),
    ) -> bool:
        if not await self.clear_worker(model, worker, epoch):
            return False
        if epoch:
            self.fences[(model, worker)] = epoch
        if hashes:
            self.by_worker[(model, worker)] = set(hashes)
            first = set(first_blocks) & set(hashes)
            if first:
                self.first[(model, worker)] = first
        return True

    async def worker_block_count(self, model: str, worker: str) -> int:
        return len(self.by_worker.get((model, worker), ()))

    async def longest_prefixes(
        self, model: str, hashes: Sequence[int], workers: Sequence[str]
    ) -> dict[str, int]:
        counts = dict.fromkeys(workers, 0)
        for worker in workers:
            if not hashes or hashes[0] not in self.first.get((model, worker), ()):
                continue
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
