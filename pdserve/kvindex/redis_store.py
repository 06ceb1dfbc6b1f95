"""The prefix index and worker registry on Redis (``redis.asyncio``).

Multi-key updates run as Lua scripts, so a worker's step of events, a worker's clearing and
a lookup each see and leave a consistent index. Connection failures surface as
``IndexUnavailable``; the client reconnects by itself on the next call.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from pdserve.kvindex.interfaces import BlockOps, IndexUnavailable, WorkerRecord
from pdserve.kvindex.keys import Keys

# ARGV: ns, worker, then ops: "C" 0 | "S" n h1..hn | "R" n h1..hn
_APPLY = """
local ns, worker = ARGV[1], ARGV[2]
local wkey = ns .. ':w:' .. worker
local i = 3
while i <= #ARGV do
  local op, n = ARGV[i], tonumber(ARGV[i + 1])
  i = i + 2
  if op == 'C' then
    for _, h in ipairs(redis.call('SMEMBERS', wkey)) do
      redis.call('SREM', ns .. ':b:' .. h, worker)
    end
    redis.call('DEL', wkey)
  else
    for j = i, i + n - 1 do
      local bkey = ns .. ':b:' .. ARGV[j]
      if op == 'S' then
        redis.call('SADD', bkey, worker)
        redis.call('SADD', wkey, ARGV[j])
      else
        redis.call('SREM', bkey, worker)
        redis.call('SREM', wkey, ARGV[j])
      end
    end
    i = i + n
  end
end
return 1
"""

# ARGV: ns, n workers, w1..wn, hashes in prefix order -> leading-run length per worker
_LONGEST = """
local ns, n = ARGV[1], tonumber(ARGV[2])
local counts, open, left = {}, {}, n
for k = 1, n do counts[k] = 0; open[k] = true end
for i = 3 + n, #ARGV do
  if left == 0 then break end
  local bkey = ns .. ':b:' .. ARGV[i]
  for k = 1, n do
    if open[k] then
      if redis.call('SISMEMBER', bkey, ARGV[2 + k]) == 1 then
        counts[k] = counts[k] + 1
      else
        open[k] = false
        left = left - 1
      end
    end
  end
end
return counts
"""


# ARGV: ns, worker, dead epoch, workers hash key, alive key. Clears the worker's blocks and
# record only if the record still has that epoch and no heartbeat of it is alive, so a
# worker that restarted under the same name in the meantime keeps its new entries.
_REAP = """
local ns, worker, epoch, workers, alive = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local raw = redis.call('HGET', workers, worker)
if not raw or cjson.decode(raw)['epoch'] ~= epoch or redis.call('GET', alive) == epoch then
  return 0
end
local wkey = ns .. ':w:' .. worker
for _, h in ipairs(redis.call('SMEMBERS', wkey)) do
  redis.call('SREM', ns .. ':b:' .. h, worker)
