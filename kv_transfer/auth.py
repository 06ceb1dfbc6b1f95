"""The deployment secret on the KV transfer port: loading it, MACs, and the connection handshake.

Every TCP connection to a transfer process starts with a mutual HMAC challenge/response
before the server reads anything else or allocates anything for it::

    server -> client   {"op": "hello", "v": 1, "nonce": <hex>, "auth": true|false}
    client -> server   {"op": "auth", "nonce": <hex>, "mac": HMAC(secret, "kv-client", sn, cn)}
    server -> client   {"ok": true, "mac": HMAC(secret, "kv-server", sn, cn)}   (or ok false)

Both sides prove they hold the secret without sending it; nonces from both sides keep a
recorded exchange from being replayed. Both handshakes return the connection's own key,
``session_key(secret, sn, cn)``, with which the KV bytes sent later are authenticated
(``kv_transfer.integrity``). A server without a secret says ``auth: false`` and
accepts any client that has none either; a client with a secret refuses such a server (it
cannot prove it belongs to the deployment), and a server with a secret refuses a client
without one. Frames before the handshake completes are at most ``HANDSHAKE_FRAME`` bytes, and
the whole handshake has one deadline (each side's ``deadline``), however slowly its bytes come.

The server admits connections to the handshake through a ``HandshakeGate`` (at most so many
per peer address and in all, the oldest cut off first); ``connect`` tries again, within its
timeout, when the server cuts its handshake off or closes it at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import random
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kv_transfer.errors import KVTransferError
from kv_transfer.wire import HANDSHAKE_FRAME, ConnectionClosed, recv_frame, send_frame

PROTOCOL_VERSION = 1
MIN_SECRET_BYTES = 16
# A client whose handshake the server cut off tries again after a pause that doubles from
# RETRY_FIRST_S up to RETRY_MAX_S (times a random 0.5-1, so that a burst spreads out).
RETRY_FIRST_S = 0.01
RETRY_MAX_S = 0.5
_CUT_OFF = (ConnectionClosed, ConnectionResetError, BrokenPipeError)


class AuthenticationFailed(KVTransferError):
    """The peer does not hold this deployment's secret (or this side has none)."""


def load_secret(path: str | os.PathLike[str] | None) -> bytes | None:
    """The secret stored in ``path`` (surrounding whitespace stripped); None for no path.

    Raises ValueError with a message fit for a user when the file is unreadable or too short.
    """
    if not path:
        return None
    try:
        value = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the deployment secret file {path}: {exc.strerror}") from exc
    if len(value) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the deployment secret in {path} is {len(value)} bytes; at least "
            f"{MIN_SECRET_BYTES} are needed (e.g. `openssl rand -hex 32`)"
        )
    return value


def new_secret() -> str:
    """A fresh random secret (64 hex characters)."""
    return secrets.token_hex(32)


def mac(secret: bytes, *parts: str) -> str:
    """HMAC-SHA256 over the parts, each length-prefixed so that no two part lists collide."""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


def session_key(secret: bytes | None, server_nonce: str, client_nonce: str) -> bytes:
    """The key of one connection, known to both ends after the handshake (without a secret
    it still catches corruption, not forgery)."""
    return bytes.fromhex(
        mac(secret or b"pdserve-kv-open", "kv-session", server_nonce, client_nonce)
    )


def same(a: object, b: str) -> bool:
    """Constant-time comparison of a received MAC with the expected one."""
    return isinstance(a, str) and hmac.compare_digest(a.encode(), b.encode())


