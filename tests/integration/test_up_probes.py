"""The readiness checks of pdserve up against real servers on loopback ports."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.cluster.ready import grpc_serving, http_ok
from pdserve.rpc import tls as rpc_tls
from pdserve.rpc.ca import write_set
from pdserve.rpc.server import GrpcServer
from tests.helpers import dead_address


async def test_grpc_serving_follows_the_health_status() -> None:
    assert await grpc_serving(dead_address())() is False, "nothing listens"

    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    check = grpc_serving(f"127.0.0.1:{port}")
    try:
        await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await check() is False
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert await check() is True
    finally:
        await server.stop(None)


async def test_grpc_serving_dials_a_mutual_tls_worker_with_its_identity(tmp_path: Path) -> None:
    dirs = write_set(tmp_path, ["prefill-0", "up"])
    server = GrpcServer("127.0.0.1", 0, [], [], tls=rpc_tls.load(dirs["prefill-0"]))
    port = await server.start()
    try:
        assert await grpc_serving(f"127.0.0.1:{port}", rpc_tls.load(dirs["up"]))() is True
        assert await grpc_serving(f"127.0.0.1:{port}")() is False, "plain text is refused"
    finally:
        await server.stop(0)


class _Status(http.server.BaseHTTPRequestHandler):
    status = 503

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Status)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


async def test_http_ok_needs_200(http_server: http.server.HTTPServer) -> None:
    port = http_server.server_address[1]
    check = http_ok(f"http://127.0.0.1:{port}/health")
    _Status.status = 503
    assert await check() is False
    _Status.status = 200
    assert await check() is True
    assert await http_ok(f"http://{dead_address()}/health")() is False, "refused"
