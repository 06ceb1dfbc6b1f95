"""The static worker pool: one client per configured worker, health from ``GetCapabilities``.

Capabilities are fetched at start and every ``health_interval_s`` (each pass spread over the
interval in small slices, ``paced_refresh``); a worker whose call fails
(or that reports the wrong role) is unhealthy and skipped until a later refresh succeeds. A
worker that fails a request is ejected at once (``mark_failed``, a circuit breaker: no probe
before its ejection time, which doubles while it keeps failing); while a worker is not
healthy its ``down`` event is set, and requests streaming from it move on. Pairs of prefill and
decode workers whose ``kv_compat`` maps differ are never compatible (``gateway.pairing``); each
such pair is logged once as an error saying why, and listed in ``GET /health``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from decode_service.client import DecodeClient
from gateway.config import GatewaySettings
from gateway.decode_pace import DecodePace
from gateway.pairing import pairing_problem
from gateway.prefill_pace import PrefillPace
from pdserve.kvindex.interfaces import WorkerRecord
from pdserve.rpc.client import RpcCallError
from pdserve.runtime.supervise import start_task
from pdserve.runtime.tasks import cancel_and_wait
from prefill_service.client import PrefillClient
from protos.v1 import worker_pb2

log = logging.getLogger(__name__)

C = TypeVar("C", PrefillClient, DecodeClient)
T = TypeVar("T")
W = TypeVar("W", bound="Worker[Any]")
MAX_EJECT_S = 60.0
# Health checks started together in the refresh loop: its pass spreads the workers' checks
# over ``health_interval_s`` in slices this large. 256 checks started at once took 45-60 ms
# of the gateway's CPU in a burst and stalled its event loop for up to 21 ms, and every
# routing decision waiting meanwhile (pdserve bench fleet at 128 + 128 workers).
REFRESH_SLICE = 8


@dataclass(eq=False)
class Worker(Generic[C]):
    """One configured worker and what the gateway last learned about it."""

    address: str
    role: int  # worker_pb2.Role
    client: C
    capabilities: worker_pb2.Capabilities | None = None
    healthy: bool = False
    last_error: str = ""
    discovered: bool = False  # from the Redis registry (else from the static lists)
    refused: str = ""  # why the gateway will not route to it (its identity differs)
    in_flight: int = 0  # this gateway's requests on the worker now
    peer_in_flight: int = 0  # the other gateways' requests on it (gateway.shared_load)
    reported_load: dict[str, float] = field(default_factory=dict)  # the worker's own report
    # The LoRA adapters resident in its engine, as its heartbeat last said (None: no heartbeat)
    reported_loras: frozenset[str] | None = None
    # Prompts it computes: queue and rate (prefill workers; decode workers on the local path)
    pace: PrefillPace = field(default_factory=PrefillPace)
    steps: DecodePace = field(default_factory=DecodePace)  # decode workers: steps, hand-offs
    # Set while the worker is not routable: requests streaming from it move elsewhere at once.
    down: asyncio.Event = field(default_factory=asyncio.Event)
    ejected_until: float = 0.0  # circuit breaker: no health probe before this (monotonic)
    ejections: int = 0  # consecutive ejections (each doubles the wait); 0 after a success
    steps_seen: int = -1  # the engine's step count at its last progress (liveness)
    progress_at: float = 0.0  # when the step count last moved, or the engine was idle

    @property
    def role_name(self) -> str:
        return "prefill" if self.role == worker_pb2.ROLE_PREFILL else "decode"

    @property
    def worker_id(self) -> str:
        """The worker's own name (its key in the prefix index); the address until known."""
        return self.capabilities.worker_id if self.capabilities else self.address

    def reported(self, name: str) -> float:
        """A ``WorkerLoad`` field as the worker last reported it: in its heartbeat (through
        the registry) when that has it, else in its capabilities; 0 when neither does."""
        if name in self.reported_load:
            return float(self.reported_load[name])
        if self.capabilities is not None and hasattr(self.capabilities.load, name):
            return float(getattr(self.capabilities.load, name))
        return 0.0

    def kv_usage(self) -> float:
        """Fraction of the worker's KV cache in use, as it last reported (0..1)."""
        if "kv_usage" in self.reported_load:
            return self.reported_load["kv_usage"]
        return float(self.capabilities.load.kv_usage) if self.capabilities else 0.0

    def holds_lora(self, name: str) -> bool:
        """Whether the adapter ``name`` is resident in the worker's engine, as it last said
        (heartbeat, else capabilities): a request for it runs without loading it first."""
        if self.reported_loras is not None:
            return name in self.reported_loras
        return self.capabilities is not None and name in self.capabilities.resident_lora_adapters

    def adapter_path(self, name: str) -> str | None:
        """The path of the LoRA adapter ``name`` on this worker; None: it does not serve it."""
        if self.capabilities is None:
            return None
        found = (a.path for a in self.capabilities.lora_adapters if a.name == name)
        return next(found, None)

    def load(self) -> float:
        """Requests on the worker: this gateway's in flight, the other gateways' in flight
        (as they last published it: ``gateway.shared_load``) and what the engine queues."""
        queued = self.reported_load.get("waiting", 0.0)
        if not self.reported_load and self.capabilities is not None:
            queued = float(self.capabilities.load.waiting)
        return self.in_flight + self.peer_in_flight + queued


