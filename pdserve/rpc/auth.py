"""Authentication of worker gRPC calls with the deployment secret (``pdserve.rpc.secret``).

A caller sends ``x-pdserve-auth: <unix time>.<HMAC>`` with every call, the HMAC taken over
("grpc", rpc name, time); a token *bound* to a worker is ``<unix time>.<HMAC>.<worker id>``,
the HMAC taken over ("grpc", rpc name, time, worker id). A worker's server interceptor
(``AuthInterceptor``) refuses with UNAUTHENTICATED, before the call reaches a servicer, a call
whose token is missing, has a wrong HMAC, was made for another RPC, is older or newer than
``MAX_SKEW_S``, or is bound to another worker than the server's ``worker_id`` (when it was
given one). Health checks and reflection stay open (they reveal nothing and orchestrators
probe them).

What is guaranteed:

* A refused call's request is never read: the refusal handler is request-streaming and never
  asks for a message, so grpc does not deserialize the body and receives no more of it than
  the stream's flow-control window; a unary client gets the same UNAUTHENTICATED. (With a
  unary refusal handler grpc received and parsed the whole message, up to 64 MiB, first.)
* Worker servers (``pdserve.rpc.server.GrpcServer`` given the secret) run with
  ``WORKER_OPTIONS``: no BDP probing, so that window stays at 64 KiB however much refused
  traffic arrives, and at most ``WORKER_MAX_STREAMS`` concurrent streams per connection.
  tests/integration/test_worker_preauth.py measures both in a worker process: its RSS grows
  by at most 64 MB under three waves of 16 concurrent unauthenticated 24 MiB Prefill calls,
  and under three waves of 512 concurrent unauthenticated 256 KiB ones.
* A token never contains the secret; a recorded token is good only for the same RPC within
  the skew window and, when bound, only at the worker it names.
* A token is good only with the request body it was made for: every call also carries
  ``x-pdserve-body: <HMAC>`` over the token and the SHA-256 of the serialized request
  (``body_mac``). The token is checked before the body is read (above); the body's HMAC
  once grpc has received it, before it is deserialized or reaches a servicer, so a recorded
  token and body HMAC cannot carry another body (tests/integration/test_worker_auth.py
  ``test_a_recorded_token_does_not_carry_another_body``). Every RPC of the worker services
  has a unary request; a request-streaming one would not be bound.
* Binding is negotiated: a server given a ``worker_id`` sends it in the trailing metadata
  (``WORKER_METADATA``) of every authenticated GetCapabilities reply, and a client
  (``pdserve.rpc.client.GrpcClient``) binds its later tokens to the id in its last
  GetCapabilities reply. GetCapabilities tokens are never bound. Workers that announce nothing
  (older ones, ones given no id) are sent unbound tokens only, and a server accepts unbound
  tokens (from clients that have not called GetCapabilities), so binding protects the calls
  of clients that did. A call refused with UNAUTHENTICATED unbinds the client until the next
  announcement (another worker may have taken over the address).

What is not:

* Replay of the same call: within the window a recorded token with its body HMAC repeats
  the same request (to the same worker, when bound). Use TLS on untrusted networks
  (docs/deploy.md).
* Not the ``:authority`` the client dialled: a server interceptor does not see it (its
  ``HandlerCallDetails`` carry the method and the call's metadata only), and a worker cannot
  tell whether a claimed authority (a Kubernetes Service's name, a proxy's) is one of its own
  names, so binding to it would stop no replay; the worker id is the target instead.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kv_transfer.auth import mac, same

log = logging.getLogger(__name__)

AUTH_METADATA = "x-pdserve-auth"
# The HMAC binding a call's token to its serialized request body (``body_mac``).
BODY_METADATA = "x-pdserve-body"
MAX_SKEW_S = 120
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# The RPC whose reply tells a client which worker answers: its tokens are never bound, so
# that a client can always (re)learn who answers at an address.
IDENTITY_RPC = "GetCapabilities"
# Trailing metadata of an authenticated IDENTITY_RPC reply from a worker that knows its id:
# the id to bind later tokens to. Workers that do not send it (older ones, ones not given an
# id) are never sent bound tokens, which they would refuse.
WORKER_METADATA = "x-pdserve-worker"


def bindable(worker_id: str) -> bool:
    """True when a token can name ``worker_id`` (metadata values are printable ASCII)."""
    return bool(worker_id) and worker_id.isascii() and worker_id.isprintable()


def token(secret: bytes, rpc: str, now: float | None = None, worker_id: str = "") -> str:
    """The auth metadata value for a call of ``rpc`` (its short name, e.g. "Prefill"), bound
    to ``worker_id`` when that is given (and ``bindable``)."""
    stamp = str(int(time.time() if now is None else now))
    if bindable(worker_id):
        return f"{stamp}.{mac(secret, 'grpc', rpc, stamp, worker_id)}.{worker_id}"
    return f"{stamp}.{mac(secret, 'grpc', rpc, stamp)}"


def body_mac(secret: bytes, token_value: str, body: bytes) -> str:
    """The ``BODY_METADATA`` value of a call: HMAC over its token and its body's SHA-256."""
    return mac(secret, "grpc-body", token_value, hashlib.sha256(body).hexdigest())


def call_metadata(
    secret: bytes, rpc: str, body: bytes, worker_id: str = ""
) -> tuple[tuple[str, str], ...]:
    """Both auth entries of a call of ``rpc`` with the serialized request ``body``."""
    value = token(secret, rpc, worker_id=worker_id)
    return ((AUTH_METADATA, value), (BODY_METADATA, body_mac(secret, value, body)))


