"""The deployment secret on the KV transfer port: loading it, MACs, and the connection handshake.

Every TCP connection to a transfer process starts with a mutual HMAC challenge/response
before the server reads anything else or allocates anything for it::

    server -> client   {"op": "hello", "v": 1, "nonce": <hex>, "auth": true|false}
    client -> server   {"op": "auth", "nonce": <hex>, "mac": HMAC(secret, "kv-client", sn, cn)}
    server -> client   {"ok": true, "mac": HMAC(secret, "kv-server", sn, cn)}   (or ok false)

Both sides prove they hold the secret without sending it; nonces from both sides keep a
recorded exchange from being replayed. A server without a secret says ``auth: false`` and
accepts any client that has none either; a client with a secret refuses such a server (it
cannot prove it belongs to the deployment), and a server with a secret refuses a client
without one. Frames before the handshake completes are at most ``HANDSHAKE_FRAME`` bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
from pathlib import Path

from kv_transfer.errors import KVTransferError
from kv_transfer.wire import HANDSHAKE_FRAME, recv_frame, send_frame

PROTOCOL_VERSION = 1
MIN_SECRET_BYTES = 16


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


def same(a: object, b: str) -> bool:
    """Constant-time comparison of a received MAC with the expected one."""
    return isinstance(a, str) and hmac.compare_digest(a.encode(), b.encode())


def server_handshake(conn: socket.socket, secret: bytes | None) -> None:
    """Authenticate a connecting client; raises AuthenticationFailed (or OSError/ValueError)."""
    server_nonce = secrets.token_hex(16)
    send_frame(
        conn,
        {"op": "hello", "v": PROTOCOL_VERSION, "nonce": server_nonce, "auth": secret is not None},
    )
    reply = recv_frame(conn, HANDSHAKE_FRAME)
    client_nonce = reply.get("nonce")
    if reply.get("op") != "auth" or not isinstance(client_nonce, str) or len(client_nonce) > 64:
        raise AuthenticationFailed("the peer did not start the KV transfer handshake")
    if secret is None:
        if reply.get("mac"):
            send_frame(conn, {"ok": False, "error": "this KV transfer port has no secret"})
            raise AuthenticationFailed("a client with a secret reached a port without one")
        send_frame(conn, {"ok": True})
        return
    if not same(reply.get("mac"), mac(secret, "kv-client", server_nonce, client_nonce)):
        send_frame(conn, {"ok": False, "error": "authentication failed"})
        raise AuthenticationFailed("a KV transfer client failed authentication")
    send_frame(conn, {"ok": True, "mac": mac(secret, "kv-server", server_nonce, client_nonce)})


def client_handshake(conn: socket.socket, secret: bytes | None) -> None:
    """Authenticate to a transfer server and check that it holds the same secret."""
    hello = recv_frame(conn, HANDSHAKE_FRAME)
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
    send_frame(conn, message)
    answer = recv_frame(conn, HANDSHAKE_FRAME)
    if not answer.get("ok"):
        raise AuthenticationFailed(
            f"the peer refused this worker: {answer.get('error', 'authentication failed')} "
            "(do both use the same deployment secret?)"
        )
    if secret is not None and not same(
        answer.get("mac"), mac(secret, "kv-server", server_nonce, client_nonce)
    ):
        raise AuthenticationFailed("the peer could not prove it holds the deployment secret")


def connect(host: str, port: int, secret: bytes | None, timeout_s: float) -> socket.socket:
    """A new, authenticated connection to a transfer server."""
    conn = socket.create_connection((host, port), timeout=timeout_s)
    try:
        client_handshake(conn, secret)
    except BaseException:
        conn.close()
        raise
    return conn
