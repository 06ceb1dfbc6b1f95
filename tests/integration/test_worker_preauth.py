"""A worker's gRPC server refuses unauthenticated calls before it reads their bodies.

The server runs in its own process (``pdserve.rpc.server.GrpcServer`` with the deployment
secret from ``PDSERVE_SECRET_FILE`` and the fake prefill servicer, as the real workers run it
with the engine's) so that its resident memory can be sampled while large unauthenticated
calls hit it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import psutil
import pytest

from kv_transfer.auth import load_secret
from pdserve.rpc.auth import call_metadata
from pdserve.rpc.secret import SECRET_FILE_ENV, write_new
from protos.v1 import common_pb2, worker_pb2

PREFILL = "/pdserve.v1.PrefillWorker/Prefill"
MIB = 1024 * 1024
CALLS = 16
BODY_MIB = 24
MAX_GROWTH = 64 * MIB

SERVER = """
import asyncio
from pdserve.bench.fake_worker import FakePrefill
from pdserve.rpc.secret import deployment_secret
from pdserve.rpc.server import GrpcServer, stop_event_on_signals
from pdserve.worker.server import PREFILL_SERVICE
from protos.v1 import worker_pb2_grpc

async def main():
    stop = stop_event_on_signals()
    prefill = FakePrefill(record=False)
    add = worker_pb2_grpc.add_PrefillWorkerServicer_to_server
    server = GrpcServer("127.0.0.1", 0, [lambda s: add(prefill, s)], [PREFILL_SERVICE],
                        deployment_secret())
    await server.start()
    print(server.port, flush=True)
    await stop.wait()
    await server.stop(0)

asyncio.run(main())
"""


@pytest.fixture
async def worker(tmp_path: Path) -> AsyncIterator[tuple[int, psutil.Process, bytes]]:
    """(port, process, secret) of a prefill worker server in a subprocess."""
    path = write_new(tmp_path / "secret")
    env = {**os.environ, SECRET_FILE_ENV: str(path)}
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), 60)
        assert line.strip().isdigit(), f"the worker did not start (exit {process.poll()})"
        secret = load_secret(path)
        assert secret is not None
        yield int(line), psutil.Process(process.pid), secret
    finally:
        process.terminate()
        process.wait(10)


def prefill_body(kib: int) -> bytes:
    """A serialized PrefillRequest of about ``kib`` KiB: 4-byte varint token ids."""
    n = kib * 1024 // 4
    request = worker_pb2.PrefillRequest(
        request_id="big", prompt_token_ids=[1 << 22] * n, params=common_pb2.SamplingParams()
    )
    return request.SerializeToString()


class PeakRss:
    """Samples a process's RSS every 20 ms on a thread; ``peak`` is the largest seen."""

    def __init__(self, process: psutil.Process) -> None:
        self.process = process
        self.before = process.memory_info().rss
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.before


def raw_prefill(channel: grpc.aio.Channel) -> Callable[..., grpc.aio.UnaryUnaryCall]:
    """Prefill taking an already serialized request (16 calls share one 24 MiB body)."""
    return channel.unary_unary(
        PREFILL,
        request_serializer=None,
        response_deserializer=worker_pb2.PrefillResponse.FromString,
    )


CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * MIB),
    ("grpc.max_receive_message_length", 64 * MIB),
]


async def refused_growth(
    port: int, process: psutil.Process, calls: int, body: bytes, rounds: int
) -> int:
    """Bytes the worker's RSS grew by at its peak (against a warm baseline) while ``rounds``
    times ``calls`` concurrent unauthenticated Prefill calls of ``body`` were refused."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
        call = raw_prefill(ch)

        async def wave(request: bytes) -> None:
            results = await asyncio.gather(
                *(call(request, timeout=120) for _ in range(calls)), return_exceptions=True
            )
            codes = [r.code() if isinstance(r, grpc.aio.AioRpcError) else r for r in results]
            assert codes == [grpc.StatusCode.UNAUTHENTICATED] * calls

        # Warm up with as many streams and empty bodies: what a stream costs whatever its
        # body (grpc's call arenas, the log records) is in the baseline.
        await wave(b"")
        await asyncio.sleep(0.5)
        with PeakRss(process) as rss:
            for _ in range(rounds):
                await wave(body)
    print(f"{rounds} x {calls} calls of {len(body) / MIB:.2f} MiB: RSS before "
          f"{rss.before / MIB:.1f} MiB, peak growth {rss.growth / MIB:.1f} MiB")  # fmt: skip
    return rss.growth


async def test_unauthenticated_large_calls_are_refused_unread(
    worker: tuple[int, psutil.Process, bytes],
) -> None:
    """16 concurrent 24 MiB calls, three times: when the refusal handler took a unary request
    grpc received and parsed each whole body first (the worker grew by 2.4-2.7 GB here)."""
    port, process, _ = worker
    growth = await refused_growth(port, process, CALLS, prefill_body(BODY_MIB * 1024), rounds=3)
    assert growth <= MAX_GROWTH, f"the worker grew by {growth / MIB:.1f} MiB"


async def test_refused_calls_do_not_widen_the_flow_control_windows(
    worker: tuple[int, psutil.Process, bytes],
) -> None:
    """512 concurrent 256 KiB calls, three times: with grpc's BDP probing on, the streams'
    windows grew with the refused traffic and so did the worker (82-135 MiB here, 8-25 MiB
    with it off)."""
    port, process, _ = worker
    growth = await refused_growth(port, process, 512, prefill_body(256), rounds=3)
    assert growth <= MAX_GROWTH, f"the worker grew by {growth / MIB:.1f} MiB"


async def test_authenticated_large_calls_are_served(
    worker: tuple[int, psutil.Process, bytes],
) -> None:
    port, _, secret = worker
    body = prefill_body(8 * 1024)
    metadata = call_metadata(secret, "Prefill", body)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
        reply = await raw_prefill(ch)(body, timeout=60, metadata=metadata)
    assert reply.request_id == "big"
    assert reply.prompt_tokens == 8 * MIB // 4
