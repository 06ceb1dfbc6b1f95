"""KV transfer throughput of the connector's transport against a raw loopback socket.

``pdserve bench`` (or ``python -m kv_transfer.bench``) starts a real producer and a real
consumer transfer process (the same code the connector runs inside vLLM workers) over shared
memory laid out like the default model's CPU KV cache (30 layers, layer-major, whole blocks),
and times a pull from the moment the job is handed to the consumer until it reports done
(handshake, bytes, acknowledgement; connections are reused between pulls as in service). In
the same run, alternating with the pulls, a plain process sends the same number of bytes from
one contiguous buffer of real (resident, non-zero) memory over one persistent loopback TCP
connection to a plain receiver; and a second pair of transfer processes pulls the same blocks
without the block tags' passes over the bytes (``bench_unchecked``), the baseline of the
integrity check's cost. The three take turns pull by pull, in a rotating order, so that all
see the same machine.
The ratio is raw seconds / connector seconds (1.0 = as fast as the raw socket); the MAC's cost
is 1 - unchecked seconds / connector seconds, the median over the rounds. Every pull is
checked byte for byte against the source blocks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from kv_transfer.agent_context import AgentConfig
from kv_transfer.handle import AgentHandle
from kv_transfer.layout import LayerSpan, Layout
from kv_transfer.wire import recv_into_exact, tune

LAYERS = 30
MODEL_BLOCK_BYTES = 98_304  # one layer of one block of SmolLM2-135M on the CPU
MB = 1_000_000
UNCHECKED = "kv_transfer.bench_unchecked"  # the baseline without the block tags


@dataclass
class Geometry:
    blocks: int
    block_bytes: int

    @property
    def payload(self) -> int:
        return LAYERS * self.blocks * self.block_bytes


def geometry(size_mb: float) -> Geometry:
    """Blocks of the default model's size where possible; smaller blocks for small payloads."""
    target = int(size_mb * MB)
    blocks = max(1, round(target / (LAYERS * MODEL_BLOCK_BYTES)))
    block_bytes = max(64, target // (LAYERS * blocks) // 64 * 64)
    return Geometry(blocks, block_bytes)


def make_region(geo: Geometry, total_blocks: int, seed: int) -> tuple[int, mmap.mmap, Layout]:
    size = LAYERS * total_blocks * geo.block_bytes
    fd = os.memfd_create(f"pdserve-bench-{seed}")
    os.ftruncate(fd, size)
    memory = mmap.mmap(fd, size)
    pattern = hashlib.sha256(str(seed).encode()).digest() * 4096
    for offset in range(0, size, len(pattern)):
        memory[offset : offset + len(pattern)] = pattern[: size - offset]
    spans = tuple(
        LayerSpan(0, layer * total_blocks * geo.block_bytes, geo.block_bytes, geo.block_bytes)
        for layer in range(LAYERS)
    )
    return fd, memory, Layout((size,), spans, total_blocks)


def start_agent(
    role: str, fd: int, layout: Layout, module: str = "kv_transfer.agent", **settings: Any
) -> AgentHandle:
    """A real transfer process over the region ``fd`` (settings as in ``AgentConfig``)."""
    settings.setdefault("compat", {"bench": "1"})
    config = AgentConfig(
        role=role, layout=layout, region_fds=(os.dup(fd),), bind_host="127.0.0.1", **settings
    )
    return AgentHandle.start(config, module)


def blocks_digest(memory: mmap.mmap, layout: Layout, blocks: list[int]) -> str:
    digest = hashlib.sha256()
    for view in layout.views([memoryview(memory)], blocks):
        digest.update(view)
    return digest.hexdigest()


def time_pull(producer: AgentHandle, consumer: AgentHandle, geo: Geometry, n: int) -> float:
    src = list(range(geo.blocks))  # consecutive on the producer, scattered on the consumer
    dst = [2 * i + 1 for i in range(geo.blocks)]
    req = f"bench-{n}"
    producer.channel.send({"op": "serve", "req": req, "blocks": src})
    # In service the blocks are registered one engine step after the prefill, well before
    # the gateway's decode call arrives; give the producer that head start here too.
    time.sleep(0.002)
    started = time.perf_counter()
    consumer.channel.send(
        {
            "op": "pull",
            "req": req,
            "host": "127.0.0.1",
            "port": producer.port,
            "remote_req": req,
            "remote_blocks": src,
            "local_blocks": dst,
        }
    )
    done = consumer.channel.recv()
    elapsed = time.perf_counter() - started
    if not done or not done.get("ok") or done.get("bytes") != geo.payload:
        raise RuntimeError(f"pull failed: {done}")
    finished = producer.channel.recv()
    if not finished or finished.get("reason") != "sent":
        raise RuntimeError(f"producer did not finish the job: {finished}")
    return elapsed


RAW_SENDER = """
import socket, sys
size = int(sys.argv[1]); payload = bytearray((bytes(range(256)) * (size // 256 + 1))[:size])
server = socket.create_server(("127.0.0.1", 0)); print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while conn.recv(1) == b"g":
    conn.sendall(payload)
"""


class RawSocket:
    """The baseline: a plain sender process streams the payload over one persistent loopback
    connection (as the connector reuses its connections) each time this process asks."""

    def __init__(self, size: int) -> None:
        self.sender = subprocess.Popen(
            [sys.executable, "-c", RAW_SENDER, str(size)], stdout=subprocess.PIPE, text=True
        )
        assert self.sender.stdout
        port = int(self.sender.stdout.readline())
        self.conn = socket.create_connection(("127.0.0.1", port))
        tune(self.conn)
        self.buffer = memoryview(bytearray(b"x" * size))

    def time_one(self) -> float:
        started = time.perf_counter()
        self.conn.sendall(b"g")
        recv_into_exact(self.conn, self.buffer)
        return time.perf_counter() - started

    def close(self) -> None:
        self.conn.close()
        self.sender.wait()


@dataclass
class Pair:
    """A producer and a consumer transfer process, each over its own region."""

    producer: AgentHandle
    consumer: AgentHandle
    p_fd: int
    c_fd: int
    p_mem: mmap.mmap
    c_mem: mmap.mmap
    p_layout: Layout
    c_layout: Layout

    @classmethod
    def start(cls, geo: Geometry, module: str) -> Pair:
        p_fd, p_mem, p_layout = make_region(geo, geo.blocks, seed=1)
        c_fd, c_mem, c_layout = make_region(geo, 2 * geo.blocks + 1, seed=2)
        producer = start_agent("producer", p_fd, p_layout, module)
        consumer = start_agent("consumer", c_fd, c_layout, module)
        return cls(producer, consumer, p_fd, c_fd, p_mem, c_mem, p_layout, c_layout)

    def check(self, geo: Geometry) -> None:
        dst = [2 * i + 1 for i in range(geo.blocks)]
        src_digest = blocks_digest(self.p_mem, self.p_layout, list(range(geo.blocks)))
        if src_digest != blocks_digest(self.c_mem, self.c_layout, dst):
            raise RuntimeError("pulled blocks differ from the source blocks")

    def stop(self) -> None:
        self.producer.stop()
        self.consumer.stop()
        for fd in (self.p_fd, self.c_fd):
            os.close(fd)


def bench_size(size_mb: float, repeat: int) -> dict[str, float]:
    """Connector pulls, unchecked pulls and raw transfers take turns, in a rotating order, so
    that all three see the same machine noise."""
    geo = geometry(size_mb)
    pairs: list[Pair] = []
    raw_socket = RawSocket(geo.payload)
    times: dict[str, list[float]] = {"ours": [], "unchecked": [], "raw": []}
    try:
        pairs = [Pair.start(geo, "kv_transfer.agent"), Pair.start(geo, UNCHECKED)]
        timers = {
            "ours": lambda n: time_pull(pairs[0].producer, pairs[0].consumer, geo, n),
            "unchecked": lambda n: time_pull(pairs[1].producer, pairs[1].consumer, geo, n),
            "raw": lambda n: raw_socket.time_one(),
        }
        names = list(timers)
        for n in range(repeat + 1):  # the first round warms all paths up and is not counted
            for name in names[n % 3 :] + names[: n % 3]:
                seconds = timers[name](n)
                if n:
                    times[name].append(seconds)
        for pair in pairs:
            pair.check(geo)
    finally:
        raw_socket.close()
        for pair in pairs:
            pair.stop()
    ours_s, raw_s = statistics.median(times["ours"]), statistics.median(times["raw"])
    unchecked = zip(times["unchecked"], times["ours"], strict=True)
    return {
        "mb": geo.payload / MB,
        "blocks": geo.blocks,
        "connector_gbps": geo.payload / ours_s / 1e9,
        "raw_gbps": geo.payload / raw_s / 1e9,
        "ratio": raw_s / ours_s,
        "unchecked_gbps": geo.payload / statistics.median(times["unchecked"]) / 1e9,
        "mac_cost": 1 - statistics.median(u / o for u, o in unchecked),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mb", default="1,4,16,64", help="payload sizes in MB")
    parser.add_argument("--repeat", type=int, default=7, help="pulls per size (median taken)")
    parser.add_argument("--json", default="", help="also write the results to this file")


def run(args: argparse.Namespace) -> int:
    sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    print(
        f"KV transfer: connector vs raw loopback socket, median of {args.repeat}, "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"{'MB':>7} {'blocks':>6} {'connector GB/s':>15} {'raw GB/s':>9} {'ratio':>6} "
        f"{'unchecked GB/s':>15} {'MAC cost':>9}"
    )
    results = []
    for size in sizes:
        row = bench_size(size, args.repeat)
        results.append(row)
        print(
            f"{row['mb']:7.1f} {row['blocks']:6d} {row['connector_gbps']:15.2f} "
            f"{row['raw_gbps']:9.2f} {row['ratio']:6.2f} {row['unchecked_gbps']:15.2f} "
            f"{row['mac_cost']:9.1%}",
            flush=True,
        )
    worst = min(r["ratio"] for r in results)
    print(f"lowest ratio: {worst:.2f} (target >= 0.80)")
    large = [r["mac_cost"] for r in results if r["mb"] >= 16]
    if large:
        print(f"highest MAC cost from 16 MB up: {max(large):.1%} (target < 10%)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
