"""Framing on the transfer sockets: length-prefixed JSON control frames and raw byte runs.

Control frames are small (job descriptions, acknowledgements). KV bytes never go through
JSON: they are written from and read into memoryviews of the mapped KV cache directly.

Every frame read from the network is bounded by its reader before anything is allocated:
``HANDSHAKE_FRAME`` until the peer is authenticated, ``CONTROL_FRAME`` for answers, and for
a pull request a bound derived from the KV layout (its block list), never more than
``MAX_FRAME``. A reader may also give a whole frame a deadline (``deadline``, monotonic
seconds): each ``recv`` then waits only for the time left, so a peer that sends a byte now
and then cannot stretch a frame past it. A frame body that is not a JSON object nested at
most ``MAX_DEPTH`` deep (bad UTF-8, bad JSON, NaN, nesting, another type) is refused with
``MalformedFrame``, never by an error from deep inside the parser.
"""

from __future__ import annotations

import json
import logging
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from pdserve.runtime.supervise import start_thread

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
HANDSHAKE_FRAME = 1024
CONTROL_FRAME = 64 * 1024
MAX_FRAME = 16 * 1024 * 1024
# Containers nested in a control frame, at most (ours nest two deep: a pull's "compat").
MAX_DEPTH = 8


class ConnectionClosed(ConnectionError):
    pass


class FrameTooLarge(ConnectionError):
    """The peer announced a frame larger than the reader allows."""


class MalformedFrame(ConnectionError, ValueError):
    """A frame body that is not a JSON object of bounded depth (or a request with fields of
    the wrong type). Both a ``ConnectionError`` (the connection is not usable after it) and a
    ``ValueError`` (the peer sent bad input), so the handlers of either catch it."""


def encode_frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


def send_frame(sock: socket.socket, message: dict[str, Any], deadline: float | None = None) -> None:
    """Write one frame (by ``deadline`` when given). Raises ConnectionClosed at once, without
    writing, when the peer has already closed the connection (a kept connection it closed as
    idle), so that a writer reconnects instead of losing the frame."""
    if peer_closed(sock):
        raise ConnectionClosed("the peer has closed the connection")
    if deadline is not None:
        _wait_at_most(sock, deadline)
    sock.sendall(encode_frame(message))


def recv_frame(
    sock: socket.socket, limit: int = CONTROL_FRAME, deadline: float | None = None
) -> dict[str, Any]:
    """The next control frame; a frame announced larger than ``limit`` is refused unread.
    With ``deadline`` the whole frame must have arrived by then (else TimeoutError)."""
    header = recv_exact(sock, _LEN.size, deadline)
    (size,) = _LEN.unpack(header)
    if size > min(limit, MAX_FRAME):
        raise FrameTooLarge(f"control frame of {size} bytes is larger than {min(limit, MAX_FRAME)}")
    return decode_frame(recv_exact(sock, size, deadline))


def decode_frame(body: bytes) -> dict[str, Any]:
    """A frame body as a JSON object, or MalformedFrame (the parser's own errors, recursion
    included, never escape: they would end the connection's thread with a traceback)."""
    try:
        message = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise MalformedFrame(f"control frame nests deeper than {MAX_DEPTH}") from None
    except ValueError as exc:  # bad UTF-8 or bad JSON; the message names no content
        raise MalformedFrame(f"control frame is not valid JSON: {exc}") from None
    if not isinstance(message, dict):
        raise MalformedFrame("control frame is not a JSON object")
    # Counting brackets is fast and almost always settles it; walk the object only if not.
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and _depth(message) > MAX_DEPTH:
        raise MalformedFrame(f"control frame nests deeper than {MAX_DEPTH}")
    return message


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _depth(value: Any) -> int:
    """How deep containers nest in a decoded JSON value (iterative: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return depth
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest


def recv_exact(sock: socket.socket, size: int, deadline: float | None = None) -> bytes:
    buf = bytearray(size)
    recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` completely from ``sock`` (recv_into releases the GIL while it waits).
    With ``deadline`` (monotonic seconds) each wait is cut to the time left: the whole read
    ends by then (TimeoutError), however the peer spaces its bytes out. The socket's timeout
    is left changed; callers set their own before the next operation."""
    got, size = 0, len(view)
    while got < size:
        if deadline is not None:
            _wait_at_most(sock, deadline)
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionClosed(f"peer closed the connection after {got} of {size} bytes")
        got += n


def _wait_at_most(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline for this exchange has passed")
    sock.settimeout(left)


def wait_readable(sock: socket.socket, timeout_s: float) -> bool:
    """Wait until the peer sends something or closes; False when ``timeout_s`` passed first."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))


def peer_closed(sock: socket.socket) -> bool:
    """True when the peer has closed (or reset) the connection; never waits."""
    if sock.fileno() < 0:  # closed on this side
        return True
    if not wait_readable(sock, 0):
        return False
    try:  # readable: the peek returns at once
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


# Buffers per sendmsg/recvmsg_into call (Linux IOV_MAX is 1024).
MAX_IOV = 512


def send_views(sock: socket.socket, views: Iterable[memoryview]) -> int:
    """Send the views in order with scatter/gather writes; returns the bytes sent."""
    pending = Pending(views)
    total = 0
    while pending:
        sent = sock.sendmsg(pending.next())
        total += sent
        pending.drop(sent)
    return total


def recv_views(
    sock: socket.socket,
    views: Iterable[memoryview],
    progress: Callable[[int], None] | None = None,
) -> int:
    """Fill the views in order with scatter/gather reads; returns the bytes received.
    ``progress(n)``, when given, is told after each read that ``n`` bytes are in."""
    pending = Pending(views)
    total = 0
    while pending:
        got = sock.recvmsg_into(pending.next())[0]
        if got == 0:
            raise ConnectionClosed(f"peer closed the connection after {total} bytes")
        total += got
        pending.drop(got)
        if progress is not None:
            progress(total)
    return total


class Pending:
    """Views still to move, taken from the front: a socket call's buffers are the next
    ``MAX_IOV`` of them, and moved bytes are dropped without copying the rest of the list."""

    def __init__(self, views: Iterable[memoryview]) -> None:
        self.views = [v.cast("B") for v in views if len(v)]
        self.index = 0

    def __bool__(self) -> bool:
        return self.index < len(self.views)

    def next(self) -> list[memoryview]:
        return self.views[self.index : self.index + MAX_IOV]

    def drop(self, nbytes: int) -> None:
        """Drop the first ``nbytes`` (at most what is left)."""
        views = self.views
        while nbytes and self.index < len(views):
            first = views[self.index]
            if nbytes < len(first):
                views[self.index] = first[nbytes:]
                return
            nbytes -= len(first)
            self.index += 1


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
        # A writer that failed mid-message left the stream unreadable: it cannot be restarted,
        # the process goes down loudly instead (pdserve.runtime.supervise).
        self._writer = start_thread(self._write_loop, name, restart=False)

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