def server_handshake(
    conn: socket.socket,
    secret: bytes | None,
    deadline: float | None = None,
    on_verified: Callable[[], None] | None = None,
) -> bytes:
    """Authenticate a connecting client and return the connection's key; raises
    AuthenticationFailed (or OSError/ValueError, TimeoutError once ``deadline``, in monotonic
    seconds, has passed). ``on_verified`` runs when the client has proven itself, before the
    last frame: raising there refuses it."""
    server_nonce = secrets.token_hex(16)
    hello = {
        "op": "hello",
        "v": PROTOCOL_VERSION,
        "nonce": server_nonce,
        "auth": secret is not None,
    }
    send_frame(conn, hello, deadline)
    reply = recv_frame(conn, HANDSHAKE_FRAME, deadline)
    client_nonce = reply.get("nonce")
    if reply.get("op") != "auth" or not isinstance(client_nonce, str) or len(client_nonce) > 64:
        raise AuthenticationFailed("the peer did not start the KV transfer handshake")
    if secret is None:
        if reply.get("mac"):
            refusal = {"ok": False, "error": "this KV transfer port has no secret"}
            send_frame(conn, refusal, deadline)
            raise AuthenticationFailed("a client with a secret reached a port without one")
        if on_verified is not None:
            on_verified()
        send_frame(conn, {"ok": True}, deadline)
        return session_key(None, server_nonce, client_nonce)
    if not same(reply.get("mac"), mac(secret, "kv-client", server_nonce, client_nonce)):
        send_frame(conn, {"ok": False, "error": "authentication failed"}, deadline)
        raise AuthenticationFailed("a KV transfer client failed authentication")
    if on_verified is not None:
        on_verified()
    proof = mac(secret, "kv-server", server_nonce, client_nonce)
    send_frame(conn, {"ok": True, "mac": proof}, deadline)
    return session_key(secret, server_nonce, client_nonce)


def client_handshake(
    conn: socket.socket, secret: bytes | None, deadline: float | None = None
) -> bytes:
    """Authenticate to a transfer server, check that it holds the same secret, and return
    the connection's key."""
    hello = recv_frame(conn, HANDSHAKE_FRAME, deadline)
    server_nonce = hello.get("nonce")
    if hello.get("op") != "hello" or not isinstance(server_nonce, str):
        raise AuthenticationFailed("the peer is not a pdserve KV transfer port")
    if hello.get("v") != PROTOCOL_VERSION:
        raise AuthenticationFailed(
            f"the peer speaks KV transfer protocol {hello.get('v')}, this worker "
            f"{PROTOCOL_VERSION}: upgrade both to the same pdserve version"
        )
    if secret is not None and not hello.get("auth"):
        raise AuthenticationFailed(
            "the peer's KV port runs without a deployment secret; refusing to exchange KV "
            "blocks with it (give both workers the same PDSERVE_SECRET_FILE)"
        )
    if secret is None and hello.get("auth"):
        raise AuthenticationFailed(
            "the peer's KV port requires the deployment secret and this worker has none "
            "(set PDSERVE_SECRET_FILE)"
        )
    client_nonce = secrets.token_hex(16)
    message: dict[str, object] = {"op": "auth", "nonce": client_nonce}
    if secret is not None:
        message["mac"] = mac(secret, "kv-client", server_nonce, client_nonce)
    send_frame(conn, message, deadline)
    answer = recv_frame(conn, HANDSHAKE_FRAME, deadline)
    if not answer.get("ok"):
        raise AuthenticationFailed(
            f"the peer refused this worker: {answer.get('error', 'authentication failed')} "
            "(do both use the same deployment secret?)"
        )
    if secret is not None and not same(
        answer.get("mac"), mac(secret, "kv-server", server_nonce, client_nonce)
    ):
        raise AuthenticationFailed("the peer could not prove it holds the deployment secret")
    return session_key(secret, server_nonce, client_nonce)


def connect(host: str, port: int, secret: bytes | None, timeout_s: float) -> socket.socket:
    """``connect_keyed`` without the connection's key."""
    return connect_keyed(host, port, secret, timeout_s)[0]


