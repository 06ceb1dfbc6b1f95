"""A worker restarted by ``pdserve up`` right after a crash binds the same ports again: its
gRPC port and its KV transfer port. A process killed with connections open leaves sockets on
its port (FIN_WAIT/TIME_WAIT, up to a minute); only a listener with SO_REUSEADDR may bind then.
Each test first proves such a socket is there (a plain bind fails), then rebinds."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_transfer import bench
from pdserve.rpc.server import GrpcServer
from tests.helpers import wait_until
from tests.integration.test_kv_transport import GEO, next_message

GRPC_CHILD = r"""
import asyncio
from pdserve.rpc.server import GrpcServer
async def main():
    server = GrpcServer("127.0.0.1", 0, [], [])
    print(await server.start(), flush=True)  # the port it bound
    await asyncio.sleep(600)
asyncio.run(main())
"""


def plain_bind_fails(port: int) -> bool:
    """Whether a socket without SO_REUSEADDR cannot bind ``port`` (a socket lingers there)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


async def health_check(port: int) -> None:
    options = [("grpc.enable_http_proxy", 0)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)


# An HTTP/2 client preface and an empty SETTINGS frame: once the server acknowledges those
# SETTINGS it has read every byte we sent (a process killed with unread bytes resets the
# connection instead of leaving a socket behind).
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    return data


def wait_settings_ack(sock: socket.socket) -> None:
    while True:
        header = recv_exact(sock, 9)  # length (3), type, flags, stream id (4)
        recv_exact(sock, int.from_bytes(header[:3], "big"))
        if header[3] == 0x4 and header[4] & 0x1:
            return


def test_grpc_server_rebinds_its_port_right_after_a_crash() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", GRPC_CHILD], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        client = socket.create_connection(("127.0.0.1", port), timeout=30)
        client.sendall(H2_PREFACE)
        wait_settings_ack(client)
    finally:
        child.send_signal(signal.SIGKILL)  # the crash: the kernel closes the server's side
        child.wait()
    with client:  # kept open: the server's side of it lingers on the port
        assert wait_until(lambda: plain_bind_fails(port)), "no lingering socket: proves nothing"

        async def rebind() -> None:
            server = GrpcServer("127.0.0.1", port, [], [])
            assert await server.start() == port
            await health_check(port)
            await server.stop(0)

        asyncio.run(rebind())


def test_kv_producer_rebinds_its_port_right_after_a_crash() -> None:
    p_fd, _, p_layout = bench.make_region(GEO, 8, seed=1)
    c_fd, _, c_layout = bench.make_region(GEO, 8, seed=2)
    consumer = bench.start_agent("consumer", c_fd, c_layout)
    producer = bench.start_agent("producer", p_fd, p_layout)  # on a port of its own choice
    port = producer.port
    try:
        # one pull: the consumer keeps its connection to the producer's port for the next
        producer.channel.send({"op": "serve", "req": "r1", "blocks": [1, 2]})
        consumer.channel.send(
            {"op": "pull", "req": "r1", "host": "127.0.0.1", "port": port, "remote_req": "r1",
             "remote_blocks": [1, 2], "local_blocks": [3, 4]}
        )  # fmt: skip
        assert next_message(consumer)["ok"]
        assert next_message(producer)["op"] == "finished"  # it has read the acknowledgement
        producer.process.kill()
        producer.process.wait()
        assert wait_until(lambda: plain_bind_fails(port)), "no lingering socket: proves nothing"
        again = bench.start_agent("producer", p_fd, p_layout, port=port)  # raises if it cannot
        assert again.port == port
        again.stop()
    finally:
        consumer.stop()
        producer.stop()
        os.close(p_fd)
        os.close(c_fd)
