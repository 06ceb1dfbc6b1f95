"""Framing on the transfer sockets: length-prefixed JSON control frames and raw byte runs.

Control frames are small (job descriptions, acknowledgements). KV bytes never go through
JSON: they are written from and read into memoryviews of the mapped KV cache directly.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterable
from typing import Any

_LEN = struct.Struct("!I")
MAX_FRAME = 64 * 1024 * 1024


class ConnectionClosed(ConnectionError):
    pass


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    header = recv_exact(sock, _LEN.size)
    (size,) = _LEN.unpack(header)
    if size > MAX_FRAME:
        raise ConnectionError(f"control frame of {size} bytes is larger than {MAX_FRAME}")
    message = json.loads(recv_exact(sock, size))
    if not isinstance(message, dict):
        raise ConnectionError("control frame is not a JSON object")
    return message


def recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from ``sock`` (recv_into releases the GIL while it waits)."""
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionClosed(f"peer closed the connection after {got} of {size} bytes")
        got += n


def send_views(sock: socket.socket, views: Iterable[memoryview]) -> int:
    """Send each view in order; returns the bytes sent."""
    total = 0
    for view in views:
        sock.sendall(view)
        total += len(view)
    return total


def tune(sock: socket.socket) -> None:
    """Socket options for bulk transfer: no Nagle delay, large kernel buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 * 1024 * 1024)
        except OSError:
            pass  # the kernel caps it; the default still works


class LineChannel:
    """Newline-delimited JSON over a local stream socket (worker <-> transfer process)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    def poll(self) -> list[dict[str, Any]]:
        """Messages available now, without blocking."""
        self.sock.setblocking(False)
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    raise ConnectionClosed("transfer process closed its control channel")
                self._buf += chunk
        except BlockingIOError:
            pass
        finally:
            self.sock.setblocking(True)
        return self._take_lines()

    def recv(self) -> dict[str, Any] | None:
        """The next message, blocking; None when the peer closed the channel."""
        while b"\n" not in self._buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def _take_lines(self) -> list[dict[str, Any]]:
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(line) for line in lines if line]
