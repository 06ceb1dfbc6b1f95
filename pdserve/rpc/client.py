"""Client-side gRPC plumbing shared by the typed worker clients.

One place creates a ``grpc.aio`` channel with the same message-size limits as the servers
(``pdserve.rpc.server``), builds the per-call metadata (the request id travels as
``x-request-id``, the current span's W3C trace context as ``traceparent``; with a deployment
secret each call carries its ``pdserve.rpc.auth`` token, so worker clients made anywhere in
the process authenticate; once a worker's GetCapabilities reply has announced its id, the
tokens are bound to it, and other workers refuse them; with a TLS identity, by default the
process's ``PDSERVE_TLS_DIR``, the channel is mutual TLS: ``pdserve.rpc.tls``), turns
``grpc.aio.AioRpcError`` into ``RpcCallError`` (so that callers never
depend on grpc's exception types), and closes the channel.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from pdserve.rpc import tls as rpc_tls
from pdserve.rpc.server import MAX_MESSAGE_BYTES
from pdserve.telemetry import tracing

log = logging.getLogger(__name__)

REQUEST_ID_METADATA = "x-request-id"
# Set by a worker (initial metadata) to say why a call failed beyond its status code, e.g.
# "kv_transfer_failed": the decode worker is fine but could not pull the prompt's KV blocks.
ERROR_REASON_METADATA = "x-pdserve-error"
CLIENT_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Notice a dead peer on an idle channel within seconds, not at the next call's deadline.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]

T = TypeVar("T")


class RpcCallError(Exception):
    """An outbound RPC failed.

    ``code`` is the gRPC status name ("UNAVAILABLE", "DEADLINE_EXCEEDED", ...), ``address`` and
    ``method`` say which call; ``details`` is the server's message; ``reason`` is the worker's
    ``x-pdserve-error`` metadata ("" when absent).
    """

    def __init__(
        self, address: str, method: str, code: str, details: str, reason: str = ""
    ) -> None:
        super().__init__(f"{method} on {address} failed: {code}: {details}")
        self.address = address
        self.method = method
        self.code = code
        self.details = details
        self.reason = reason

    @property
    def unreachable(self) -> bool:
        """True when the peer could not be reached or did not answer in time."""
        return self.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")

    @property
    def caller_error(self) -> bool:
        """True when the server refused the request itself (retrying elsewhere will not help)."""
        return self.code in ("INVALID_ARGUMENT", "OUT_OF_RANGE", "ALREADY_EXISTS")


def request_metadata(request_id: str | None) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID_METADATA, request_id),) if request_id else ()


DEPLOYMENT_SECRET: Any = object()  # GrpcClient's default: pdserve.rpc.secret.deployment_secret()
DEPLOYMENT_TLS: Any = rpc_tls.DEPLOYMENT_TLS  # GrpcClient's default: rpc_tls.deployment_tls()


# How long a channel left behind by a new TLS identity waits for its calls to end (a decode
# stream may run for minutes) before they are cancelled and it closes.
RETIRED_CHANNEL_GRACE_S = 3600.0


class GrpcClient:
    """Owns a channel to ``address``; subclasses name their generated stub class (``STUB``)
    and call through ``self.stub``.

    The channel is created in the constructor (it connects lazily) and closed by ``close()``;
    every call through ``unary``/``stream`` has a deadline. With a TLS identity read from a
    directory, a call started after its files changed goes through a new channel dialled with
    the new identity (``pdserve.rpc.tls.ClientIdentity``); the old channel closes once its
    calls end.
    """

    STUB: Callable[[grpc.aio.Channel], Any] | None = None

    def __init__(
        self,
        address: str,
        *,
        default_timeout_s: float = 10.0,
        secret: Any = DEPLOYMENT_SECRET,
        tls: Any = DEPLOYMENT_TLS,
    ) -> None:
        """``secret``: bytes, None (send no token), or by default the process's deployment
        secret (``pdserve.rpc.secret.deployment_secret``). ``tls``: a
        ``pdserve.rpc.tls.TlsIdentity``, None (plain text), or by default the process's
        (``PDSERVE_TLS_DIR``)."""
        from pdserve.rpc.secret import deployment_secret

        self.address = address
        self.default_timeout_s = default_timeout_s
        self.secret: bytes | None = deployment_secret() if secret is DEPLOYMENT_SECRET else secret
        # The id the worker at ``address`` announced in its last GetCapabilities reply: tokens
        # are bound to it ("": none announced, or a call since was refused UNAUTHENTICATED).
        self.worker_id = ""
        self.tls: rpc_tls.TlsIdentity | None = rpc_tls.resolve(tls)
        self._identity = rpc_tls.client_identity(self.tls) if self.tls is not None else None
        self._generation = 0
        if self._identity is not None:
            self.tls, self._generation = self._identity.current()
        self.channel = rpc_tls.aio_channel(address, CLIENT_OPTIONS, self.tls)
        self._stub: Any = None
        self._retired: list[grpc.aio.Channel] = []  # channels of an earlier identity
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def stub(self) -> Any:
        """``STUB`` over the current channel (a new channel after the identity changed)."""
        self._follow_identity()
        if self._stub is None:
            assert self.STUB is not None, f"{type(self).__name__} names no STUB"
            self._stub = self.STUB(self.channel)
        return self._stub

    def _follow_identity(self) -> None:
        if self._identity is None:
            return
        identity, generation = self._identity.current()
        if generation == self._generation:
            return
        old = self.channel
        self.tls, self._generation = identity, generation
        self.channel = rpc_tls.aio_channel(self.address, CLIENT_OPTIONS, identity)
        self._stub = None
        log.info("new channel to %s with the TLS identity read again from %s",
                 self.address, identity.directory)  # fmt: skip
        self._retired.append(old)
        try:
            task = asyncio.get_running_loop().create_task(self._retire(old))
        except RuntimeError:  # no event loop here: it closes with the client
            return
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _retire(self, channel: grpc.aio.Channel) -> None:
        await channel.close(grace=RETIRED_CHANNEL_GRACE_S)
        if channel in self._retired:
            self._retired.remove(channel)

    def _metadata(
        self, method: str, request: Any, request_id: str | None
    ) -> tuple[tuple[str, str], ...]:
        # The current span's W3C context (traceparent): the worker's spans join the trace.
        metadata = request_metadata(request_id) + tracing.inject()
        if self.secret is not None:
            from pdserve.rpc.auth import IDENTITY_RPC, call_metadata

            # GetCapabilities is never bound: its reply is how the client (re)learns the id.
            bound = "" if method == IDENTITY_RPC else self.worker_id
            body = request.SerializeToString()  # the bytes grpc sends (its serializer's)
            metadata += call_metadata(self.secret, method, body, worker_id=bound)
        return metadata

    async def close(self) -> None:
        for channel in [*self._retired, self.channel]:
            await channel.close()
        self._retired.clear()

    async def __aenter__(self) -> GrpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _error(self, method: str, err: grpc.aio.AioRpcError) -> RpcCallError:
        if err.code() == grpc.StatusCode.UNAUTHENTICATED:
            # Another worker may have taken over the address: unbound until it announces.
            self.worker_id = ""
        metadata = {str(k): str(v) for k, v in (err.initial_metadata() or ())}
        reason = metadata.get(ERROR_REASON_METADATA, "")
        return RpcCallError(self.address, method, err.code().name, err.details() or "", reason)

    async def unary(
        self,
        method: str,
        call: Callable[..., Awaitable[T]],
        request: Any,
        request_id: str | None,
        timeout_s: float | None,
    ) -> T:
        """Run one unary call with a deadline and the request id as metadata."""
        from pdserve.rpc.auth import IDENTITY_RPC, WORKER_METADATA

        try:
            rpc: Any = call(
                request,
                timeout=timeout_s or self.default_timeout_s,
                metadata=self._metadata(method, request, request_id),
            )
            reply: T = await rpc
            if method == IDENTITY_RPC and self.secret is not None:
                trailers = {str(k): str(v) for k, v in (await rpc.trailing_metadata() or ())}
                self.worker_id = trailers.get(WORKER_METADATA, "")
        except grpc.aio.AioRpcError as err:
            raise self._error(method, err) from err
        return reply

    async def stream(
        self,
        method: str,
        call: Callable[..., Any],
        request: Any,
        request_id: str | None,
        timeout_s: float | None,
    ) -> AsyncGenerator[Any, None]:
        """Iterate a server-streaming call; closing or cancelling the iterator cancels the RPC."""
        rpc = call(
            request,
            timeout=timeout_s or self.default_timeout_s,
            metadata=self._metadata(method, request, request_id),
        )
        try:
            async for message in rpc:
                yield message
        except grpc.aio.AioRpcError as err:
            raise self._error(method, err) from err
        finally:
            # No-op when the call already finished; otherwise tells the server we are gone.
            rpc.cancel()


class WorkerClient(GrpcClient):
    """What both worker roles answer (``pdserve.v1.PrefillWorker`` and ``DecodeWorker``):
    their capabilities and run-time LoRA adapters."""

    async def capabilities(self, timeout: float | None = None) -> Any:
        from protos.v1 import worker_pb2

        request = worker_pb2.CapabilitiesRequest()
        return await self.unary(
            "GetCapabilities", self.stub.GetCapabilities, request, None, timeout
        )

    async def load_lora_adapter(
        self, name: str, path: str, inplace: bool = False, timeout: float | None = None
    ) -> None:
        from protos.v1 import worker_pb2

        request = worker_pb2.LoraAdapterRequest(name=name, path=path, load_inplace=inplace)
        await self.unary("LoadLoraAdapter", self.stub.LoadLoraAdapter, request, None, timeout)

    async def unload_lora_adapter(self, name: str, timeout: float | None = None) -> None:
        from protos.v1 import worker_pb2

        request = worker_pb2.LoraAdapterRequest(name=name)
        await self.unary("UnloadLoraAdapter", self.stub.UnloadLoraAdapter, request, None, timeout)
