"""The shared KV tier holds only what a worker with the deployment secret wrote.

LMCache stores a chunk in a remote backend (Redis, a shared directory, an LMCache server)
through a *remote connector*, and every remote backend it runs (``RemoteBackend``) makes its
connector the same way: by URL, through the connector adapters LMCache registers, including
the "plug and play" adapters named by ``remote_storage_plugins`` and loaded from
``extra_config`` by module path. pdserve configures its shared tier as one such plugin,
``pdserve`` (``pdserve.worker.kv_tier``): ``PdserveTierAdapter`` builds LMCache's own connector
for the real location (``TIER_URL_ENV``: ``redis://``, ``fs://``, ``lm://``) and wraps it in
``IntegrityConnector``, so that every byte between LMCache and the backend passes here:

* store: the chunk is sealed into a record (``kv_transfer.tier_record``: HMAC-SHA256 over its
  key and bytes with a key derived from the deployment secret) and the record is stored;
* lookup (``exists``, ``batched_contains``, ``batched_async_contains``): a chunk counts as
  present only once it has been fetched and its record verified; a verified chunk is put into
  LMCache's local CPU level right away, so the retrieval that follows the lookup reads it there
  instead of fetching it again;
* retrieval (``get``, ``batched_get``, ``batched_get_non_blocking``): the record is verified
  again (it may have changed since the lookup) before its bytes are copied into the memory
  object LMCache loads into the engine.

A record that fails (made without the secret, for another key, changed, not a record at all,
or larger than a chunk can be) is a miss: counted (``REJECTIONS``), logged at most once a minute,
never returned. Inner connectors allocate what they read through ``BoundedAllocator``, which
refuses anything but a record of at most one chunk, so a stored object cannot make a worker
allocate more than that either. The chunk keys, the local CPU level and the engine are
LMCache's as before; only remote bytes are checked here (the local levels hold what this
worker computed or verified).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmcache.logging import init_logger
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import BytesBufferMemoryObj, MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector import (
    ConnectorAdapter,
    ConnectorContext,
    ConnectorManager,
)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kv_transfer.auth import load_secret
from kv_transfer.tier_plugin import PLUGIN, SECRET_FILE_KEY, TIER_URL_ENV
from kv_transfer.tier_record import OVERHEAD, Opened, Rejected, open_record, seal, tier_key

log = init_logger(__name__)

# Chunks fetched at once by a lookup (each is held in memory until verified).
LOOKUP_BATCH = 8
LOG_INTERVAL_S = 60.0


class RejectionLog:
    """Counts refused chunks and logs them at most once per ``interval_s`` (thread-safe)."""

    def __init__(
        self,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        emit: Callable[[str], None] = log.warning,
    ) -> None:
        self.interval_s, self.clock, self.emit = interval_s, clock, emit
        self.lock = threading.Lock()
        self.total = 0
        self.by_reason: dict[str, int] = {}
        self._unlogged = 0
        self._last: float | None = None

    def note(self, name: str, reason: str) -> None:
        with self.lock:
            self.total += 1
            self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
            self._unlogged += 1
            now = self.clock()
            if self._last is not None and now - self._last < self.interval_s:
                return
            count, self._unlogged, self._last = self._unlogged, 0, now
        self.emit(
            f"KV tier: refused {count} stored chunk(s) as a miss since the last report "
            f"({self.total} in all); latest {name}: {reason}"
        )


REJECTIONS = RejectionLog()


class Record(BytesBufferMemoryObj):  # type: ignore[misc]
    """A record as LMCache's connectors store it: a byte buffer (``BINARY_BUFFER``) that
    connectors keep with its own size and format, described once per KV group."""

    def __init__(self, data: bytearray, groups: int) -> None:
        super().__init__(data)
        self.groups = max(1, groups)

    def get_shapes(self) -> list[Any]:
        return [self.get_shape()] + [type(self.get_shape())([0, 0, 0, 0])] * (self.groups - 1)

    def get_dtypes(self) -> list[Any]:
        return [None] * self.groups


def _bytes(obj: MemoryObj) -> memoryview:
    view = memoryview(obj.byte_array)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class BoundedAllocator:
    """LMCache's local CPU backend as an inner connector sees it: it allocates what the
    connector reads, which must be a record (a byte buffer) of at most ``limit`` bytes.
    A stored object that says it is anything else is refused before any memory is taken."""

    def __init__(self, backend: Any, limit: int, rejections: RejectionLog) -> None:
        self._backend, self.limit, self._rejections = backend, limit, rejections

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def allocate(self, shapes: Any, dtypes: Any, fmt: Any = None, *args: Any, **kw: Any) -> Any:
        first = shapes[0] if isinstance(shapes, list) else shapes
        size = int(first[0]) if len(first) else 0
        if fmt != MemoryFormat.BINARY_BUFFER or not 0 < size <= self.limit:
            self._rejections.note("a stored chunk", f"not a pdserve record ({fmt}, {size} B)")
            return None
        return self._backend.allocate(shapes, dtypes, fmt, *args, **kw)


class IntegrityConnector(RemoteConnector):  # type: ignore[misc]
    """``inner`` (one of LMCache's remote connectors) with every chunk sealed on the way in
    and verified on the way out (see the module docstring). Its ``put`` leaves the chunk's
    reference count alone, as LMCache's connectors do (the caller releases it)."""

    def __init__(self, inner: RemoteConnector, key: bytes, loop: asyncio.AbstractEventLoop,
                 local_cpu_backend: Any, timeout_s: float = 10.0,
                 rejections: RejectionLog = REJECTIONS) -> None:  # fmt: skip
        # No RemoteConnector.__init__: ``inner`` did it; its chunk description is ours too
        # (LMCache's health check allocates test chunks from it).
        self.inner, self._key, self.loop = inner, key, loop
        self.local_cpu_backend, self.timeout_s = local_cpu_backend, timeout_s
        self.rejections = rejections
        for name in ("meta_shapes", "meta_dtypes", "meta_fmt", "full_chunk_size_bytes",
                     "single_token_size", "remote_metadata_bytes", "save_chunk_meta"):  # fmt: skip
            setattr(self, name, getattr(inner, name, None))
        self.groups = len(self.meta_shapes or ()) or 1

    # ---- store
    def _seal(self, key: Any, obj: MemoryObj) -> Record:
        name = key.to_string()
        record = seal(self._key, name, _bytes(obj), obj.get_memory_format(),
                      obj.get_shapes(), obj.get_dtypes())  # fmt: skip
        return Record(record, self.groups)

    async def put(self, key: Any, memory_obj: MemoryObj) -> None:
        record = await asyncio.to_thread(self._seal, key, memory_obj)
        await self.inner.put(key, record)

    def support_batched_put(self) -> bool:
        return bool(self.inner.support_batched_put())

    async def batched_put(self, keys: list[Any], memory_objs: list[MemoryObj]) -> None:
        records = await asyncio.to_thread(
            lambda: [self._seal(k, o) for k, o in zip(keys, memory_objs, strict=True)]
        )
        await self.inner.batched_put(keys, records)

    # ---- verification
    def _open(self, key: Any, raw: MemoryObj | None) -> Opened | None:
        if raw is None:
            return None
        name = key.to_string()
        try:
            return open_record(self._key, name, _bytes(raw))
        except Rejected as exc:
            self.rejections.note(name, str(exc))
            return None
        finally:
            raw.ref_count_down()

    async def _fetch(self, keys: Sequence[Any]) -> list[MemoryObj | None]:
        """The stored objects under ``keys`` (None: absent or unreadable)."""
        results = await asyncio.gather(*(self.inner.get(k) for k in keys), return_exceptions=True)
        out: list[MemoryObj | None] = []
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, BaseException):
                self.rejections.note(key.to_string(), f"unreadable: {result!r}")
                result = None
            out.append(result)
        return out

    async def _verified(self, keys: Sequence[Any]) -> list[Opened | None]:
        raws = await self._fetch(keys)
        return await asyncio.to_thread(
            lambda: [self._open(k, r) for k, r in zip(keys, raws, strict=True)]
        )

    def _load(self, opened: Opened | None, busy_loop: bool = True) -> MemoryObj | None:
        """A memory object LMCache can load, holding the verified payload (None: no memory)."""
        if opened is None:
            return None
        obj = self.local_cpu_backend.allocate(opened.shapes, opened.dtypes, opened.fmt,
                                              busy_loop=busy_loop)  # fmt: skip
        if obj is None:
            return None
        target = _bytes(obj)
        if target.nbytes != opened.payload.nbytes:
            obj.ref_count_down()
            return None
        target[:] = opened.payload
        return obj

    async def _verified_prefix(self, keys: Sequence[Any], prefetch: bool) -> int:
        """How many of ``keys``, from the first, are stored and authentic; with ``prefetch``
        those go into the local CPU level (the retrieval that follows finds them there)."""
        found = 0
        for start in range(0, len(keys), LOOKUP_BATCH):
            batch = keys[start : start + LOOKUP_BATCH]
            for key, opened in zip(batch, await self._verified(batch), strict=True):
                if opened is None:
                    return found
                if prefetch:
                    await asyncio.to_thread(self._prefetch, key, opened)
                found += 1
        return found

    def _prefetch(self, key: Any, opened: Opened) -> None:
        local = self.local_cpu_backend
        if local is None or not getattr(local, "use_hot", False) or local.contains(key):
            return
        obj = self._load(opened, busy_loop=False)  # a lookup never waits for memory
        if obj is not None:
            local.submit_put_task(key, obj)
            obj.ref_count_down()

    def _wait(self, coro: Any, default: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(self.timeout_s)
        except TimeoutError:
            future.cancel()
            log.warning("KV tier: a lookup took over %.0f s; counted as a miss", self.timeout_s)
            return default

    # ---- lookup
    async def exists(self, key: Any) -> bool:
        return await self._verified_prefix([key], prefetch=False) == 1

    def exists_sync(self, key: Any) -> bool:
        return bool(self._wait(self.exists(key), False))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        return int(self._wait(self._verified_prefix(keys, prefetch=True), 0))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: list[Any], pin: bool = False
    ) -> int:
        return await self._verified_prefix(keys, prefetch=False)

    # ---- retrieval
    async def get(self, key: Any) -> MemoryObj | None:
        (opened,) = await self._verified([key])
        return await asyncio.to_thread(self._load, opened)

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[MemoryObj | None]:
        opened = await self._verified(keys)
        return await asyncio.to_thread(lambda: [self._load(o) for o in opened])

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[MemoryObj]:
        """The chunks from the first up to the first one missing or refused (LMCache's
        contract); those fetched after it are released."""
        objs = await self.batched_get(keys)
        prefix: list[MemoryObj] = []
        for obj in objs:
            if obj is None:
                break
            prefix.append(obj)
        for obj in objs[len(prefix) :]:
            if obj is not None:
                obj.ref_count_down()
        return prefix

    # ---- everything else is the inner connector's
    def support_ping(self) -> bool:
        return bool(self.inner.support_ping())

    async def ping(self) -> int:
        return int(await self.inner.ping())

    def remove_sync(self, key: Any) -> bool:
        return bool(self.inner.remove_sync(key))

    async def list(self) -> list[str]:
        return list(await self.inner.list() or [])

    async def close(self) -> None:
        await self.inner.close()

    def post_init(self) -> None:
        self.inner.post_init()

    def __repr__(self) -> str:
        return f"<IntegrityConnector over {self.inner!r}>"


