"""Authentication of worker gRPC calls with the deployment secret (``pdserve.rpc.secret``).

A caller sends ``x-pdserve-auth: <unix time>.<HMAC(secret, "grpc", rpc name, time)>`` with
every call; a worker's server interceptor refuses a call without a valid one, one older or
newer than ``MAX_SKEW_S``, or one made for another RPC, with UNAUTHENTICATED, before the call
reaches a servicer. Health checks and reflection stay open (they reveal nothing and
orchestrators probe them). The token never contains the secret; a recorded token is good only
for the same RPC within the skew window (use TLS on untrusted networks, docs/deploy.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kv_transfer.auth import mac, same

log = logging.getLogger(__name__)

AUTH_METADATA = "x-pdserve-auth"
MAX_SKEW_S = 120
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def token(secret: bytes, rpc: str, now: float | None = None) -> str:
    """The auth metadata value for a call of ``rpc`` (its short name, e.g. "Prefill")."""
    stamp = str(int(time.time() if now is None else now))
    return f"{stamp}.{mac(secret, 'grpc', rpc, stamp)}"


def valid(secret: bytes, rpc: str, value: str | None, now: float | None = None) -> bool:
    if not value or "." not in value:
        return False
    stamp, _, signature = value.partition(".")
    if not stamp.isdigit():
        return False
    now = time.time() if now is None else now
    if abs(now - int(stamp)) > MAX_SKEW_S:
        return False
    return same(signature, mac(secret, "grpc", rpc, stamp))


def rpc_name(method: str) -> str:
    """ "/pdserve.v1.PrefillWorker/Prefill" -> "Prefill"."""
    return method.rsplit("/", 1)[-1]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid ``x-pdserve-auth`` token (see the module docstring)."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method
        if method.startswith(OPEN_PREFIXES):
            return await continuation(details)
        metadata = {str(k): v for k, v in (details.invocation_metadata or ())}
        value = metadata.get(AUTH_METADATA)
        if valid(self.secret, rpc_name(method), value if isinstance(value, str) else None):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return handler
        log.warning("refused an unauthenticated call of %s", method)
        return _refusal(handler)


_REFUSED = (
    "this worker accepts only calls authenticated with the deployment secret "
    "(set PDSERVE_SECRET_FILE to the same file as the workers')"
)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that refuses the call unread."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(  # type: ignore[operator]
        _deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
