"""Calls other processes make on a prefill worker's transfer process.

Both authenticate with the deployment secret (``kv_transfer.auth``); ``secret=None`` works
only with a prefill worker that runs without one. Each call opens one short connection.
"""

from __future__ import annotations

from typing import Any

from kv_transfer.auth import connect
from kv_transfer.wire import recv_frame, send_frame

# The ``kv_transfer_params`` entry of a prefill request that names its job for
# ``release_by_key`` (the engine renames requests; the caller knows only its own id).
RELEASE_KEY = "pdserve_release_key"


def _call(
    message: dict[str, Any], host: str, port: int, timeout_s: float, secret: bytes | None
) -> bool:
    with connect(host, port, secret, timeout_s) as conn:
        send_frame(conn, message)
        return bool(recv_frame(conn).get("found"))


def release(
    host: str, port: int, req: str, timeout_s: float = 5.0, *, secret: bytes | None = None
) -> bool:
    """Ask a prefill worker's agent to unpin a request's blocks; True if it held them.

    Safe to call before the blocks are registered: the agent then unpins them on arrival.
    Raises OSError when the agent cannot be reached, ``AuthenticationFailed`` (a
    ``KVTransferError``) when it does not accept this secret.
    """
    return _call({"op": "release", "req": req}, host, port, timeout_s, secret)


def release_by_key(
    host: str, port: int, key: str, timeout_s: float = 5.0, *, secret: bytes | None = None
) -> bool:
    """As ``release``, for the job whose prefill request carried ``RELEASE_KEY: key``.

    The prefill worker's own abort path: it knows its request id, not the engine's, and its
    abort may come before, while or after the engine finishes the prompt. True if held.
    """
    return _call({"op": "release", "key": key}, host, port, timeout_s, secret)


def renew(
    host: str, port: int, req: str, timeout_s: float = 5.0, *, secret: bytes | None = None
) -> bool:
    """Push the lease of a request's pinned blocks out to the agent's ``lease_s`` from now.

    For a decode worker whose engine has the request queued but not yet pulled: call it every
    few seconds (well within ``lease_s``). True if the agent holds the request's blocks (False:
    unknown, already pulled or released, or its lease ran out). Raises as ``release`` does.
    """
    return _call({"op": "renew", "req": req}, host, port, timeout_s, secret)