def connect_keyed(
    host: str, port: int, secret: bytes | None, timeout_s: float
) -> tuple[socket.socket, bytes]:
    """A new, authenticated connection to a transfer server and its key (``session_key``),
    made within ``timeout_s`` in all; the socket's timeout is ``timeout_s`` afterwards.

    A handshake the server cuts off (its ``HandshakeGate`` sheds the oldest unauthenticated
    connections; at its connection cap it closes new ones at once) is tried again on a new
    connection after a growing pause, until ``timeout_s`` is spent. Other failures (refused,
    not authenticated, no answer in time) raise at once.
    """
    deadline = time.monotonic() + timeout_s
    pause = RETRY_FIRST_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no KV transfer connection to {host}:{port} in {timeout_s} s")
        conn = socket.create_connection((host, port), timeout=left)
        try:
            key = client_handshake(conn, secret, deadline)
        except _CUT_OFF as exc:
            conn.close()
            if time.monotonic() + pause >= deadline:
                raise ConnectionClosed(
                    f"the KV transfer port {host}:{port} closed every connection before its "
                    f"handshake completed, for {timeout_s} s (at its connection limit?): {exc}"
                ) from exc
            time.sleep(pause * random.uniform(0.5, 1.0))
            pause = min(2 * pause, RETRY_MAX_S)
            continue
        except BaseException:
            conn.close()
            raise
        conn.settimeout(timeout_s)
        return conn, key


@dataclass(eq=False)
class Ticket:
    """A connection in the handshake (hashed by identity)."""

    conn: socket.socket
    address: str
    since: float  # monotonic, when it was accepted
    cut: bool = False  # cut off by the gate to make room for a newer one


class HandshakeGate:
    """The server's connections that are still in the handshake: at most ``per_address`` from
    one peer address and ``total`` in all. A new connection beyond either bound cuts off the
    oldest one (of its own address if that is full, else of all), so connections that never
    finish cannot keep new ones out: to push out an honest handshake (milliseconds long, and
    its client tries again) a peer must open that many connections meanwhile, and one address
    can only ever push out its own. Each connection's owner calls ``admit`` once its peer has
    proven itself and ``leave`` in any case, before it closes the socket.
    """

    def __init__(self, total: int, per_address: int) -> None:
        self.total = max(1, total)
        self.per_address = max(1, per_address)
        self.lock = threading.Lock()
        self.waiting: OrderedDict[Ticket, None] = OrderedDict()  # oldest first
        self.by_address: dict[str, OrderedDict[Ticket, None]] = {}
        self.cut_off = 0

    def enter(self, conn: socket.socket, address: str) -> Ticket:
        ticket = Ticket(conn, address, time.monotonic())
        with self.lock:
            same_address = self.by_address.get(address)
            if same_address is not None and len(same_address) >= self.per_address:
                self._cut(next(iter(same_address)))
            elif len(self.waiting) >= self.total:
                self._cut(next(iter(self.waiting)))
            self.waiting[ticket] = None
            self.by_address.setdefault(address, OrderedDict())[ticket] = None
        return ticket

    def admit(self, ticket: Ticket) -> None:
        """The peer has proven itself: it leaves the gate, unless it was cut off already."""
        with self.lock:
            if ticket.cut:
                raise ConnectionClosed("cut off to make room for newer connections")
            self._remove(ticket)

    def leave(self, ticket: Ticket) -> None:
        """Out of the gate (admitted, refused or failed); any number of times."""
        with self.lock:
            self._remove(ticket)

    def count(self, address: str | None = None) -> int:
        with self.lock:
            if address is None:
                return len(self.waiting)
            return len(self.by_address.get(address, ()))

    def _remove(self, ticket: Ticket) -> None:
        self.waiting.pop(ticket, None)
        same_address = self.by_address.get(ticket.address)
        if same_address is not None:
            same_address.pop(ticket, None)
            if not same_address:
                del self.by_address[ticket.address]

    def _cut(self, ticket: Ticket) -> None:
        """Caller holds the lock. The socket is still open: its owner leaves the gate (under
        this lock) before it closes it. Shutting it down wakes the owner's blocked read."""
        self._remove(ticket)
        ticket.cut = True
        self.cut_off += 1
        with contextlib.suppress(OSError):
            ticket.conn.shutdown(socket.SHUT_RDWR)
