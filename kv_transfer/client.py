"""Calls other processes make on a prefill worker's transfer process.

Both authenticate with the deployment secret (``kv_transfer.auth``); ``secret=None`` works
only with a prefill worker that runs without one. Each call opens one short connection.
"""

from __future__ import annotations

from kv_transfer.auth import connect
from kv_transfer.wire import recv_frame, send_frame


def _call(op: str, host: str, port: int, req: str, timeout_s: float, secret: bytes | None) -> bool:
    with connect(host, port, secret, timeout_s) as conn:
        send_frame(conn, {"op": op, "req": req})
        return bool(recv_frame(conn).get("found"))


def release(
    host: str, port: int, req: str, timeout_s: float = 5.0, *, secret: bytes | None = None
) -> bool:
    """Ask a prefill worker's agent to unpin a request's blocks; True if it held them.

    Safe to call before the blocks are registered: the agent then unpins them on arrival.
    Raises OSError when the agent cannot be reached, ``AuthenticationFailed`` (a
    ``KVTransferError``) when it does not accept this secret.
    """
    return _call("release", host, port, req, timeout_s, secret)


def renew(
    host: str, port: int, req: str, timeout_s: float = 5.0, *, secret: bytes | None = None
) -> bool:
    """Push the lease of a request's pinned blocks out to the agent's ``lease_s`` from now.

    For a decode worker whose engine has the request queued but not yet pulled: call it every
    few seconds (well within ``lease_s``). True if the agent holds the request's blocks (False:
    unknown, already pulled or released, or its lease ran out). Raises as ``release`` does.
    """
    return _call("renew", host, port, req, timeout_s, secret)