PrefillWorker = Worker[PrefillClient]
DecodeWorker = Worker[DecodeClient]


async def unless_down(
    worker: PrefillWorker | DecodeWorker,
    step: asyncio.Future[T],
    timeout_s: float | None = None,
    down: asyncio.Future[object] | None = None,
) -> bool:
    """Wait for ``step`` until the worker is ejected (``down``) or ``timeout_s`` passes; True
    when ``step`` finished, else it is cancelled and waited for. ``down``: a waiter on
    ``worker.down`` to reuse across calls (else one is made for this call)."""
    watcher = down if down is not None else asyncio.ensure_future(worker.down.wait())
    try:
        await asyncio.wait({step, watcher}, timeout=timeout_s, return_when="FIRST_COMPLETED")
    finally:
        if down is None:
            watcher.cancel()
        if not step.done():  # ejected, timed out, or our caller cancelled
            step.cancel()
            await asyncio.wait({step})  # what it held (a stream) is released before we go on
    return not step.cancelled()


def identity_mismatch(
    caps: worker_pb2.Capabilities, model: str, hash_seed: int, redis_prefix: str | None
) -> str:
    """Why a worker cannot serve this gateway ("" when it can): its served model, block-hash
    seed or (``redis_prefix`` given: the gateway uses Redis) Redis key prefix differ. With a
    different seed or prefix its cached prefixes could never be found, silently."""
    if model and caps.served_model_name != model:
        return f"serves model {caps.served_model_name!r}, the gateway serves {model!r}"
    if not caps.HasField("index_keys"):
        return "reports no hash seed or Redis key prefix (a pdserve older than the gateway?)"
    keys = caps.index_keys
    if keys.hash_seed != hash_seed:
        return f"hash seed {keys.hash_seed} differs from the gateway's {hash_seed}"
    if redis_prefix is not None and keys.redis_prefix != redis_prefix:
        return f"Redis key prefix {keys.redis_prefix!r} differs from the gateway's {redis_prefix!r}"
    return ""


