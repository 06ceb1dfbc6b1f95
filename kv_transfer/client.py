"""Calls other processes make on a prefill worker's transfer process."""

from __future__ import annotations

import socket

from kv_transfer.wire import recv_frame, send_frame


def release(host: str, port: int, req: str, timeout_s: float = 5.0) -> bool:
    """Ask a prefill worker's agent to unpin a request's blocks; True if it held them.

    Safe to call before the blocks are registered: the agent then unpins them on arrival.
    """
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        send_frame(conn, {"op": "release", "req": req})
        return bool(recv_frame(conn).get("found"))
