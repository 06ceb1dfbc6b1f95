"""Load shared between gateway replicas through Redis, so that several gateways do not all
send to the worker each of them alone thinks least loaded.

Every ``load_share_interval_s`` each gateway writes its requests in flight per worker (only
the non-zero ones) into one Redis hash, ``{<prefix>}:inflight`` (``pdserve.kvindex.keys``;
field: the gateway's id, value: compact JSON ``{"t": wall clock, "i": interval, "w":
{worker id: n}}``), makes the hash expire ``DROP_AFTER_S`` after the last write, and reads
the whole hash back: HSET, PEXPIRE and HGETALL in one non-transactional pipeline on one key
(one slot on a Redis Cluster). The sum of the other live gateways' counts per worker becomes
each worker's ``peer_in_flight``, part of its ``load()`` (``gateway.pool``); the gateway's own
entry is skipped (its local counts are exact).

A peer is live while its entry keeps changing: an entry whose timestamp has not moved for
three of its writer's intervals plus ``MARGIN_S``, measured on this gateway's monotonic clock,
and through at least ``QUIET_READS`` of this gateway's exchanges since, is a dead (or stalled)
gateway's and is ignored. Judging by change rather than by comparing wall clocks keeps a peer
whose clock is off counted correctly; counting our own exchanges too keeps a pause of this
gateway's event loop from making every peer look dead at once. Entries whose wall-clock age
exceeds ``DROP_AFTER_S`` are deleted by whichever gateway reads them.

With Redis unreachable, sharing pauses: nothing is written, the peers' entries age out as
above (their counts fall to 0 within the staleness bound) and routing goes on with this
gateway's own counts. It is logged once when it pauses and once when it resumes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.exceptions import RedisError

from pdserve.runtime.supervise import start_task
from pdserve.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

MARGIN_S = 0.25  # added to three intervals: a peer's write may be late by a busy event loop
QUIET_READS = 2  # exchanges of ours (failed ones too) that saw a peer's entry unchanged
DROP_AFTER_S = 30.0  # entries this old (wall clock) are deleted; the hash expires after it
CLOSE_TIMEOUT_S = 1.0  # removing our own entry at shutdown waits no longer


def gateway_id() -> str:
    """This gateway's id for its life: host name and a short random part (two gateways in
    one host, or a restarted one, never share an entry)."""
    return f"{socket.gethostname()}-{secrets.token_hex(3)}"


@dataclass
class Peer:
    """What this gateway last read of another gateway's entry."""

    written_at: float  # the writer's wall clock
    interval_s: float  # the writer's publishing interval
    counts: dict[str, int]  # worker id -> that gateway's requests in flight on it
    changed_at: float  # our monotonic clock when ``written_at`` last changed
    quiet: int = 0  # our exchanges since then (failed ones too)

    def live(self, now: float) -> bool:
        fresh = now - self.changed_at <= 3 * self.interval_s + MARGIN_S
        return fresh or self.quiet < QUIET_READS


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def parse_entry(raw: bytes | str) -> tuple[float, float, dict[str, int]] | None:
    """(written at, interval, counts) of one entry; None when it is not one (skipped)."""
    try:
        body = json.loads(raw)
        counts = {str(w): int(n) for w, n in body["w"].items()}
        return float(body["t"]), float(body["i"]), counts
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


class SharedLoad:
    """Publishes this gateway's in-flight counts and reads the other gateways' (module doc).

    ``local``: this gateway's requests in flight per worker id (non-zero ones); ``apply``:
    told the other live gateways' summed counts per worker id after every exchange.
    """

    def __init__(
        self,
        client: Any,  # redis.asyncio Redis or RedisCluster
        key: str,
        interval_s: float,
        local: Callable[[], dict[str, int]],
        apply: Callable[[Mapping[str, int]], None],
        registry: CollectorRegistry | None = None,
        own_id: str | None = None,
    ) -> None:
        self.client = client
        self.key = key
        self.interval_s = interval_s
        self.gateway_id = own_id or gateway_id()
        self._local = local
        self._apply = apply
        self.peers: dict[str, Peer] = {}
        self.totals: dict[str, int] = {}
        self._paused = False
        self._task: asyncio.Task[None] | None = None
        self.live_peers = Gauge(
            "pdserve_gateway_peer_gateways",
            "Other gateways whose requests in flight this gateway counts (entries still fresh).",
            registry=registry,
        )
        self.failures = Counter(
            "pdserve_gateway_load_share_failures",
            "Exchanges of requests in flight with the other gateways that failed (Redis down).",
            registry=registry,
        )

    def start(self) -> None:
        """The exchange loop, restarted if it fails (pdserve.runtime.supervise)."""
        self._task = start_task(self._loop, "gateway-shared-load")

    async def close(self) -> None:
        """Stop the loop and remove our entry, so the others stop counting us at once."""
        if self._task is not None:
            await cancel_and_wait(self._task)
        try:
            await asyncio.wait_for(self.client.hdel(self.key, self.gateway_id), CLOSE_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError) as exc:
            log.info("could not remove this gateway's load entry (%s); it ages out", exc)

    async def _loop(self) -> None:
        while True:
            await self.exchange()
            await asyncio.sleep(self.interval_s)

    async def exchange(self) -> None:
        """One round: write our counts, read everyone's; on a Redis error only age the peers."""
        try:
            old = self._read(await self._swap())
            if old:  # a gateway gone long ago: its entry is deleted by whoever sees it
                await self.client.hdel(self.key, *old)
        except (RedisError, OSError) as exc:
            self.failures.inc()
            if not self._paused:
                log.warning("sharing load with other gateways paused: Redis unreachable (%s); "
                            "routing on this gateway's own counts", exc)  # fmt: skip
            self._paused = True
            for peer in self.peers.values():  # nothing read: as unchanged, so they age out
                peer.quiet += 1
        else:
            if self._paused:
                log.info("sharing load with other gateways again")
            self._paused = False
        self._sum()

    async def _swap(self) -> dict[Any, Any]:
        entry = {"t": round(time.time(), 3), "i": self.interval_s, "w": self._local()}
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.key, self.gateway_id, json.dumps(entry, separators=(",", ":")))
        pipe.pexpire(self.key, int(DROP_AFTER_S * 1000))
        pipe.hgetall(self.key)
        replies = await pipe.execute()
        return dict(replies[-1])

    def _read(self, raw: dict[Any, Any]) -> list[str]:
        """Keep the other gateways' entries; the names of those to delete."""
        now, wall = time.monotonic(), time.time()
        seen: dict[str, Peer] = {}
        old = []
        for field, value in raw.items():
            name = _text(field)
            entry = parse_entry(value)
            if name == self.gateway_id or entry is None:
                continue
            written_at, interval_s, counts = entry
            if wall - written_at > DROP_AFTER_S:
                old.append(name)
                continue
            before = self.peers.get(name)
            if before is not None and before.written_at == written_at:
                seen[name] = Peer(written_at, interval_s, counts, before.changed_at,
                                  before.quiet + 1)  # fmt: skip
            else:
                seen[name] = Peer(written_at, interval_s, counts, now)
        self.peers = seen
        return old

    def _sum(self) -> None:
        now = time.monotonic()
        totals: dict[str, int] = {}
        live = 0
        for peer in self.peers.values():
            if not peer.live(now):
                continue
            live += 1
            for worker, n in peer.counts.items():
                totals[worker] = totals.get(worker, 0) + n
        self.totals = totals
        self.live_peers.set(live)
        self._apply(totals)
