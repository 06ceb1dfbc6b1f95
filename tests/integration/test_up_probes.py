"""The readiness checks of pdserve up against real servers on loopback ports."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.cluster.up import grpc_serving, http_ok
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
