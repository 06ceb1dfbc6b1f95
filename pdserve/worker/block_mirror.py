"""The worker's own copy of which blocks its engine caches, kept from the engine's KV events.

The prefix index in Redis is a shared copy of the same set; when Redis loses it (a restart,
a flush, a gateway that reaped this worker during a stall), the worker rewrites its whole set
from here, not only what vLLM's replay buffer still holds. The set follows the same operations
as the index (``BlockOps``: cleared first, then stored, then removed), so both hold the same
hashes while Redis is reachable. It is bounded by the engine's block count: a cache never holds
more distinct blocks, so anything beyond it is stale (a removal that was missed) and the
oldest entries go first. It also keeps which of them begin a prompt (``BlockOps``), so that
a rewrite keeps them findable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdserve.kvindex.interfaces import BlockOps


class BlockMirror:
    def __init__(self, max_blocks: int = 0) -> None:
        """``max_blocks``: the engine's KV block count (0: unbounded)."""
        self.max_blocks = max_blocks
        self._hashes: dict[int, None] = {}  # insertion order: oldest first
        self._first: set[int] = set()  # those that begin a prompt

    def __len__(self) -> int:
        return len(self._hashes)

    def hashes(self) -> list[int]:
        return list(self._hashes)

    def first_blocks(self) -> list[int]:
        return [h for h in self._first if h in self._hashes]

    def apply(self, ops: Iterable[BlockOps]) -> list[int]:
        """Apply one step's operations; returns the hashes dropped to stay within the bound
        (the caller removes them from the index too)."""
        for op in ops:
            if op.cleared:
                self._hashes.clear()
                self._first.clear()
            for h in op.stored:
                self._hashes.pop(h, None)  # stored again: now the newest
                self._hashes[h] = None
            self._first.update(op.first_blocks)
            for h in op.removed:
                self._hashes.pop(h, None)
                self._first.discard(h)
        return self._trim()

    def _trim(self) -> list[int]:
        if not self.max_blocks or len(self._hashes) <= self.max_blocks:
            return []
        excess: Sequence[int] = list(self._hashes)[: len(self._hashes) - self.max_blocks]
        for h in excess:
            del self._hashes[h]
            self._first.discard(h)
        return list(excess)
