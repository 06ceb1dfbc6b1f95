"""The fake fleet of ``pdserve bench fleet``: N fake workers in one process.

``python -m pdserve.bench.fleet_workers --workers N --redis-url URL --model NAME`` serves N/2
fake prefill and N/2 fake decode workers (``pdserve.bench.fake_worker``: real grpc.aio servers,
no engine, a few tokens per answer), each registered in the Redis registry with the real
registry calls and a heartbeat every ``HEARTBEAT_S`` as a real worker's
(``pdserve.worker.registration``). Each has a prefix cache of its own (``Cache``): a worker
that serves a prompt holds the prompt's full-block hashes, computed as the gateway computes
them, and writes them into the prefix index as a real worker's KV events do, evicting its
least recently used blocks beyond ``--cache-blocks``; a prefill worker reports what its cache
served as the request's cached tokens.

It talks to its parent over stdin/stdout, one JSON line per answer: after registering it
prints ``{"registered": N}``; the line ``preload`` makes it store ``--blocks`` random block
hashes spread over the workers (``{"preloaded": pairs}``); ``stats`` prints the requests each
worker served (``{"served": {worker: n}}``); end of input stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict

from pdserve.bench.fake_worker import FakeDecode, FakePrefill, pieces, start_worker
from pdserve.kvindex.epochs import new_epoch
from pdserve.kvindex.hashing import block_hashes
from pdserve.kvindex.interfaces import BlockOps, WorkerRecord
from pdserve.kvindex.redis_store import RedisStore
from pdserve.rpc.server import GrpcServer
from pdserve.worker.registration import HEARTBEAT_S, TTL_HEARTBEATS, Load
from protos.v1 import worker_pb2

BLOCK_SIZE = 16  # the fakes' (fake_worker.capabilities)
HASH_SEED = 42  # the fakes' and the gateway's default


async def write_index(
    store: RedisStore,
    model: str,
    worker: str,
    epoch: str,
    stored: Sequence[int] = (),
    removed: Sequence[int] = (),
    whole: bool = False,
    starts_prompt: bool = False,
) -> bool:
    """The one place the fake workers write the prefix index, as a real worker's KV event
    sink does (``pdserve.worker.kv_events``): ``whole``: ``stored`` is the worker's whole set
    (its start: the rewrite that claims the index's fence for ``epoch``; random blocks, no
    prompt's first block among them), else one step of events under that fence, whose first
    stored block begins a prompt when ``starts_prompt`` (vLLM: no parent). False: the fence
    dropped the write."""
    if whole:
        return bool(await store.replace_worker(model, worker, stored, epoch))
    op = BlockOps(stored=stored, removed=removed, starts_prompt=starts_prompt)
    return bool(await store.apply(model, worker, [op], epoch))


class Cache:
    """A worker's prefix cache: block hashes, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def held(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` it holds."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def store(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Hold ``hashes`` (most recently used now); (newly stored, evicted)."""
        stored = []
        for h in hashes:
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
                stored.append(h)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        new, gone = set(stored), set(evicted)
        return [h for h in stored if h not in gone], [h for h in evicted if h not in new]


class Member:
    """One fake worker's identity, cache and link to Redis."""

    def __init__(self, name: str, role: str, model: str, store: RedisStore, cache: int) -> None:
        self.name, self.role, self.model, self.store = name, role, model, store
        self.cache = Cache(cache)
        self.epoch = new_epoch()
        self.load = Load()
        self.served = 0
        self.dropped = 0  # index writes the fence dropped (none expected)
        self.lock = asyncio.Lock()  # one worker's index writes stay in order
        self.record: WorkerRecord | None = None

    async def serve(self, token_ids: Sequence[int]) -> int:
        """Take one prompt into the cache; the leading blocks it already held."""
        self.served += 1
        hashes = block_hashes(token_ids, BLOCK_SIZE, HASH_SEED)
        held = self.cache.held(hashes)
        stored, removed = self.cache.store(hashes)
        if stored or removed:
            async with self.lock:
                first = bool(stored) and stored[0] == hashes[0]
                ok = await write_index(
                    self.store, self.model, self.name, self.epoch, stored, removed,
                    starts_prompt=first,
                )  # fmt: skip
                self.dropped += not ok
        return held

    async def heartbeat(self) -> None:
        """A real worker's heartbeat: announce every ``HEARTBEAT_S`` with a TTL of
        ``TTL_HEARTBEATS`` of them, the load in the record."""
        assert self.record is not None
        await asyncio.sleep(random.uniform(0, HEARTBEAT_S))  # workers start at different times
        while True:
            self.record.load = {k: float(v) for k, v in asdict(self.load).items()}
            await self.store.announce(self.record, HEARTBEAT_S * TTL_HEARTBEATS)
            await asyncio.sleep(HEARTBEAT_S)


class FleetPrefill(FakePrefill):
    def __init__(self, member: Member, **kw: object) -> None:
        super().__init__(record=False, worker_id=member.name, **kw)  # type: ignore[arg-type]
        self.member = member

    async def cached_for(self, request: worker_pb2.PrefillRequest) -> int:
        self.member.load.in_flight += 1
        try:
            held = await self.member.serve(request.prompt_token_ids)
        finally:
            self.member.load.in_flight -= 1
        n = len(request.prompt_token_ids)
        return min(held * BLOCK_SIZE, (n - 1) // BLOCK_SIZE * BLOCK_SIZE)


class FleetDecode(FakeDecode):
    """Holds the prompt's blocks after a request, as a decode worker's cache does."""

    def __init__(self, member: Member, tokens: int) -> None:
        super().__init__(record=False, worker_id=member.name, tokens=pieces(tokens))
        self.member = member

    async def Decode(self, request, context):  # type: ignore[no-untyped-def]
        self.member.load.in_flight += 1
        try:
            await self.member.serve(request.prompt_token_ids)
            async for chunk in super().Decode(request, context):
                yield chunk
        finally:
            self.member.load.in_flight -= 1


async def start_fleet(
    args: argparse.Namespace, store: RedisStore
) -> tuple[list[Member], list[GrpcServer]]:
    """Serve and register the workers: prefill ``fleet-p000``.., decode ``fleet-d000``.."""
    members, servers = [], []
    cache = args.cache_blocks or -(-args.blocks // args.workers) or 1
    for i in range(args.workers):
        role = "prefill" if i % 2 == 0 else "decode"
        name = f"fleet-{role[0]}{i // 2:03d}"
        member = Member(name, role, args.model, store, cache)
        servicer = FleetPrefill(member) if role == "prefill" else FleetDecode(member, args.tokens)
        server = await start_worker(servicer)
        member.record = WorkerRecord(
            worker_id=name, role=role, address=f"127.0.0.1:{server.port}", epoch=member.epoch,
            model=args.model, block_size=BLOCK_SIZE, max_model_len=servicer.caps.max_model_len,
            kv_compat=dict(servicer.caps.kv_compat),
        )  # fmt: skip
        await store.announce(member.record, HEARTBEAT_S * TTL_HEARTBEATS)
        # A real worker's sink claims its entries at start: its (empty) whole set.
        member.dropped += not await write_index(store, args.model, name, member.epoch, whole=True)
        members.append(member)
        servers.append(server)
    return members, servers


async def preload(members: list[Member], blocks: int, seed: int) -> int:
    """``blocks`` random hashes spread evenly over the workers, in the caches and the index."""
    rng = random.Random(seed)
    total = 0
    for i, member in enumerate(members):
        share = blocks // len(members) + (1 if i < blocks % len(members) else 0)
        hashes = [rng.getrandbits(64) for _ in range(share)]
        member.cache.store(hashes)
        held = list(member.cache.blocks)
        ok = await write_index(
            member.store, member.model, member.name, member.epoch, held, whole=True
        )
        member.dropped += not ok
        total += len(held)
    return total


def _say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


async def _serve(args: argparse.Namespace) -> None:
    store = RedisStore(args.redis_url)
    members, servers = await start_fleet(args, store)
    beats = [asyncio.create_task(m.heartbeat()) for m in members]
    _say({"registered": len(members)})
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command = line.strip()
            if command == "preload":
                _say({"preloaded": await preload(members, args.blocks, args.seed)})
            elif command == "stats":
                _say({"served": {m.name: m.served for m in members},
                      "dropped": sum(m.dropped for m in members)})  # fmt: skip
    finally:
        for task in beats:
            task.cancel()
        await asyncio.gather(*beats, return_exceptions=True)
        await asyncio.gather(*(s.stop(0) for s in servers))
        await store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.fleet_workers")
    parser.add_argument("--workers", type=int, required=True, help="half prefill, half decode")
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--blocks", type=int, default=0, help="preloaded blocks in all")
    parser.add_argument("--cache-blocks", type=int, default=0,
                        help="blocks per worker's cache (0: its share of --blocks)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=4, help="tokens per answer")
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(_serve(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