class WorkerPool:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        timeout = settings.control_timeout_s
        self.prefill: list[PrefillWorker] = [
            Worker(a, worker_pb2.ROLE_PREFILL, PrefillClient(a, default_timeout_s=timeout))
            for a in settings.prefill_workers
        ]
        self.decode: list[DecodeWorker] = [
            Worker(a, worker_pb2.ROLE_DECODE, DecodeClient(a, default_timeout_s=timeout))
            for a in settings.decode_workers
        ]
        self._incompatible: dict[tuple[str, str], str] = {}  # (prefill, decode) -> why
        # adapters(), kept until a worker's health or capabilities change (every request
        # asks, and reading every worker's adapters each time costs O(workers))
        self._adapters: dict[str, str] | None = None
        self.model_name = ""  # the served model workers must report (set by the gateway)
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[], None]] = []
        # Workers that left the registry: their channels close after a request's time, or
        # at ``close`` at the latest (an open channel outlives its event loop otherwise).
        self._dropped: dict[PrefillWorker | DecodeWorker, asyncio.TimerHandle] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after every refresh and every ``mark_failed``."""
        self._listeners.append(listener)

    def _notify(self) -> None:
        for listener in self._listeners:
            listener()

    async def start(self) -> None:
        """First refresh, bounded by ``control_timeout_s`` (never raises: unreachable or slow
        workers are just unhealthy until a later refresh), then the refresh loop."""
        try:
            await asyncio.wait_for(self.refresh(), self.settings.control_timeout_s + 1.0)
        except TimeoutError:
            log.warning("first worker health check did not finish in time; continuing")
        # A failed refresh restarts the loop (pdserve.runtime.supervise): health checks go on.
        self._task = start_task(self._refresh_loop, "gateway-pool-refresh")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        for handle in self._dropped.values():
            handle.cancel()
        workers: list[PrefillWorker | DecodeWorker] = [*self.prefill, *self.decode, *self._dropped]
        self._dropped.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        for worker in workers:
            await worker.client.close()

    async def _refresh_loop(self) -> None:
        while True:
            await self.paced_refresh(self.settings.health_interval_s)

    async def paced_refresh(self, interval_s: float) -> None:
        """One health pass spread over ``interval_s``: the workers' checks start in slices of
        ``REFRESH_SLICE``, one slice every ``interval_s`` / slices, each without waiting for
        the slice before it (a hung worker's check, up to ``control_timeout_s``, delays no
        other worker's); then the pairing check and the listeners, as ``refresh``. A worker
        that left the pool before its slice is skipped."""
        workers: list[PrefillWorker | DecodeWorker] = [*self.prefill, *self.decode]
        slices = max(1, -(-len(workers) // REFRESH_SLICE))
        started: list[asyncio.Future[list[None]]] = []
        try:
            for i in range(slices):
                await asyncio.sleep(interval_s / slices)
                part = workers[i * REFRESH_SLICE : (i + 1) * REFRESH_SLICE]
                current = [w for w in part if w in self.prefill or w in self.decode]
                started.append(asyncio.gather(*(self._refresh_one(w) for w in current)))
            await asyncio.gather(*started)
        finally:
            for checks in started:
                checks.cancel()  # cancelled (the pool is closing): no check outlives the pass
        self._check_compat()
        self._notify()

    async def refresh(self) -> None:
        workers: list[PrefillWorker | DecodeWorker] = [*self.prefill, *self.decode]
        await asyncio.gather(*(self._refresh_one(w) for w in workers))
        self._check_compat()
        self._notify()

    async def _refresh_one(self, worker: PrefillWorker | DecodeWorker) -> None:
        if time.monotonic() < worker.ejected_until:
            return  # ejected: the breaker is open; the first refresh after it is the probe
        try:
            caps = await worker.client.capabilities()
        except RpcCallError as err:
            self._set_health(worker, False, str(err))
            return
        if caps.role not in (worker.role, worker_pb2.ROLE_UNSPECIFIED):
            actual = worker_pb2.Role.Name(caps.role)
            self._set_health(
                worker, False, f"reports role {actual}, configured as a {worker.role_name} worker"
            )
            return
        mismatch = identity_mismatch(
            caps,
            self.model_name,
            self.settings.hash_seed,
            self.settings.redis_prefix if self.settings.redis_url else None,
        )
        if mismatch:
            if mismatch != worker.refused:
                log.error("refusing to route to %s worker %s: it %s",
                          worker.role_name, worker.address, mismatch)  # fmt: skip
            worker.refused = worker.last_error = mismatch
            worker.healthy = False
            self._adapters = None
            return
        worker.refused = ""
        worker.capabilities = caps
        self._adapters = None
        stalled = self._stalled(worker, caps.load)
        self._set_health(worker, not stalled, stalled)

    def _stalled(self, worker: PrefillWorker | DecodeWorker, load: worker_pb2.WorkerLoad) -> str:
        """Liveness beyond "the gRPC server answers": an engine that has requests must take
        steps. Why the worker is hung ("" while its engine moves or has nothing to do)."""
        now = time.monotonic()
        queued = load.running + load.waiting
        if not queued or load.engine_steps != worker.steps_seen:
            worker.steps_seen = load.engine_steps
            worker.progress_at = now
            return ""
        still = now - worker.progress_at
        if still < self.settings.stall_timeout_s:
            return ""
        return f"its engine took no step for {still:.0f} s with {queued} requests (hung)"

    def _set_health(self, worker: PrefillWorker | DecodeWorker, healthy: bool, why: str) -> None:
        if healthy and not worker.healthy:
            caps = worker.capabilities
            log.info(
                "%s worker %s is healthy (model %s, max_model_len %s)",
                worker.role_name,
                worker.address,
                caps.served_model_name if caps else "?",
                caps.max_model_len if caps else "?",
            )
        elif not healthy and (worker.healthy or why != worker.last_error):
            log.warning("%s worker %s is unhealthy: %s", worker.role_name, worker.address, why)
        worker.healthy = healthy
        worker.last_error = why
        self._adapters = None
        if healthy:
            worker.down.clear()
        else:
            worker.down.set()

    async def reconcile(self, records: Sequence[WorkerRecord], keep_missing: bool = False) -> None:
        """Match the discovered workers to the registry's live ones: add new, drop gone.

        ``keep_missing``: the registry lost its data (a Redis restart) and the workers have
        not announced themselves again yet; a missing worker is dropped only if its own
        health check fails, so the pool is not emptied meanwhile."""
        alive = {(r.role, r.address): r for r in records if r.role in ("prefill", "decode")}
        everyone: list[PrefillWorker | DecodeWorker] = [*self.prefill, *self.decode]
        known = {(w.role_name, w.address): w for w in everyone}
        added: list[PrefillWorker | DecodeWorker] = []
        for key, record in alive.items():
            worker = known.get(key)
            if worker is None:
                worker = self._add(record)
                added.append(worker)
            worker.reported_load = dict(record.load)
            worker.reported_loras = frozenset(record.loras)
        for key, worker in known.items():
            if worker.discovered and key not in alive and not (keep_missing and worker.healthy):
                self._drop(worker)
        if added:
            await asyncio.gather(*(self._refresh_one(w) for w in added))
            self._check_compat()
        self._notify()

    def _add(self, record: WorkerRecord) -> PrefillWorker | DecodeWorker:
        timeout = self.settings.control_timeout_s
        log.info("discovered %s worker %s at %s", record.role, record.worker_id, record.address)
        if record.role == "prefill":
            p = Worker(
                record.address,
                worker_pb2.ROLE_PREFILL,
                PrefillClient(record.address, default_timeout_s=timeout),
                discovered=True,
            )
            self.prefill.append(p)
            return p
        d = Worker(
            record.address,
            worker_pb2.ROLE_DECODE,
            DecodeClient(record.address, default_timeout_s=timeout),
            discovered=True,
        )
        self.decode.append(d)
        return d

    def _drop(self, worker: PrefillWorker | DecodeWorker) -> None:
        """Stop routing to a worker whose heartbeat expired; close its channel later, after
        any request still on it has had the time a request may take."""
        log.warning(
            "%s worker %s left the registry; no longer routing to it",
            worker.role_name,
            worker.address,
        )
        worker.healthy = False
        self._adapters = None
        if worker in self.prefill:
            self.prefill.remove(worker)  # type: ignore[arg-type]
        if worker in self.decode:
            self.decode.remove(worker)  # type: ignore[arg-type]
        self._dropped[worker] = asyncio.get_running_loop().call_later(
            self.settings.request_timeout_s, self._close_dropped, worker
        )

    def _close_dropped(self, worker: PrefillWorker | DecodeWorker) -> None:
        if self._dropped.pop(worker, None) is None:
            return
        task = asyncio.get_running_loop().create_task(worker.client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def mark_failed(self, worker: PrefillWorker | DecodeWorker, why: str) -> None:
        """Circuit breaker: eject ``worker`` (requests streaming from it move elsewhere) for
        ``eject_s``, doubled per consecutive ejection up to ``MAX_EJECT_S``; the first health
        refresh after that probes it back in."""
        wait = min(MAX_EJECT_S, self.settings.eject_s * 2**worker.ejections)
        worker.ejections += 1
        worker.ejected_until = time.monotonic() + wait
        self._set_health(worker, False, f"{why} (ejected for {wait:.0f} s)")
        self._notify()

    @staticmethod
    def mark_ok(worker: PrefillWorker | DecodeWorker) -> None:
        """A request succeeded on ``worker``: the breaker's doubling starts over."""
        worker.ejections = 0

    def _check_compat(self) -> None:
        """Which pairs may exchange KV. Workers are grouped by their ``kv_compat`` and each
        pair of groups is compared once: 128 + 128 workers are 16,384 pairs but usually one
        group (comparing every pair held the event loop for tens of ms at each refresh)."""
        incompatible: dict[tuple[str, str], str] = {}
        decode_groups = _by_compat(self.decode)
        for p_key, prefill in _by_compat(self.prefill).items():
            for d_key, decode in decode_groups.items():
                if p_key == d_key:
                    continue
                why = pairing_problem(prefill[0][1], decode[0][1])
                for p, _ in prefill:
                    for d, _ in decode:
                        pair = (p.address, d.address)
                        incompatible[pair] = why
                        if self._incompatible.get(pair) != why:
                            log.error(
                                "refusing to pair prefill worker %s with decode worker %s: "
                                "kv_compat differs: %s; their requests take the local path",
                                p.address,
                                d.address,
                                why,
                            )
        self._incompatible = incompatible

    def compatible(self, prefill: PrefillWorker, decode: DecodeWorker) -> bool:
        return (prefill.address, decode.address) not in self._incompatible

    def unpaired(self) -> list[tuple[str, str, str]]:
        """(prefill address, decode address, why) of every pair the gateway refuses."""
        return [(p, d, why) for (p, d), why in sorted(self._incompatible.items())]

    def refused(self) -> list[PrefillWorker | DecodeWorker]:
        """Workers reachable but not routed to, because their identity differs."""
        everyone: list[PrefillWorker | DecodeWorker] = [*self.prefill, *self.decode]
        return [w for w in everyone if w.refused]

    def local_in_flight(self) -> dict[str, int]:
        """This gateway's requests in flight per worker id (workers with none left out)."""
        everyone: list[PrefillWorker | DecodeWorker] = [*self.prefill, *self.decode]
        return {w.worker_id: w.in_flight for w in everyone if w.in_flight}

    def set_peer_in_flight(self, totals: Mapping[str, int]) -> None:
        """The other gateways' requests in flight per worker id (a worker not named: 0)."""
        everyone: list[PrefillWorker | DecodeWorker] = [*self.prefill, *self.decode]
        for worker in everyone:
            worker.peer_in_flight = totals.get(worker.worker_id, 0)

    def healthy_prefill(self) -> list[PrefillWorker]:
        return [w for w in self.prefill if w.healthy]

    def healthy_decode(self) -> list[DecodeWorker]:
        return [w for w in self.decode if w.healthy]

    def max_model_len(self) -> int:
        """The smallest context length among healthy decode workers (0: not known yet)."""
        return _min_len(self.healthy_decode()) or _min_len(self.decode)

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters healthy decode workers serve, name -> path (the first worker's
        where two differ: a worker with another path is not routed that adapter's requests,
        see ``WorkerPool.serving``)."""
        if self._adapters is None:
            found: dict[str, str] = {}
            for worker in self.healthy_decode():
                for adapter in worker.capabilities.lora_adapters if worker.capabilities else ():
                    found.setdefault(adapter.name, adapter.path)
            self._adapters = found
        return self._adapters

    @staticmethod
    def serving(workers: Sequence[W], adapter: tuple[str, str] | None) -> list[W]:
        """Those of ``workers`` that serve ``adapter`` (name, path) at that path; all of them
        for the base model (None)."""
        if adapter is None:
            return list(workers)
        name, path = adapter
        return [w for w in workers if w.adapter_path(name) == path]


def _min_len(workers: Sequence[PrefillWorker | DecodeWorker]) -> int:
    lengths = [w.capabilities.max_model_len for w in workers if w.capabilities]
    return min((n for n in lengths if n > 0), default=0)


def _by_compat(
    workers: Sequence[W],
) -> dict[tuple[tuple[str, str], ...], list[tuple[W, worker_pb2.Capabilities]]]:
    """Workers that reported capabilities, grouped by their ``kv_compat`` description."""
    groups: dict[tuple[tuple[str, str], ...], list[tuple[W, worker_pb2.Capabilities]]] = {}
    for w in workers:
        if w.capabilities is not None:
            key = tuple(sorted(w.capabilities.kv_compat.items()))
            groups.setdefault(key, []).append((w, w.capabilities))
    return groups
