"""Readiness probes of ``pdserve up``'s children (and of benchmarks that start engines): a
gRPC health check over the deployment's mutual TLS, an HTTP GET that never goes through a proxy
from the environment."""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.supervisor import ReadyCheck
from pdserve.rpc import tls as rpc_tls

PROBE_RPC_TIMEOUT_S = 1.5


def grpc_serving(address: str, tls: rpc_tls.TlsIdentity | None = None) -> ReadyCheck:
    """Ready once grpc.health.v1 ``Check(service="")`` answers SERVING (over mutual TLS with
    ``tls``)."""

    async def check() -> bool:
        # The worker is on this machine: never go through an http_proxy from the environment.
        options = [("grpc.enable_http_proxy", 0)]
        async with rpc_tls.aio_channel(address, options, tls) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="")
            try:
                reply = await stub.Check(request, timeout=PROBE_RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    return check


_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_ok(url: str, expect: dict[str, int] | None = None) -> ReadyCheck:
    """Ready once ``GET url`` answers 200 (and its JSON body has at least ``expect``)."""

    def get() -> bool:
        try:
            with _NO_PROXY_OPENER.open(url, timeout=PROBE_RPC_TIMEOUT_S) as reply:
                if reply.status != 200:
                    return False
                body = json.loads(reply.read() or b"{}") if expect else {}
        except (OSError, http.client.HTTPException, ValueError):  # refused, reset, bad body
            return False
        return all(int(body.get(key, 0)) >= n for key, n in (expect or {}).items())

    async def check() -> bool:
        return await asyncio.to_thread(get)

    return check


def client_host(host: str) -> str:
    """The address a local client uses for a server listening on ``host``."""
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
