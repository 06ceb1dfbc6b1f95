"""Feeds the prefix index from the worker's own engine: vLLM's KV cache events.

The engine publishes each step's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
events on a local ZMQ socket with a sequence number, and keeps the last steps for replay.
``EventSink`` subscribes, keeps its own copy of the engine's cached blocks (``BlockMirror``),
and applies every step atomically to the index. It repairs what it missed: a sequence gap is
filled from the replay buffer; when the stream is quiet it asks the buffer for anything newer,
so a lost last step is found even if no further step follows. Whenever the index may have
lost this worker's entries (a write failed: Redis was unreachable; or, checked every
``CHECK_S``, the index holds another number of blocks than the copy: Redis restarted empty,
was flushed, or a gateway reaped the worker), the sink rewrites the worker's whole set from
its copy, however old the blocks are (vLLM's replay buffer holds only recent steps).

Every write carries this life's ``epoch`` and obeys the index's fence
(``pdserve.kvindex.epochs``): a step the fence drops (a gateway reaped the entries, or a newer
life of this worker took them over) makes the sink rewrite; a rewrite the fence drops means a
newer life owns the entries, and this sink writes no more (``fenced``).

Both sockets are ``ipc://`` paths in a private temporary directory, not loopback TCP ports:
a port chosen as "free" here would be bound by the engine a minute later, after it loads,
and anything else on the machine may take it in between. A path in a directory only this
worker knows cannot be taken.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pdserve.kvindex.hashing import MASK_64
from pdserve.kvindex.interfaces import BlockOps, IndexUnavailable, PrefixIndex
from pdserve.worker import owned_dirs
from pdserve.worker.block_mirror import BlockMirror

log = logging.getLogger(__name__)

TOPIC = b"kv"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_MS = 3000
CHECK_S = 2.0  # how often the index's count of this worker's blocks is compared with the copy


# A unix socket path is at most 107 bytes; a longer temporary directory is not used.
_MAX_DIR_CHARS = 80


@dataclass(frozen=True)
class EventEndpoints:
    """Where the engine publishes (``publish``, its PUB socket binds) and serves replays
    (``replay``, its ROUTER socket binds); ``directory`` holds both and is this worker's."""

    directory: Path
    publish: str
    replay: str

    @classmethod
    def private(cls) -> EventEndpoints:
        """Two ``ipc://`` endpoints in a new directory (mode 0700), removed by ``remove``
        or, at the latest, when the endpoints are garbage or the process exits (or, if it
        is killed, by the next worker that makes one: ``owned_dirs.make``)."""
        base = tempfile.gettempdir()
        if len(base) > _MAX_DIR_CHARS:
            base = "/tmp"  # the directory made in it is private (0700)
        directory = owned_dirs.make("pdserve-kv-", base)
        endpoints = cls(directory, f"ipc://{directory}/events", f"ipc://{directory}/replay")
        weakref.finalize(endpoints, shutil.rmtree, directory, True)
        return endpoints

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def events_config(endpoints: EventEndpoints) -> dict[str, Any]:
    """vLLM ``--kv-events-config``: the engine binds both endpoints (vLLM binds ``ipc://``
    ones) and the worker's sink connects to them."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoints.publish,
        "replay_endpoint": endpoints.replay,
        "topic": TOPIC.decode(),
    }


def _hash(value: int | bytes) -> int:
    return value if isinstance(value, int) else int.from_bytes(value, "big") & MASK_64


def to_ops(events: Iterable[Any]) -> list[BlockOps]:
    """One ``BlockOps`` per event, in order. A LoRA adapter's blocks are indexed as any: vLLM's
    hashes of them name the adapter, and the gateway hashes an adapter's prompts the same way."""
    ops = []
    for event in events:
        kind = type(event).__name__
        if kind == "AllBlocksCleared":
            ops.append(BlockOps(cleared=True))
        elif getattr(event, "group_idx", None) not in (None, 0):
            continue
        elif kind == "BlockStored":
            # No parent: the first block stored is a prompt's first (lookups start there).
            first = getattr(event, "parent_block_hash", None) is None
            ops.append(BlockOps(stored=[_hash(h) for h in event.block_hashes], starts_prompt=first))
        elif kind == "BlockRemoved":
            ops.append(BlockOps(removed=[_hash(h) for h in event.block_hashes]))
    return ops


