"""In-memory prefix index and registry, for unit tests and single-process runs."""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import Sequence

from pdserve.kvindex.interfaces import BlockOps, WorkerRecord


class MemoryIndex:
    def __init__(self) -> None:
        self.blocks: dict[tuple[str, int], set[str]] = defaultdict(set)
        self.by_worker: dict[tuple[str, str], set[int]] = defaultdict(set)

    async def apply(self, model: str, worker: str, ops: Sequence[BlockOps]) -> None:
        for op in ops:
            if op.cleared:
                await self.clear_worker(model, worker)
            for h in op.stored:
                self.blocks[(model, h)].add(worker)
                self.by_worker[(model, worker)].add(h)
            for h in op.removed:
                self.blocks[(model, h)].discard(worker)
                self.by_worker[(model, worker)].discard(h)

    async def clear_worker(self, model: str, worker: str) -> None:
        for h in self.by_worker.pop((model, worker), set()):
            self.blocks[(model, h)].discard(worker)

    async def replace_worker(self, model: str, worker: str, hashes: Sequence[int]) -> None:
        await self.apply(model, worker, [BlockOps(cleared=True, stored=hashes)])

    async def worker_block_count(self, model: str, worker: str) -> int:
        return len(self.by_worker.get((model, worker), ()))

    async def longest_prefixes(
        self, model: str, hashes: Sequence[int], workers: Sequence[str]
    ) -> dict[str, int]:
        counts = dict.fromkeys(workers, 0)
        for worker in workers:
            for h in hashes:
                if worker not in self.blocks.get((model, h), ()):
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