end
redis.call('DEL', wkey)
redis.call('HDEL', workers, worker)
return 1
"""


def _encode(ops: Sequence[BlockOps]) -> list[str | int]:
    args: list[str | int] = []
    for op in ops:
        if op.cleared:
            args += ["C", 0]
        if op.stored:
            args += ["S", len(op.stored), *op.stored]
        if op.removed:
            args += ["R", len(op.removed), *op.removed]
    return args


MAX_CONNECTIONS = 64  # per process; more concurrent calls wait for a free one
# Hashes per script call of ``replace_worker``: one call runs atomically and blocks Redis
# meanwhile, so a large cache is written in parts.
REPLACE_CHUNK = 10_000


class RedisStore:
    """Both the ``PrefixIndex`` and the ``WorkerRegistry`` over one Redis connection pool."""

    def __init__(self, url: str, prefix: str = "pdserve", timeout_s: float = 2.0) -> None:
        self.keys = Keys(prefix)
        # A blocking pool: with more concurrent calls than connections a call waits (up to
        # timeout_s) for one, where the default pool fails it at once ("Too many
        # connections"), which at 256 concurrent requests turned prefix routing off.
        # One retry on a connection error: after a Redis restart every idle pooled connection
        # is closed by the server, and without it each failed its next call once (a prefix
        # lookup routed by load only, a worker's index write put off until the next check).
        # The retry reconnects; with Redis down it fails as fast as the first try (connection
        # refused), and a timeout is not retried (a hung Redis would double every wait).
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        self.client = aioredis.Redis.from_pool(pool)
        self._apply = self.client.register_script(_APPLY)
        self._longest = self.client.register_script(_LONGEST)
        self._reap = self.client.register_script(_REAP)

    async def close(self) -> None:
        await self.client.aclose()

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except (RedisError, OSError) as exc:
            raise IndexUnavailable(f"Redis is unavailable: {exc}") from exc

    # ---------------------------------------------------------------- PrefixIndex
    async def apply(self, model: str, worker: str, ops: Sequence[BlockOps]) -> None:
        args = _encode(ops)
        if args:
            head: list[str | int] = [self.keys.namespace(model), worker]
            await self._call(self._apply(args=head + args))

    async def clear_worker(self, model: str, worker: str) -> None:
        await self.apply(model, worker, [BlockOps(cleared=True)])

    async def replace_worker(self, model: str, worker: str, hashes: Sequence[int]) -> None:
        """The first part clears the worker's entries in the same script that stores the
        first hashes; the later parts only add (each part atomic)."""
        parts = [hashes[i : i + REPLACE_CHUNK] for i in range(0, len(hashes), REPLACE_CHUNK)]
        await self.apply(model, worker, [BlockOps(cleared=True, stored=parts[0] if parts else [])])
        for part in parts[1:]:
            await self.apply(model, worker, [BlockOps(stored=part)])

    async def worker_block_count(self, model: str, worker: str) -> int:
        return int(await self._call(self.client.scard(self.keys.worker_blocks(model, worker))))

    async def longest_prefixes(
        self, model: str, hashes: Sequence[int], workers: Sequence[str]
    ) -> dict[str, int]:
        if not workers or not hashes:
            return dict.fromkeys(workers, 0)
        args: list[str | int] = [self.keys.namespace(model), len(workers), *workers, *hashes]
        counts = await self._call(self._longest(args=args))
        return {w: int(c) for w, c in zip(workers, counts, strict=True)}

    # ------------------------------------------------------------- WorkerRegistry
    async def announce(self, record: WorkerRecord, ttl_s: float) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.keys.workers, record.worker_id, record.to_json())
        pipe.set(self.keys.alive(record.worker_id), record.epoch, px=int(ttl_s * 1000))
        await self._call(pipe.execute())

    async def withdraw(self, worker_id: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hdel(self.keys.workers, worker_id)
        pipe.delete(self.keys.alive(worker_id))
        await self._call(pipe.execute())

    async def _records(self) -> list[tuple[WorkerRecord, bool]]:
        """Every registered worker and whether its heartbeat (of that epoch) is current."""
        raw = await self._call(self.client.hgetall(self.keys.workers))
        records = [WorkerRecord.from_json(v) for v in raw.values()]
        if not records:
            return []
        epochs = await self._call(self.client.mget([self.keys.alive(r.worker_id) for r in records]))
        return [
            (r, epoch is not None and epoch.decode() == r.epoch)
            for r, epoch in zip(records, epochs, strict=True)
        ]

    async def alive_workers(self) -> list[WorkerRecord]:
        return [record for record, alive in await self._records() if alive]

    async def registry_epoch(self) -> str:
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.keys.registry, uuid.uuid4().hex, nx=True)
        pipe.get(self.keys.registry)
        _, epoch = await self._call(pipe.execute())
        return str(epoch.decode())

    async def reap_dead(self) -> list[str]:
        """Forget workers whose heartbeat expired: their blocks, then their record.

        Safe to run from every gateway at once; a worker that comes back re-announces
        itself and rebuilds its entries from its engine's events."""
        reaped = []
        for record, alive in await self._records():
            if alive:
                continue
            args = [self.keys.namespace(record.model), record.worker_id, record.epoch,
                    self.keys.workers, self.keys.alive(record.worker_id)]  # fmt: skip
            if await self._call(self._reap(args=args)):
                reaped.append(record.worker_id)
        return reaped