class EventSink:
    def __init__(
        self,
        index: PrefixIndex,
        model: str,
        worker: str,
        endpoints: EventEndpoints,
        max_blocks: int = 0,
        epoch: str = "",
    ) -> None:
        """``max_blocks``: the engine's KV block count (bounds the copy; 0: unbounded);
        ``epoch``: this worker life's (its registry record's), carried by every write."""
        from vllm.distributed.kv_events import KVEventBatch

        self.index, self.model, self.worker, self.epoch = index, model, worker, epoch
        self.publish, self.replay = endpoints.publish, endpoints.replay
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.context = zmq.asyncio.Context()
        self.mirror = BlockMirror(max_blocks)
        self.last_seq = -1
        # The index must be rewritten from the copy; at start too, so that the previous
        # incarnation's entries go.
        self.dirty = True
        self.next_check = 0.0
        self.applied_steps = 0
        self.rewrites = 0
        self.malformed = 0  # frames skipped: not a step of vLLM's KV events
        self.dropped_steps = 0  # steps the index's fence dropped
        self.fenced = False  # a newer life of this worker owns its entries: write no more

    async def run(self) -> None:
        """Follow the engine until cancelled. Run again after a failure (the worker's link
        restarts it: ``pdserve.runtime.supervise``), it first rewrites the whole set, as
        after a Redis restart: whatever the failure interrupted is then in the index."""
        if self.context.closed:
            self.context = zmq.asyncio.Context()
        self.dirty = True
        sub = self.context.socket(zmq.SUB)
        # The engine binds (it may not have yet: ZMQ connects when it does); what it
        # publishes before the subscription reaches it is replayed.
        sub.connect(self.publish)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        loop = asyncio.get_running_loop()
        try:
            while True:
                if self.fenced:
                    pass  # the engine is still followed (its replay asked), not written
                elif self.dirty:
                    await self._rewrite()
                elif loop.time() >= self.next_check:
                    await self._check()
                try:
                    frames = await asyncio.wait_for(sub.recv_multipart(), timeout=1.0)
                except TimeoutError:
                    # Quiet for a second: ask the buffer whether a step slipped past us (the
                    # publisher drops steps sent before it has seen our subscription).
                    await self._replay_from(self.last_seq + 1)
                    continue
                if len(frames) != 3:
                    self._skip(f"{len(frames)} frames instead of 3")
                    continue
                _, seq_bytes, payload = frames
                await self._on_step(int.from_bytes(seq_bytes, "big"), payload)
        finally:
            sub.close(linger=0)
            self.context.term()

    async def _on_step(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            return  # already applied
        if seq > self.last_seq + 1:
            log.info("KV events %d..%d missed; replaying them", self.last_seq + 1, seq - 1)
            await self._replay_from(self.last_seq + 1)
            if seq <= self.last_seq:
                return
        await self._apply(seq, payload)

    async def _apply(self, seq: int, payload: bytes) -> None:
        """Apply one step to the copy, and to the index unless it awaits a rewrite anyway;
        a step that does not decode is skipped (``_skip``)."""
        try:
            ops = to_ops(self.decoder.decode(payload).events)
        except msgspec.DecodeError as exc:  # ValidationError too
            self.last_seq = seq  # the replay buffer holds the same bytes: asking again won't help
            self._skip(f"step {seq}: {exc}")
            return
        dropped = self.mirror.apply(ops)
        if dropped:
            ops.append(BlockOps(removed=dropped))
        self.last_seq = seq
        self.applied_steps += 1
        if self.dirty or self.fenced:
            return
        try:
            applied = await self.index.apply(self.model, self.worker, ops, self.epoch)
        except IndexUnavailable as exc:
            log.warning("prefix index unavailable (%s); will rewrite it when it is back", exc)
            self.dirty = True
            return
        if not applied:
            # Reaped (the fence is gone) or taken over by a newer life: the rewrite tells.
            self.dropped_steps += 1
            self.dirty = True

    def _skip(self, what: str) -> None:
        """Count a frame that is not a step of KV events; log the first ones and every 1000th."""
        self.malformed += 1
        if self.malformed <= 10 or self.malformed % 1000 == 0:
            log.warning("skipped malformed KV event frame #%d (%s)", self.malformed, what)

    async def _check(self) -> None:
        """Does the index still hold as many blocks of this worker as the copy?"""
        self.next_check = asyncio.get_running_loop().time() + CHECK_S
        try:
            held = await self.index.worker_block_count(self.model, self.worker)
        except IndexUnavailable as exc:
            log.warning("prefix index unavailable (%s); will rewrite it when it is back", exc)
            self.dirty = True
            return
        if held != len(self.mirror):
            log.warning(
                "prefix index holds %d blocks of %s, its engine %d (Redis restarted or "
                "flushed?); rewriting them",
                held,
                self.worker,
                len(self.mirror),
            )
            self.dirty = True

    async def _rewrite(self) -> None:
        """Replace this worker's entries with the copy's whole set."""
        try:
            claimed = await self.index.replace_worker(
                self.model,
                self.worker,
                self.mirror.hashes(),
                self.epoch,
                first_blocks=self.mirror.first_blocks(),
            )
        except IndexUnavailable:
            await asyncio.sleep(1.0)
            return
        if not claimed:
            self.fenced = True
            log.warning(
                "a newer life of %s owns its prefix index entries (epoch %s is older); this "
                "one writes no more",
                self.worker,
                self.epoch,
            )
            return
        self.dirty = False
        self.rewrites += 1
        self.next_check = asyncio.get_running_loop().time() + CHECK_S
        log.info("prefix index of %s rewritten: %d blocks", self.worker, len(self.mirror))

    async def _replay_from(self, start: int) -> None:
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replay)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while await dealer.poll(REPLAY_TIMEOUT_MS):
                frames = await dealer.recv_multipart()
                seq_bytes, payload = frames[-2], frames[-1]
                if seq_bytes == END_SEQ:
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self.last_seq:
                    if seq > self.last_seq + 1 and self.last_seq >= 0:
                        log.warning("KV events before %d are gone from the buffer", seq)
                    await self._apply(seq, payload)
            log.warning("no answer from the engine's KV event replay; continuing live")
        finally:
            dealer.close(linger=0)
