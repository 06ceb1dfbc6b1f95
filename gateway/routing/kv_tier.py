"""The shared KV tier (LMCache) in the prefix index: what the gateway writes, reads and corrects.

A worker started with a shared tier (``--kv-tier redis|fs|lm``) reports its identity and chunk
size in its capabilities. Every worker naming the same identity reads what any of them stored,
so the tier is one more holder in the prefix index, ``tier:<identity>``, next to the workers.
Workers publish only their own engine's blocks; the tier's entries are the gateway's:

- written after a prefill worker with the tier computed a prompt: LMCache stores every whole
  chunk it computed, i.e. the leading ``n // chunk * chunk`` tokens of an ``n``-token prompt
  (a decode worker's LMCache, vLLM role kv_consumer, retrieves but never stores);
- read in the same lookup as the workers' own entries (``tier_tokens``);
- corrected when a worker was served fewer tokens than the index said its tier holds: LMCache
  evicted them, which the index learns only so.

Only tiers whose chunk is a whole number of blocks are indexed (block hashes name prefixes
of whole blocks). Private tiers (cpu, disk) report no identity and are not indexed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.metrics import GatewayMetrics
from gateway.pool import Worker
from pdserve.kvindex.interfaces import BlockOps, IndexUnavailable, PrefixIndex

log = logging.getLogger(__name__)

HOLDER_PREFIX = "tier:"
# A tier's entry count is checked against tier_index_max_blocks every this many stores.
CHECK_EVERY = 32


@dataclass(frozen=True)
class Tier:
    holder: str  # its id in the prefix index
    chunk: int  # tokens per chunk


def tier_of(worker: Worker[Any], block_size: int) -> Tier | None:
    """The worker's shared KV tier as the index knows it; None without one, or when its
    chunks are not whole blocks (then its content cannot be named by block hashes)."""
    caps = worker.capabilities
    if caps is None or not caps.kv_tier or not caps.kv_tier_chunk_tokens:
        return None
    chunk = caps.kv_tier_chunk_tokens
    if block_size <= 0 or chunk % block_size:
        return None
    return Tier(HOLDER_PREFIX + caps.kv_tier, chunk)


def tier_tokens(blocks: int, block_size: int, chunk: int, prompt_len: int) -> int:
    """Prompt tokens LMCache serves when the index says the tier holds ``blocks`` leading
    blocks: whole chunks only (a chunk's key covers its whole prefix), and never the last
    prompt token (a prompt held in full is served all but it)."""
    return max(0, min(blocks * block_size // chunk * chunk, prompt_len - 1))


class TierIndex:
    """Writes the shared tiers' entries in the background: a request never waits on them,
    and a failed write is counted and logged, never raised (the index is best effort)."""

    def __init__(
        self,
        index: PrefixIndex,
        metrics: GatewayMetrics,
        max_blocks: int,
        check_every: int = CHECK_EVERY,
    ) -> None:
        self.index = index
        self.metrics = metrics
        self.max_blocks = max_blocks
        self.check_every = check_every
        self._stores: Counter[tuple[str, str]] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        self._down = False

    def store(self, model: str, holder: str, hashes: Sequence[int]) -> None:
        self._spawn(self._store(model, holder, list(hashes)))

    def correct(self, model: str, holder: str, hashes: Sequence[int]) -> None:
        self.metrics.tier_corrections.inc()
        self._spawn(self.index.apply(model, holder, [BlockOps(removed=list(hashes))]))

    async def _store(self, model: str, holder: str, hashes: list[int]) -> None:
        await self.index.apply(model, holder, [BlockOps(stored=hashes)])
        # Nothing tells the index what the tier evicts, so its entries would only grow:
        # past the bound they are dropped and relearned from the next computed prompts.
        self._stores[(model, holder)] += 1
        if self._stores[(model, holder)] % self.check_every:
            return
        count = await self.index.worker_block_count(model, holder)
        if count > self.max_blocks:
            await self.index.clear_worker(model, holder)
            self.metrics.tier_index_resets.inc()
            log.warning("the prefix index held %d blocks of %s (tier_index_max_blocks %d); "
                        "dropped them", count, holder, self.max_blocks)  # fmt: skip

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._guarded(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guarded(self, work: Coroutine[Any, Any, Any]) -> None:
        try:
            await work
        except IndexUnavailable as exc:
            self.metrics.tier_index_errors.inc()
            if not self._down:
                log.warning("cannot write KV tier entries to the prefix index: %s", exc)
            self._down = True
            return
        self._down = False

    async def close(self) -> None:
        """Wait for the writes under way (each bounded by the index's own timeout)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


@dataclass(frozen=True)
class TierFeedback:
    """One request's routing lookup, kept until its prompt was computed (``RouteFeedback``).

    ``held``: tier holder -> leading blocks of the prompt the index held for it at routing.
    """

    tiers: TierIndex
    model: str
    hashes: Sequence[int]
    block_size: int
    prompt_len: int
    held: Mapping[str, int]

    def computed(self, worker: Worker[Any], cached_tokens: int) -> None:
        tier = tier_of(worker, self.block_size)
        if tier is None:
            return
        held = self.held.get(tier.holder)
        if held is not None:
            indexed = tier_tokens(held, self.block_size, tier.chunk, self.prompt_len)
            if cached_tokens < indexed:
                # The tier served less than its entries claim: it holds no chunk from the
                # first one not served. This request's chunks are not written back either:
                # a tier that keeps losing them (or stores nothing) must not be predicted
                # again on the next request; a later computation that is served as
                # predicted writes them.
                first = cached_tokens // tier.chunk * tier.chunk // self.block_size
                self.tiers.correct(self.model, tier.holder, self.hashes[first:held])
                return
        if worker.role_name != "prefill":
            return  # a decode worker's LMCache (kv_consumer) retrieves but never stores
        stored = self.prompt_len // tier.chunk * tier.chunk // self.block_size
        if stored > (held or 0):
            self.tiers.store(self.model, tier.holder, self.hashes[:stored])