class PdserveTierAdapter(ConnectorAdapter):  # type: ignore[misc]
    """LMCache's remote storage plugin ``pdserve`` (``plugin://pdserve``): LMCache's connector
    for the location in ``TIER_URL_ENV``, wrapped in ``IntegrityConnector``. Without the
    deployment secret (``SECRET_FILE_KEY`` in LMCache's ``extra_config``) it refuses to start:
    an unauthenticated shared tier lets anyone who can write it choose what workers load."""

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN}")

    def can_parse(self, url: str) -> bool:
        return bool(url == self.schema)

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        config = context.config
        path = config.get_extra_config_value(SECRET_FILE_KEY, "") if config is not None else ""
        try:
            secret = load_secret(path)
        except ValueError as exc:
            raise IrrecoverableException(f"KV tier: {exc}") from exc
        if secret is None:
            raise IrrecoverableException(
                "the shared KV tier needs the deployment secret (PDSERVE_SECRET_FILE)"
            )
        url = os.environ.get(TIER_URL_ENV, "")
        if "://" not in url:
            raise IrrecoverableException(f"KV tier: {TIER_URL_ENV} names no tier location")
        allocator = BoundedAllocator(context.local_cpu_backend, 0, REJECTIONS)
        inner = inner_connector(url, context, allocator)
        allocator.limit = int(inner.full_chunk_size_bytes) + OVERHEAD
        timeout = float(getattr(config, "blocking_timeout_secs", 0) or 10)
        log.info("KV tier: chunks in %s are authenticated with the deployment secret",
                 url.split("://", 1)[0])  # fmt: skip
        return IntegrityConnector(
            inner, tier_key(secret), context.loop, context.local_cpu_backend, timeout
        )


def inner_connector(url: str, context: ConnectorContext, allocator: Any) -> RemoteConnector:
    """LMCache's own connector for ``url``, allocating through ``allocator``. Redis is built
    directly: LMCache's adapter logs the URL, which holds the tier's password."""
    if url.split("://", 1)[0] in ("redis", "rediss"):
        from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector

        return RedisConnector(url=url, loop=context.loop, local_cpu_backend=allocator)
    manager = ConnectorManager(url, context.loop, allocator, context.config, context.metadata)
    return manager.create_connector()
