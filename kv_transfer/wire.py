"""Framing on the transfer sockets: length-prefixed JSON control frames and raw byte runs.

Control frames are small (job descriptions, acknowledgements). KV bytes never go through
JSON: they are written from and read into memoryviews of the mapped KV cache directly.

Every frame read from the network is bounded by its reader before anything is allocated:
``HANDSHAKE_FRAME`` until the peer is authenticated, ``CONTROL_FRAME`` for answers, and for
a pull request a bound derived from the KV layout (its block list), never more than
``MAX_FRAME``.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import struct
import threading
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
HANDSHAKE_FRAME = 1024
CONTROL_FRAME = 64 * 1024
MAX_FRAME = 16 * 1024 * 1024


class ConnectionClosed(ConnectionError):
    pass


class FrameTooLarge(ConnectionError):
    """The peer announced a frame larger than the reader allows."""


def encode_frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(encode_frame(message))


def recv_frame(sock: socket.socket, limit: int = CONTROL_FRAME) -> dict[str, Any]:
    """The next control frame; a frame announced larger than ``limit`` is refused unread."""
    header = recv_exact(sock, _LEN.size)
    (size,) = _LEN.unpack(header)
    if size > min(limit, MAX_FRAME):
        raise FrameTooLarge(f"control frame of {size} bytes is larger than {min(limit, MAX_FRAME)}")
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


# Buffers per sendmsg/recvmsg_into call (Linux IOV_MAX is 1024).
MAX_IOV = 512


def send_views(sock: socket.socket, views: Iterable[memoryview]) -> int:
    """Send the views in order with scatter/gather writes; returns the bytes sent."""
    pending = [v.cast("B") for v in views if len(v)]
    total = 0
    while pending:
        sent = sock.sendmsg(pending[:MAX_IOV])
        total += sent
        pending = _advance(pending, sent)
    return total


def recv_views(sock: socket.socket, views: Iterable[memoryview]) -> int:
    """Fill the views in order with scatter/gather reads; returns the bytes received."""
    pending = [v.cast("B") for v in views if len(v)]
    total = 0
    while pending:
        got = sock.recvmsg_into(pending[:MAX_IOV])[0]
        if got == 0:
            raise ConnectionClosed(f"peer closed the connection after {total} bytes")
        total += got
        pending = _advance(pending, got)
    return total


def _advance(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """Drop the first ``nbytes`` from a list of views."""
    index = 0
    while nbytes and nbytes >= len(views[index]):
        nbytes -= len(views[index])
        index += 1
    rest = views[index:]
    if nbytes:
        rest[0] = rest[0][nbytes:]
    return rest


def tune(sock: socket.socket) -> None:
    """No Nagle delay on the small control frames. Buffer sizes are left to the kernel:
    setting SO_SNDBUF/SO_RCVBUF would turn off TCP autotuning, which grows them further."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class LineChannel:
    """Newline-delimited JSON over a local stream socket (worker <-> transfer process).

    After ``start_writer()`` ``send`` never blocks: messages go to a queue that a writer
    thread drains, so a peer that does not read (an idle engine takes no steps and reads
    nothing) cannot stall the sender, nor anything the sender holds a lock for.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self._queue: queue.SimpleQueue[bytes | None] | None = None
        self._writer: threading.Thread | None = None

    def start_writer(self, name: str = "ctrl-writer") -> None:
        self._queue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name=name, daemon=True)
        self._writer.start()

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        if self._queue is None:
            self.sock.sendall(data)
        else:
            self._queue.put(data)

    def close_writer(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (up to ``timeout_s``), then stop the writer."""
        if self._queue is not None and self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout_s)

    def _write_loop(self) -> None:
        assert self._queue is not None
        while (data := self._queue.get()) is not None:
            try:
                self.sock.sendall(data)
            except OSError as exc:
                log.warning("control channel is gone (%s); dropping what is queued", exc)
                return

    def poll(self) -> list[dict[str, Any]]:
        """Messages available now, without blocking (and without touching the socket's
        blocking mode, which the writer thread relies on)."""
        try:
            while True:
                chunk = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
                if not chunk:
                    raise ConnectionClosed("transfer process closed its control channel")
                self._buf += chunk
        except (BlockingIOError, InterruptedError):
            pass
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
