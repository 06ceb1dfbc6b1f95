"""Contracts of the prefix index and the worker registry (implemented in ``redis_store``
and ``memory``). All methods are coroutines; any may raise ``IndexUnavailable`` when the
backing store cannot be reached, and callers degrade (route by load only) instead of failing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


class IndexUnavailable(Exception):
    """The store behind the index or registry cannot be reached right now."""


@dataclass(frozen=True)
class BlockOps:
    """One engine step's changes to a worker's cached blocks, in order.

    ``starts_prompt``: ``stored[0]`` is the first block of a prompt (vLLM's ``BlockStored``
    with no ``parent_block_hash``). A lookup finds a holder through the first block of the
    prompt it asks about, so a chain is found only if its first block was stored so."""

    stored: Sequence[int] = ()
    removed: Sequence[int] = ()
    cleared: bool = False  # all of the worker's blocks are gone (applied first)
    starts_prompt: bool = True

    @property
    def first_blocks(self) -> Sequence[int]:
        """The stored hashes that begin a prompt (none, or the first)."""
        return self.stored[:1] if self.starts_prompt else ()


class PrefixIndex(Protocol):
    """Writes carry the writer's ``epoch`` (its worker life, ``pdserve.kvindex.epochs``; ""
    for an unfenced holder such as a shared KV tier) and return whether they went through:
    False means the fence dropped them (another life of the holder owns its entries)."""

    async def apply(
        self, model: str, worker: str, ops: Sequence[BlockOps], epoch: str = ""
    ) -> bool:
        """Apply the changes to the worker's set atomically, if ``epoch`` is its fence."""

    async def clear_worker(self, model: str, worker: str, epoch: str = "") -> bool:
        """Forget every block of ``worker`` and its fence (clean stop, a tier past its
        bound), unless a newer life than ``epoch`` owns them."""

    async def replace_worker(
        self,
        model: str,
        worker: str,
        hashes: Sequence[int],
        epoch: str = "",
        first_blocks: Sequence[int] = (),
    ) -> bool:
        """Make ``hashes`` exactly the blocks of ``worker`` and ``epoch`` its fence (the
        worker's own copy, at its start or after the index lost it), unless a newer life owns
        them; ``first_blocks``: those of them that begin a prompt (``BlockOps``). A reader sees
        the old set or a growing part of the new one, never a block the worker does not
        hold."""

    async def worker_block_count(self, model: str, worker: str) -> int:
        """How many blocks the index holds for ``worker``."""

    async def longest_prefixes(
        self, model: str, hashes: Sequence[int], workers: Sequence[str]
    ) -> dict[str, int]:
        """For each worker, how many leading ``hashes`` it holds (one round trip); only a
        worker that holds ``hashes[0]`` as a prompt's first block holds any."""


@dataclass
class WorkerRecord:
    """What a worker announces about itself; ``epoch`` changes on every start."""

    worker_id: str
    role: str  # "prefill" | "decode"
    address: str  # gRPC host:port
    epoch: str
    model: str  # served model name
    block_size: int = 0
    max_model_len: int = 0
    kv_compat: dict[str, str] = field(default_factory=dict)
    load: dict[str, float] = field(default_factory=dict)  # running, waiting, kv_usage, ...
    # LoRA adapters resident in its engine's LoRA cache now (a request for another loads it)
    loras: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerRecord:
        data: dict[str, Any] = json.loads(text)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class WorkerRegistry(Protocol):
    async def announce(self, record: WorkerRecord, ttl_s: float) -> None:
        """Register or refresh the worker; it counts as alive for ``ttl_s`` seconds."""

    async def withdraw(self, worker_id: str) -> None:
        """Remove the worker at once (clean shutdown)."""

    async def alive_workers(self) -> list[WorkerRecord]:
        """Every worker whose heartbeat has not expired, with its latest record."""

    async def registry_epoch(self) -> str:
        """An id of the registry's life: it changes when the registry lost its data (a Redis
        restarted empty), so that a reader can tell "every worker left" from "forgotten"."""
