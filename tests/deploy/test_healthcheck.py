"""The images' health check script (deploy/docker/healthcheck.py), run as Docker runs it:
a separate process, against a real gRPC health server or HTTP server on loopback."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.rpc.ca import write_set
from pdserve.rpc.tls import TLS_DIR_ENV, load
from tests.deploy.support import ROOT
from tests.helpers import dead_port

SCRIPT = ROOT / "deploy" / "docker" / "healthcheck.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pdserve_healthcheck", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    # Only this test's PDSERVE_* variables: the developer's own must not leak in.
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.fixture
def health_server() -> Iterator[tuple[int, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, servicer
    finally:
        server.stop(None)


@pytest.fixture
def http_server() -> Iterator[tuple[int, dict[str, int]]]:
    state = {"status": 200}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"healthy_decode_workers": int(state["status"] == 200)}).encode()
            self.send_response(state["status"] if self.path == "/health" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], state
    finally:
        server.shutdown()
        server.server_close()


def test_command_line_parsing() -> None:
    script = load_script()
    tini = ["/usr/bin/tini", "--", "pdserve", "prefill", "--port", "5"]
    assert script.pdserve_command(tini) == ("prefill", ["--port", "5"])
    venv = ["/opt/pdserve/venv/bin/python", "/opt/pdserve/venv/bin/pdserve", "gateway"]
    assert script.pdserve_command(venv) == ("gateway", [])
    assert script.pdserve_command(["decode", "--log-level", "DEBUG"])[0] == "decode"
    assert script.pdserve_command(["/usr/bin/tini", "--", "pdserve", "--help"]) == (None, [])
    assert script.client_host("0.0.0.0") == "127.0.0.1"
    assert script.client_host("::1") == "[::1]"


def test_worker_serving_not_serving_and_down(
    health_server: tuple[int, health.HealthServicer],
) -> None:
    port, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    rc, out = check("prefill", "--port", str(port))
    assert rc == 1 and "NOT_SERVING" in out, out
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    rc, out = check("prefill", "--port", str(port))
    assert rc == 0 and "SERVING" in out, out
    # The port from the environment, as in the containers.
    rc, out = check("decode", env={"PDSERVE_DECODE_PORT": str(port)})
    assert rc == 0, out
    server_down = check("decode", env={"PDSERVE_DECODE_PORT": str(dead_port())})
    assert server_down[0] == 1


def test_a_mutual_tls_worker_is_checked_with_the_containers_certificate(
    tmp_path: Path,
) -> None:
    dirs = write_set(tmp_path, ["prefill", "server"])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", load(dirs["server"]).server_credentials())
    server.start()
    try:
        env = {"PDSERVE_PREFILL_PORT": str(port), TLS_DIR_ENV: str(dirs["prefill"])}
        rc, out = check("prefill", env=env)
        assert rc == 0 and "mutual TLS" in out, out
        rc, out = check("prefill", env={"PDSERVE_PREFILL_PORT": str(port)})
        assert rc == 1 and "UNAVAILABLE" in out, out  # plain text is refused
    finally:
        server.stop(None)


def test_gateway_health(http_server: tuple[int, dict[str, int]]) -> None:
    port, state = http_server
    env = {"PDSERVE_GATEWAY_HTTP_HOST": "0.0.0.0", "PDSERVE_GATEWAY_HTTP_PORT": str(port)}
    rc, out = check("gateway", env=env)
    assert rc == 0 and "200" in out, out
    state["status"] = 503  # no healthy decode worker
    rc, out = check("gateway", env=env)
    assert rc == 1 and "503" in out, out


def test_other_commands_are_healthy() -> None:
    assert check("model", "prepare")[0] == 0
    assert check("--help")[0] == 0