def target(value: str) -> str:
    """The worker a token is bound to ("" when unbound or malformed)."""
    return value.partition(".")[2].partition(".")[2]


def valid(
    secret: bytes, rpc: str, value: str | None, now: float | None = None, worker_id: str = ""
) -> bool:
    """True for a token made with ``secret`` for ``rpc`` within ``MAX_SKEW_S`` of ``now``,
    unbound or bound to ``worker_id`` (a server without an id takes any worker's)."""
    if not value or "." not in value:
        return False
    stamp, _, rest = value.partition(".")
    signature, _, bound = rest.partition(".")
    if not stamp.isdigit():
        return False
    now = time.time() if now is None else now
    if abs(now - int(stamp)) > MAX_SKEW_S:
        return False
    if not bound:
        return same(signature, mac(secret, "grpc", rpc, stamp))
    if worker_id and bound != worker_id:
        return False
    return same(signature, mac(secret, "grpc", rpc, stamp, bound))


def rpc_name(method: str) -> str:
    """ "/pdserve.v1.PrefillWorker/Prefill" -> "Prefill"."""
    return method.rsplit("/", 1)[-1]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid ``x-pdserve-auth`` token, unread (see the module
    docstring). ``worker_id``: the server's own name ("": tokens bound to any worker pass)."""

    def __init__(self, secret: bytes, worker_id: str = "") -> None:
        self.secret = secret
        self.worker_id = worker_id

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
        value = value if isinstance(value, str) else None
        if valid(self.secret, rpc_name(method), value, worker_id=self.worker_id):
            body = metadata.get(BODY_METADATA)
            expected = body if isinstance(body, str) else ""
            handler = _body_bound(await continuation(details), self.secret, str(value), expected)
            if rpc_name(method) == IDENTITY_RPC and bindable(self.worker_id):
                return _announcing(handler, self.worker_id)
            return handler
        handler = await continuation(details)
        if handler is None:
            return handler
        bound = target(value or "")
        if bound and self.worker_id and bound != self.worker_id:
            log.warning("refused a call of %s with a token for worker %r (this is %r)",
                        method, bound, self.worker_id)  # fmt: skip
            return _refusal(handler, _ELSEWHERE)
        log.warning("refused an unauthenticated call of %s", method)
        return _refusal(handler, _REFUSED)


def _body_bound(
    handler: grpc.RpcMethodHandler | None, secret: bytes, token_value: str, expected: str
) -> Any:
    """``handler`` (unary request) that first checks the received bytes against the call's
    ``BODY_METADATA`` and refuses them, undeserialized, when they do not match."""
    if handler is None or handler.request_streaming:
        return handler
    deserialize = handler.request_deserializer
    streaming = handler.response_streaming
    behavior = handler.unary_stream if streaming else handler.unary_unary

    async def checked(body: bytes, context: grpc.aio.ServicerContext) -> Any:
        if not same(expected, body_mac(secret, token_value, body)):
            log.warning("refused a call whose body does not match its token")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _OTHER_BODY)
        return deserialize(body) if deserialize is not None else body

    async def unary(body: bytes, context: grpc.aio.ServicerContext) -> Any:
        result = behavior(await checked(body, context), context)
        return await result if inspect.isawaitable(result) else result

    async def stream(body: bytes, context: grpc.aio.ServicerContext) -> Any:
        result = behavior(await checked(body, context), context)
        if inspect.isawaitable(result):  # a servicer that writes with context.write
            await result
            return
        async for message in result:
            yield message

    make = (
        grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
    )
    return make(
        stream if streaming else unary,  # type: ignore[arg-type]
        request_deserializer=None,
        response_serializer=handler.response_serializer,
    )


def _announcing(handler: grpc.RpcMethodHandler | None, worker_id: str) -> Any:
    """``handler`` (unary) that also sends ``worker_id`` in its trailing metadata."""
    if handler is None or handler.request_streaming or handler.response_streaming:
        return handler
    behavior = handler.unary_unary

    async def announce(request: Any, context: grpc.aio.ServicerContext) -> Any:
        # Trailing, not initial, metadata: a handler that sends its own initial metadata
        # still can; one that sets trailing metadata replaces this (the client then does
        # not bind, which is safe).
        context.set_trailing_metadata(((WORKER_METADATA, worker_id),))
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return grpc.unary_unary_rpc_method_handler(
        announce,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


_REFUSED = (
    "this worker accepts only calls authenticated with the deployment secret "
    "(set PDSERVE_SECRET_FILE to the same file as the workers')"
)
_OTHER_BODY = (
    "the call's body does not match its token (a token is good only with the request it "
    "was made for)"
)
_ELSEWHERE = (
    "the call's token is for another worker than this one (has another worker taken over "
    "this address? the caller learns who answers from GetCapabilities)"
)


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler that refuses the call without reading its request.

    It is request-streaming whatever ``handler`` is (the wire does not tell a unary request
    from a stream of one message, so a unary client gets the same answer): grpc reads a
    request-streaming call's messages only when the handler asks for them, where for a
    unary request it receives and parses the whole message (up to the 64 MiB limit) before
    the handler runs. It has no request deserializer, and keeps the response kind.
    """

    async def deny(requests: Any, context: grpc.aio.ServicerContext) -> None:
        # ``requests`` is never iterated: the body stays unread (and undeserialized).
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    make = (
        grpc.stream_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.stream_unary_rpc_method_handler
    )
    return make(deny, request_deserializer=None, response_serializer=None)  # type: ignore[operator]
