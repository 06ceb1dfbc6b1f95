"""gRPC server bootstrap shared by the gateway and the workers.

One place creates a ``grpc.aio`` server with grpc.health.v1 health and server reflection,
binds it, and stops it gracefully; services only register their servicers. A server given the
deployment secret (a worker) also refuses unauthenticated calls unread (``pdserve.rpc.auth``),
bounds the streams one connection may have open at once and keeps each stream's receive window
at 64 KiB (``WORKER_OPTIONS``). A server given a TLS identity (``pdserve.rpc.tls``) listens
with mutual TLS only.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.rpc.tls import TlsIdentity

log = logging.getLogger(__name__)

# Large enough for token id lists of long prompts.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
# Streams one connection may have open at once on a worker (HTTP/2 SETTINGS_MAX_CONCURRENT_
# STREAMS). Past it grpc's client makes a new call wait for a stream to end, or the server
# refuses it (REFUSED_STREAM: UNAVAILABLE, never processed) when the client's count races the
# server's, and a gateway takes UNAVAILABLE for a failing worker. A gateway has one connection
# per worker, and a Decode stream lasts the whole generation, so the bound sits well above
# what one gateway sends one worker: twice vLLM's largest default batch (max_num_seqs 1024 on
# H100/H200); the gateway's admission control answers 429 once every worker has
# max_queue_per_worker (64 by default) requests.
WORKER_MAX_STREAMS = 2048
# What worker servers add to SERVER_OPTIONS. Without BDP probing the receive window of a stream
# nobody reads stays at grpc's initial 64 KiB, so a refused call (``pdserve.rpc.auth``) brings
# at most that much of its body into the process before its reset. With it, the windows grow
# with the traffic, refused bodies included: three waves of 512 concurrent unauthenticated
# 256 KiB calls grew a worker by 82-135 MiB with it, 8-25 MiB without
# (tests/integration/test_worker_preauth.py). Authenticated 8 MiB calls took as long either way
# on loopback; over a real network a large body may take more round trips than with windows
# grown by BDP probing.
WORKER_OPTIONS = [
    ("grpc.max_concurrent_streams", WORKER_MAX_STREAMS),
    ("grpc.http2.bdp_probe", 0),
]


class GrpcServer:
    """A grpc.aio server with health and reflection.

    ``register`` callbacks add servicers; ``service_names`` are the full names advertised by
    reflection and marked SERVING once ``start`` has bound the port.
    """

    def __init__(
        self,
        host: str,
        port: int,
        register: Iterable[Callable[[grpc.aio.Server], None]],
        service_names: Iterable[str],
        secret: bytes | None = None,
        worker_id: str = "",
        tls: TlsIdentity | None = None,
    ) -> None:
        """With ``secret``, every call but health and reflection must carry a valid
        ``pdserve.rpc.auth`` token (internal services: the workers), refused unread without
        one, and the server runs with ``WORKER_OPTIONS``. ``worker_id`` (with ``secret``): this
        worker's own name, announced to clients; tokens bound to another worker are refused.
        ``tls``: listen with mutual TLS only (``TlsIdentity.server_credentials``; ValueError
        when its certificate does not name ``pdserve.rpc.tls.SERVER_NAME``)."""
        from pdserve.rpc.auth import AuthInterceptor

        self.address = f"{host}:{port}"
        self.credentials = tls.server_credentials() if tls is not None else None
        options = list(SERVER_OPTIONS)
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if secret is not None:
            options += WORKER_OPTIONS
            interceptors.append(AuthInterceptor(secret, worker_id))
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        for add in register:
            add(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = 0

    async def start(self, serving: bool = True) -> int:
        """Bind and start; health reports ``serving`` from the first request on."""
        await self.set_serving(serving)
        try:
            # grpcio raises RuntimeError("Failed to bind ...") where older ones returned 0.
            if self.credentials is not None:
                self.port = self.server.add_secure_port(self.address, self.credentials)
            else:
                self.port = self.server.add_insecure_port(self.address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot bind gRPC server to {self.address}: is the port in use?")
        await self.server.start()
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)


def stop_event_on_signals() -> asyncio.Event:
    """An event set on SIGINT/SIGTERM, for services that shut down gracefully."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    return event
