"""gRPC server bootstrap shared by the gateway and the workers.

One place creates a ``grpc.aio`` server with grpc.health.v1 health and server reflection,
binds it, and stops it gracefully; services only register their servicers.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

# Large enough for token id lists of long prompts.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
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
    ) -> None:
        """With ``secret``, every call but health and reflection must carry a valid
        ``pdserve.rpc.auth`` token (internal services: the workers)."""
        from pdserve.rpc.auth import AuthInterceptor

        self.address = f"{host}:{port}"
        interceptors = [AuthInterceptor(secret)] if secret is not None else []
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
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
