"""The prefix index and worker registry on Redis or Redis Cluster (``redis.asyncio``).

Multi-key updates run as Lua scripts that name every key they touch in KEYS, all of one slot
(the layout in ``keys``): a holder's step of events, its rewrite and a reap each see and leave
a consistent set, and a lookup reads each group of holders in one script. Writes obey the
fence of ``epochs``. Connection failures surface as ``IndexUnavailable``; the client
reconnects (and, on a cluster, relearns the slots) by itself on a later call.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from pdserve.kvindex.interfaces import BlockOps, IndexUnavailable, WorkerRecord
from pdserve.kvindex.keys import Keys, group_of
from pdserve.kvindex.redis_client import UNAVAILABLE_ERRORS, is_cluster_url, make_client

# Worker records parsed between two turns of the event loop (a registry of hundreds).
PARSE_STEP = 32

# Redis's Lua compares strings with strcoll() in the server's locale; epochs are compared
# byte by byte, as Python does (``epochs.may_claim``).
_OLDER = """
local function older(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
"""

# SADD/SREM take at most this many members per call (Lua's unpack has a stack limit).
_BATCH = """
local function each(cmd, key, from, to)
  for j = from, to, 1000 do
    redis.call(cmd, key, unpack(ARGV, j, math.min(j + 999, to)))
  end
end
"""

# The first blocks of prompts (``keys``): KEYS[3] is the group's ZSET of "hash .. holder"
# members (a lookup reads the holders of its first block with one ZRANGEBYLEX), KEYS[4] the
# holder's SET of its first blocks (to take its members out again); ARGV[2] is the holder.
_STARTS = """
local HOLDER = ARGV[2]
local function add_starts(from, to)
  for j = from, to do
    if redis.call('SADD', KEYS[4], ARGV[j]) == 1 then
      redis.call('ZADD', KEYS[3], 0, ARGV[j] .. HOLDER)
    end
  end
end
local function drop_starts(from, to)
  for j = from, to, 1000 do
    local present = redis.call('SMISMEMBER', KEYS[4], unpack(ARGV, j, math.min(j + 999, to)))
    for i = 1, #present do
      if present[i] == 1 then
        redis.call('SREM', KEYS[4], ARGV[j + i - 1])
        redis.call('ZREM', KEYS[3], ARGV[j + i - 1] .. HOLDER)
      end
    end
  end
end
local function drop_all_starts()
  for _, h in ipairs(redis.call('SMEMBERS', KEYS[4])) do
    redis.call('ZREM', KEYS[3], h .. HOLDER)
  end
  redis.call('DEL', KEYS[4])
end
"""

# KEYS: holder set, fence, group's starts, holder's starts. ARGV: epoch, holder, then ops:
# "C" 0 | "S" n h1..hn | "T" n h1..hn (first blocks, stored too) | "R" n h1..hn. Applied only
# when the fence is the writer's epoch (none: ""); returns 1, or 0 if dropped.
_APPLY = (
    _BATCH
    + _STARTS
    + """
if (redis.call('GET', KEYS[2]) or '') ~= ARGV[1] then return 0 end
local i = 3
while i <= #ARGV do
  local op, n = ARGV[i], tonumber(ARGV[i + 1])
  i = i + 2
  if op == 'C' then
    redis.call('UNLINK', KEYS[1])
    drop_all_starts()
  elseif op == 'S' then
    each('SADD', KEYS[1], i, i + n - 1)
  elseif op == 'T' then
    add_starts(i, i + n - 1)
  else
    each('SREM', KEYS[1], i, i + n - 1)
    drop_starts(i, i + n - 1)
  end
  i = i + n
end
return 1
"""
)

# KEYS: as _APPLY's. ARGV: epoch, holder, n, n first blocks, hashes. Unless the fence is
# newer than the epoch: the epoch becomes the fence and the hashes the whole set, the first
# blocks its starts (none given and no epoch: the holder is forgotten, fence and all).
# Returns 1, or 0 if dropped.
_REPLACE = (
    _OLDER
    + _BATCH
    + _STARTS
    + """
if older(ARGV[1], redis.call('GET', KEYS[2]) or '') then return 0 end
redis.call('UNLINK', KEYS[1])
drop_all_starts()
if ARGV[1] == '' then redis.call('DEL', KEYS[2]) else redis.call('SET', KEYS[2], ARGV[1]) end
local n = tonumber(ARGV[3])
each('SADD', KEYS[1], 4 + n, #ARGV)
add_starts(4, 3 + n)
return 1
"""
)

# KEYS: holder set, fence. ARGV: epoch. Forgets the holder (set and fence) unless its fence
# is newer than the epoch. Returns 1, or 0 if dropped.
_CLEAR = (
    _OLDER
    + _STARTS
    + """
if older(ARGV[1], redis.call('GET', KEYS[2]) or '') then return 0 end
redis.call('UNLINK', KEYS[1])
redis.call('DEL', KEYS[2])
drop_all_starts()
return 1
"""
)

# KEYS: the starts of the candidates' groups (ARGV[2] of them), then the candidate holders'
# sets. ARGV[1]: the holders' ids, one per line, in the order of their sets; ARGV[3]: the
# hashes in prefix order, 8 bytes each, in one string (one argument instead of one per hash:
# packing the arguments was most of the client's time; last, so that a single server's
# command is its candidates' packed part plus the hashes). Only the holders whose starts hold
# the first hash are read (a ZRANGEBYLEX per group finds them; asking every holder's set took
# 0.8 ms of Redis at 256 holders), each for its leading run, stopping at its first miss. The
# runs of the holders that have one, as one string ("3:12,7:1": the 3rd holder's run is 12):
# one reply instead of an array, naming only the few holders found.
_LONGEST = r"""
local hashes = {}
for i = 1, #ARGV[3] / 8 do hashes[i] = string.sub(ARGV[3], 8 * i - 7, 8 * i) end
local groups = tonumber(ARGV[2])
local slot, k = {}, groups
for name in string.gmatch(ARGV[1], '[^\n]+') do
  k = k + 1
  slot[name] = k
end
local found = {}
local h0 = hashes[1]
for g = 1, groups do
  for _, m in ipairs(redis.call('ZRANGEBYLEX', KEYS[g], '[' .. h0, '(' .. h0 .. '\255')) do
    local j = slot[string.sub(m, 9)]
    if j then
      local n = 0
      for i = 1, #hashes do
        if redis.call('SISMEMBER', KEYS[j], hashes[i]) == 0 then break end
        n = n + 1
      end
      if n > 0 then found[#found + 1] = (j - groups) .. ':' .. n end
    end
  end
end
return table.concat(found, ',')
"""

# KEYS: as _APPLY's. ARGV: the dead epoch, holder. Forgets the holder's entries only if they
# are that life's (or nobody's): a newer life that already rewrote them keeps them.
_REAP_INDEX = (
    _STARTS
    + """
local fence = redis.call('GET', KEYS[2])
if fence and fence ~= ARGV[1] then return 0 end
redis.call('UNLINK', KEYS[1])
redis.call('DEL', KEYS[2])
drop_all_starts()
return 1
"""
)

# KEYS: workers hash, alive key. ARGV: worker, dead epoch. Removes the record only if it
# still has that epoch and no heartbeat of it is alive, so a worker that restarted under the
# same name in the meantime keeps its record.
_REAP_RECORD = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw or cjson.decode(raw)['epoch'] ~= ARGV[2] or redis.call('GET', KEYS[2]) == ARGV[2] then
  return 0
end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
"""


# The registry's updates are scripts too, not MULTI transactions: redis-py's asyncio cluster
# client runs a transaction's commands in a thread with an event loop of its own, blocking the
# caller's loop.
# KEYS: workers hash, alive key. ARGV: worker, record JSON, epoch, TTL in ms.
_ANNOUNCE = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
return 1
"""

# KEYS: workers hash, alive key. ARGV: worker.
_WITHDRAW = """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return 1
"""

# KEYS: the registry's epoch. ARGV: a new epoch, kept only if there is none.
_REGISTRY_EPOCH = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return redis.call('GET', KEYS[1])
"""


def _member(h: int) -> bytes:
    return h.to_bytes(8, "big")


def _bulk(arg: bytes) -> bytes:
    """One argument of a command as the Redis protocol (RESP) sends it."""
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def _runs(reply: bytes, holders: Sequence[str], into: dict[str, int]) -> None:
    """The lookup script's reply ("3:12,7:1": the holders' 1-based places, their runs)."""
    for pair in reply.split(b","):
        if pair:
            place, _, run = pair.partition(b":")
            into[holders[int(place) - 1]] = int(run)


class LookupGroup(NamedTuple):
    """The holders of one lookup script call and what names them on the wire, built once
    per candidate list (``RedisStore._lookup_groups``)."""

    holders: list[str]
    keys: list[bytes]  # the group's starts, then the holders' sets
    args: list[bytes]  # the holders' ids, one per line; the number of starts
    packed: bytes  # single server: the whole EVALSHA command but its last argument (the hashes)


def _encode(ops: Sequence[BlockOps]) -> list[str | int | bytes]:
    args: list[str | int | bytes] = []
    for op in ops:
        if op.cleared:
            args += ["C", 0]
        if op.stored:
            args += ["S", len(op.stored), *map(_member, op.stored)]
        if op.first_blocks:
            args += ["T", len(op.first_blocks), *map(_member, op.first_blocks)]
        if op.removed:
            args += ["R", len(op.removed), *map(_member, op.removed)]
    return args


# Hashes per script call of ``replace_worker``: one call runs atomically and blocks Redis
# meanwhile, so a large cache is written in parts.
REPLACE_CHUNK = 10_000
# Lookups' candidate lists remembered (each list changes only when the pool does).
LOOKUP_GROUPS_CACHED = 64


class RedisStore:
    """Both the ``PrefixIndex`` and the ``WorkerRegistry`` over one client (``client``: a
    ``redis.asyncio.Redis`` or ``RedisCluster``, see ``redis_client``)."""

    def __init__(self, url: str, prefix: str = "pdserve", timeout_s: float = 2.0) -> None:
        self.keys = Keys(prefix)
        self.client = make_client(url, timeout_s)
        # A cluster runs a lookup as one script per group of holders (its keys must share a
        # slot); one server as one script for all of them: with 256 holders that took half
        # the client's CPU time and about 1 ms less of the median (docs/deploy.md).
        self.cluster = is_cluster_url(url)
        self._apply = self.client.register_script(_APPLY)
        self._replace = self.client.register_script(_REPLACE)
        self._clear = self.client.register_script(_CLEAR)
        self._longest = self.client.register_script(_LONGEST)
        self._reap_index = self.client.register_script(_REAP_INDEX)
        self._reap_record = self.client.register_script(_REAP_RECORD)
        self._announce = self.client.register_script(_ANNOUNCE)
        self._withdraw = self.client.register_script(_WITHDRAW)
        self._registry_epoch = self.client.register_script(_REGISTRY_EPOCH)
        self._groups: dict[tuple[str, tuple[str, ...]], list[LookupGroup]] = {}

    async def close(self) -> None:
        await self.client.aclose()

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except UNAVAILABLE_ERRORS as exc:
            raise IndexUnavailable(f"Redis is unavailable: {exc}") from exc

    def _holder(self, model: str, holder: str) -> list[str]:
        return [
            self.keys.holder_blocks(model, holder),
            self.keys.fence(model, holder),
            self.keys.group_starts(model, group_of(holder)),
            self.keys.holder_starts(model, holder),
        ]

    # ---------------------------------------------------------------- PrefixIndex
    async def apply(
        self, model: str, worker: str, ops: Sequence[BlockOps], epoch: str = ""
    ) -> bool:
        args = _encode(ops)
        if not args:
            return True
        keys = self._holder(model, worker)
        return bool(await self._call(self._apply(keys=keys, args=[epoch, worker, *args])))

    async def clear_worker(self, model: str, worker: str, epoch: str = "") -> bool:
        keys = self._holder(model, worker)
        return bool(await self._call(self._clear(keys=keys, args=[epoch, worker])))

    async def replace_worker(
        self,
        model: str,
        worker: str,
        hashes: Sequence[int],
        epoch: str = "",
        first_blocks: Sequence[int] = (),
    ) -> bool:
        """The first part claims the fence and replaces the set and its starts; the later
        parts add to the set, each dropped if a newer life claimed the holder in between (each
        part atomic)."""
        keys = self._holder(model, worker)
        starts = [_member(h) for h in first_blocks]
        first = [_member(h) for h in hashes[:REPLACE_CHUNK]]
        args = [epoch, worker, len(starts), *starts, *first]
        if not await self._call(self._replace(keys=keys, args=args)):
            return False
        for i in range(REPLACE_CHUNK, len(hashes), REPLACE_CHUNK):
            part = BlockOps(stored=hashes[i : i + REPLACE_CHUNK], starts_prompt=False)
            if not await self.apply(model, worker, [part], epoch):
                return False
        return True

    async def worker_block_count(self, model: str, worker: str) -> int:
        return int(await self._call(self.client.scard(self.keys.holder_blocks(model, worker))))

    async def longest_prefixes(
        self, model: str, hashes: Sequence[int], workers: Sequence[str]
    ) -> dict[str, int]:
        counts = dict.fromkeys(workers, 0)
        if not workers or not hashes:
            return counts
        groups = self._lookup_groups(model, tuple(workers))
        packed = b"".join(map(_member, hashes))
        if self.cluster:
            calls = [(g.keys, [*g.args, packed]) for g in groups]
            replies = await self._call(self._pipelined(self._longest, calls))
        else:  # one group: its command packed once, the hashes appended
            (group,) = groups
            replies = [await self._call(self._evalsha_packed(group.packed + _bulk(packed)))]
        for group, reply in zip(groups, replies, strict=True):
            _runs(reply, group.holders, counts)
        return counts

    def _lookup_groups(self, model: str, workers: tuple[str, ...]) -> list[LookupGroup]:
        """The holders of a lookup by script call, with the script's keys (the group's starts,
        the holders' sets) and the holders' ids encoded, and on a single server the command
        packed but for the hashes: the same workers are asked for request after request, and
        naming 256 sets anew each time was half of the client's time, packing the command
        another third of it (pdserve bench fleet)."""
        cached = self._groups.get((model, workers))
        if cached is not None:
            return cached
        by_group: dict[int, list[str]] = {}
        for worker in dict.fromkeys(workers):
            by_group.setdefault(group_of(worker) if self.cluster else 0, []).append(worker)
        groups = []
        for ws in by_group.values():
            starts = [self.keys.group_starts(model, g) for g in sorted(set(map(group_of, ws)))]
            sets = [self.keys.holder_blocks(model, w) for w in ws]
            keys = [k.encode() for k in [*starts, *sets]]
            args = ["\n".join(ws).encode(), b"%d" % len(starts)]
            head = [b"EVALSHA", self._longest.sha.encode(), b"%d" % len(keys), *keys, *args]
            packed = b"*%d\r\n" % (len(head) + 1) + b"".join(map(_bulk, head))
            groups.append(LookupGroup(ws, keys, args, packed))
        if len(self._groups) >= LOOKUP_GROUPS_CACHED:
            self._groups.clear()  # the pool changed many times: start over
        self._groups[(model, workers)] = groups
        return groups

    async def _evalsha_packed(self, command: bytes) -> Any:
        """A packed EVALSHA of the lookup script on one pooled connection of a single server,
        as the client's own call but without packing its arguments again: once more on a
        dropped connection (stale after a Redis restart), and with the script loaded again
        if the server lost it (restarted)."""
        pool = self.client.connection_pool
        for attempt in range(3):
            conn = await pool.get_connection()
            try:
                await conn.send_packed_command(command, check_health=False)
                return await conn.read_response()
            except RedisConnectionError:
                if attempt:
                    raise
            except NoScriptError:
                if attempt > 1:
                    raise
                await conn.send_packed_command(
                    b"*3\r\n" + b"".join(map(_bulk, [b"SCRIPT", b"LOAD", _LONGEST.encode()]))
                )
                await conn.read_response()
            finally:
                await pool.release(conn)
        raise AssertionError("unreachable")

    async def _pipelined(
        self, script: Any, calls: Sequence[tuple[Sequence[str | bytes], list[bytes]]]
    ) -> Any:
        """Run ``script`` once per (keys, args) in one pipeline (on a cluster: one per node,
        in parallel); a server that lost its scripts (restarted, failed over) gets it again."""
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for keys, args in calls:
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            try:
                return await pipe.execute()
            except NoScriptError:
                if attempt:
                    raise
                await self.client.script_load(script.script)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------- WorkerRegistry
    async def announce(self, record: WorkerRecord, ttl_s: float) -> None:
        keys = [self.keys.workers, self.keys.alive(record.worker_id)]
        args = [record.worker_id, record.to_json(), record.epoch, int(ttl_s * 1000)]
        await self._call(self._announce(keys=keys, args=args))

    async def withdraw(self, worker_id: str) -> None:
        keys = [self.keys.workers, self.keys.alive(worker_id)]
        await self._call(self._withdraw(keys=keys, args=[worker_id]))

    async def recorded_epoch(self, worker_id: str) -> str:
        """The epoch of ``worker_id``'s registered record ("" if none): a new life of the same
        name makes a later one (``epochs.new_epoch``)."""
        raw = await self._call(self.client.hget(self.keys.workers, worker_id))
        return "" if raw is None else WorkerRecord.from_json(raw).epoch

    async def _records(self) -> list[tuple[WorkerRecord, bool]]:
        """Every registered worker and whether its heartbeat (of that epoch) is current."""
        raw = await self._call(self.client.hgetall(self.keys.workers))
        records = []
        for i, value in enumerate(raw.values()):
            records.append(WorkerRecord.from_json(value))
            if i % PARSE_STEP == PARSE_STEP - 1:
                await asyncio.sleep(0)  # hundreds of records: let requests run in between
        if not records:
            return []
        epochs = await self._call(self.client.mget([self.keys.alive(r.worker_id) for r in records]))
        return [
            (r, epoch is not None and epoch.decode() == r.epoch)
            for r, epoch in zip(records, epochs, strict=True)
        ]

    async def alive_workers(self) -> list[WorkerRecord]:
        return [record for record, alive in await self._records() if alive]

    async def registry_view(self) -> list[tuple[WorkerRecord, bool]]:
        """Every registered worker and whether it is alive: one read for both
        ``alive_workers`` and ``reap_dead``."""
        return await self._records()

    async def registry_epoch(self) -> str:
        keys = [self.keys.registry]
        epoch = await self._call(self._registry_epoch(keys=keys, args=[uuid.uuid4().hex]))
        return str(epoch.decode())

    async def reap_dead(self, view: list[tuple[WorkerRecord, bool]] | None = None) -> list[str]:
        """Forget workers whose heartbeat expired: their index entries (if still of the dead
        life), then their record (if still of it and not alive again).

        Safe to run from every gateway at once; a worker that comes back re-announces
        itself and rewrites its entries (``pdserve.worker.kv_events``). ``view``: a
        ``registry_view`` just read (else it is read here)."""
        reaped = []
        for record, alive in view if view is not None else await self._records():
            if alive:
                continue
            keys = self._holder(record.model, record.worker_id)
            await self._call(self._reap_index(keys=keys, args=[record.epoch, record.worker_id]))
            keys = [self.keys.workers, self.keys.alive(record.worker_id)]
            if await self._call(
                self._reap_record(keys=keys, args=[record.worker_id, record.epoch])
            ):
                reaped.append(record.worker_id)
        return reaped
