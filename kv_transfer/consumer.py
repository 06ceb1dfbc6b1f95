"""Consumer side of the transfer process: pulls KV blocks into a decode worker's cache.

For each ``pull`` job from the worker it connects to the prefill worker's agent, sends the
request id, the remote block ids and its compatibility description, receives the blocks'
bytes straight into the mapped memory of its own (already allocated) blocks, acknowledges,
and reports ``done`` with ``ok``, the bytes, the seconds and when it started (epoch seconds,
for the decode worker's trace span of the pull). Every job is reported exactly once, failed
or not, because the engine frees the destination blocks only then.

Pulls and releases reuse connections (``PeerConnections``): at most ``max_peer_connections``
to one prefill agent, in use and kept idle together. A kept connection the prefill agent has
closed meanwhile (its ``idle_timeout_s``, or a restart) is replaced by a new one: when that
is seen before the request is sent, or when the request goes unanswered, once. A new
connection (TCP connect and handshake) gets ``connect_timeout_s``, not ``io_timeout_s``: an
unreachable prefill agent fails its pulls within seconds.

Jobs wait in their prefill agent's own queue (``PeerLanes``), each agent with its own workers
(``max_parallel``, at most ``max_peer_connections``): pulls from an unreachable or silent
prefill agent never delay those from the others. A pull cancelled while still queued is
reported failed at once and never connects; one cancelled while connecting or transferring
is cut (its connection shut down) and reported when its worker sees that.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from kv_transfer.agent_context import AgentConfig, Reporter
from kv_transfer.auth import connect_keyed
from kv_transfer.errors import KVTransferError
from kv_transfer.integrity import MAC_BYTES, BlockTags, PullMac, Session, check, job_key
from kv_transfer.peer_lanes import PeerLanes
from kv_transfer.wire import (
    ConnectionClosed,
    encode_frame,
    peer_closed,
    recv_exact,
    recv_frame,
    recv_views,
    send_frame,
    tune,
)

log = logging.getLogger("kv_transfer.consumer")

Peer = tuple[str, int]
T = TypeVar("T")
# The connection died before any answer: the request may be sent again on a new one.
_UNANSWERED = (ConnectionClosed, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


class Unanswered(ConnectionError):
    """The connection failed before the peer answered the request (nothing was received)."""


class PeerConnections:
    """Connections to producer agents: at most ``per_peer`` to one peer, counting those in use
    and those kept idle for reuse; a caller past that waits (up to its timeout) for one to be
    given back or dropped. Every connection taken is given back (``give``) or dropped."""

    def __init__(self, per_peer: int, open_one: Callable[[Peer], socket.socket]) -> None:
        self.per_peer = max(1, per_peer)
        self.open_one = open_one
        self.cond = threading.Condition()
        self.idle: dict[Peer, list[socket.socket]] = {}
        self.held: Counter[Peer] = Counter()  # in use + idle, per peer
        self.closed = False

    def take(self, peer: Peer, timeout_s: float, fresh: bool = False) -> tuple[socket.socket, bool]:
        """A kept connection (True: it may still die on first use) or a new one (False);
        ``fresh``: a new one. Kept ones the peer has visibly closed are dropped on the way."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                idle = self.idle.get(peer, [])
                if fresh and idle and self.held[peer] >= self.per_peer:
                    idle.pop(0).close()  # make room for the new one
                    self._release_slot(peer)
                while idle and not fresh:
                    conn = idle.pop()
                    if not peer_closed(conn):
                        return conn, True
                    conn.close()  # the peer closed it (idle timeout, restart)
                    self._release_slot(peer)
                if self.held[peer] < self.per_peer:
                    self.held[peer] += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVTransferError(
                        f"all {self.per_peer} connections to {peer[0]}:{peer[1]} stayed busy "
                        f"for {timeout_s} s"
                    )
                self.cond.wait(left)
        try:
            return self.open_one(peer), False
        except BaseException:
            self.drop(peer, None)
            raise

    def give(self, peer: Peer, conn: socket.socket) -> None:
        """Keep ``conn`` for the next request to ``peer``."""
        with self.cond:
            if not self.closed:
                self.idle.setdefault(peer, []).append(conn)
                self.cond.notify_all()
                return
        self.drop(peer, conn)

    def drop(self, peer: Peer, conn: socket.socket | None) -> None:
        """Close a taken connection (None: one that was never opened) and free its slot."""
        if conn is not None:
            conn.close()
        with self.cond:
            self._release_slot(peer)

    def forget(self, peer: Peer) -> None:
        """Close every kept connection to ``peer`` (one was found dead: the peer restarted)."""
        with self.cond:
            conns = self.idle.pop(peer, [])
            for _ in conns:
                self._release_slot(peer)
        for conn in conns:
            conn.close()

    def count(self, peer: Peer) -> int:
        with self.cond:
            return self.held[peer]

    def close(self) -> None:
        with self.cond:
            self.closed = True
            peers = list(self.idle)
        for peer in peers:
            self.forget(peer)

    def _release_slot(self, peer: Peer) -> None:
        """Caller holds ``cond``."""
        self.held[peer] -= 1
        if self.held[peer] <= 0:
            del self.held[peer]
        self.cond.notify_all()


class Consumer:
    def __init__(
        self,
        config: AgentConfig,
        regions: list[memoryview],
        reporter: Reporter,
        secret: bytes | None = None,
    ):
        self.config = config
        self.secret = secret
        self.regions = regions
        self.reporter = reporter
        self.port = 0
        # Each prefill agent's jobs run on its own workers, no more than its connections.
        self.lanes = PeerLanes(min(config.max_parallel, config.max_peer_connections))
        self.conns = PeerConnections(config.max_peer_connections, self._open)
        self.queued: dict[str, dict[str, Any]] = {}  # pulls not started yet, by request
        self.active: dict[str, socket.socket | None] = {}  # started (None: no connection yet)
        self.cancelled: set[str] = set()  # active pulls cancelled (never retried)
        self.lock = threading.Lock()
        # Each open connection's key and pulls so far (kv_transfer.integrity).
        self.sessions: weakref.WeakKeyDictionary[socket.socket, Session] = (
            weakref.WeakKeyDictionary()
        )

    def handle(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op in ("pull", "release"):
            try:
                peer = _peer(message)
            except (KeyError, TypeError, ValueError) as exc:
                if op == "pull" and "req" in message:
                    self._report_unstarted(message, f"KV pull names no prefill agent: {exc!r}")
                else:
                    log.warning("%s names no prefill agent: %r", op, exc)
                return
            if op == "pull":
                self._queue_pull(peer, message)
            else:
                self.lanes.submit(peer, lambda: self._release_job(message))
        elif op == "cancel":
            self._cancel(str(message["req"]))
        else:
            log.warning("unknown control message %r", op)

    def close(self) -> None:
        self.lanes.close()
        self.conns.close()

    def _queue_pull(self, peer: Peer, job: dict[str, Any]) -> None:
        req = str(job["req"])
        with self.lock:
            duplicate = req in self.queued or req in self.active
            if not duplicate:
                self.queued[req] = job
        if duplicate:  # jobs exist once (numbered at the engine): refuse, never drop silently
            self._report_unstarted(job, f"KV pull of {req} is already queued or running")
            return
        self.lanes.submit(peer, lambda: self._start_pull(job))

    def _start_pull(self, job: dict[str, Any]) -> None:
        req = str(job["req"])
        with self.lock:
            if self.queued.get(req) is not job:
                return  # cancelled while queued, and reported then
            del self.queued[req]
            self.active[req] = None  # started: a cancel now is seen once it has a connection
        self._pull_job(job)

    def _report_unstarted(self, job: dict[str, Any], error: str) -> None:
        log.warning("%s", error)
        self.reporter.send(
            {
                "op": "done",
                "req": str(job["req"]),
                "ok": False,
                "started": time.time(),
                "error": error,
                "seconds": 0.0,
                "blocks": len(job.get("local_blocks") or ()),
            }
        )

    def _open(self, peer: Peer) -> socket.socket:
        timeout_s = self.config.connect_timeout_s
        try:
            conn, key = connect_keyed(peer[0], peer[1], self.secret, timeout_s)
        except TimeoutError as exc:
            raise KVTransferError(
                f"no connection within connect_timeout_s ({timeout_s} s): {exc}"
            ) from exc
        tune(conn)
        with self.lock:
            self.sessions[conn] = Session(key)
        return conn

    def _on_connection(
        self, peer: Peer, req: str | None, work: Callable[[socket.socket], T]
    ) -> tuple[socket.socket, T]:
        """Run ``work`` on a kept or new connection to ``peer``; the connection is then the
        caller's to give back or drop (on an error it is dropped here). When a kept one goes
        unanswered (``Unanswered``: the peer closed it as idle, or restarted, and the others
        with it), ``work`` runs once more on a new one, unless ``req`` was cancelled."""
        conn, reused = self.conns.take(peer, self.config.connect_timeout_s)
        while True:
            if req is not None:
                with self.lock:
                    cancelled = req in self.cancelled
                    self.active[req] = conn
                if cancelled:  # while it connected: nothing was sent on ``conn``
                    self.conns.give(peer, conn)
                    raise KVTransferError("cancelled")
            try:
                return conn, work(conn)
            except Unanswered:
                self.conns.drop(peer, conn)
                with self.lock:
                    if not reused or req in self.cancelled:
                        raise
                log.info("kept connection to %s:%s was closed; reconnecting", *peer)
                self.conns.forget(peer)
                conn, reused = self.conns.take(peer, self.config.connect_timeout_s, fresh=True)
            except BaseException:
                self.conns.drop(peer, conn)
                raise

    def _cancel(self, req: str) -> None:
        with self.lock:
            queued = self.queued.pop(req, None)
            conn = self.active.get(req)
            if req in self.active:
                self.cancelled.add(req)
        if queued is not None:
            self._report_unstarted(queued, f"KV pull of {req} cancelled before it started")
        elif conn is not None:
            log.info("cancelling the pull of %s", req)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _release_job(self, job: dict[str, Any]) -> None:
        """Unpin a request's blocks on the prefill agent, over a kept connection too."""
        peer, remote = _peer(job), str(job["remote_req"])
        try:
            conn, _ = self._on_connection(peer, None, lambda c: self._release(c, remote))
            self.conns.give(peer, conn)
        except (OSError, ValueError, KVTransferError) as exc:
            log.warning("could not release %s on %s:%s: %s", remote, *peer, exc)

    def _release(self, conn: socket.socket, remote_req: str) -> bool:
        conn.settimeout(self.config.io_timeout_s)
        try:
            send_frame(conn, {"op": "release", "req": remote_req})
            return bool(recv_frame(conn).get("found"))
        except _UNANSWERED as exc:
            raise Unanswered(f"the peer closed the connection before answering: {exc}") from exc

    def _pull_job(self, job: dict[str, Any]) -> None:
        req = str(job["req"])
        started = time.perf_counter()
        result: dict[str, Any] = {"op": "done", "req": req, "ok": False, "started": time.time()}
        peer = _peer(job)
        conn = None
        try:
            conn, result["bytes"] = self._on_connection(peer, req, lambda c: self._pull(c, job))
            result["ok"] = True
        except (OSError, ValueError, KVTransferError) as exc:
            result["error"] = f"KV pull from {peer[0]}:{peer[1]} failed: {exc}"
            log.warning("%s", result["error"])
        finally:
            with self.lock:
                self.active.pop(req, None)
                self.cancelled.discard(req)
            result["seconds"] = time.perf_counter() - started
            result["blocks"] = len(job["local_blocks"])
            # The bytes are in the cache: report first, then let the producer unpin.
            self.reporter.send(result)
        if conn is not None:
            self._acknowledge(peer, conn)

    def _acknowledge(self, peer: Peer, conn: socket.socket) -> None:
        """After a pull that succeeded (a failed one's connection is closed: the producer
        then unpins the blocks)."""
        try:
            send_frame(conn, {"op": "ack", "ok": True})
        except OSError:
            self.conns.drop(peer, conn)
            return
        self.conns.give(peer, conn)

    def _pull(self, conn: socket.socket, job: dict[str, Any]) -> int:
        layout = self.config.layout
        local = [int(b) for b in job["local_blocks"]]
        remote = [int(b) for b in job["remote_blocks"]]
        if len(local) != len(remote):
            raise ValueError(f"{len(remote)} remote blocks for {len(local)} local blocks")
        layout.check_blocks(local)
        expected = len(local) * layout.bytes_per_block
        conn.settimeout(self.config.io_timeout_s)
        request = {
            "op": "pull",
            "req": job["remote_req"],
            "blocks": remote,
            "digest": job.get("digest", ""),
            "epoch": job.get("epoch") or "",
            "seq": job.get("seq"),
        }
        try:
            send_frame(conn, {**request, "compat": self.config.compat})
            header = recv_frame(conn)  # bounded: an answer, never more than CONTROL_FRAME
        except _UNANSWERED as exc:  # closed before any answer
            raise Unanswered(f"the peer closed the connection before answering: {exc}") from exc
        if not header.get("ok"):
            raise KVTransferError(str(header.get("error", "refused")))
        if int(header["nbytes"]) != expected or header.get("req") != job["remote_req"]:
            raise KVTransferError(
                f"peer offers {header['nbytes']} bytes of {header.get('req')!r}, want "
                f"{expected} of {job['remote_req']!r}"
            )
        views = [v.cast("B") for v in layout.views(self.regions, local)]
        return self._receive(conn, header, views, len(local))

    def _receive(
        self, conn: socket.socket, header: dict[str, Any], views: list[memoryview], count: int
    ) -> int:
        """The ``count`` blocks into ``views``, their tags computed as they arrive, then the
        producer's tags and the pull's MAC (kv_transfer.integrity); raises ``IntegrityError``
        (a failed pull) unless both agree."""
        name, first = header.get("job"), header.get("first")
        if not isinstance(name, str) or not name or len(name) > 128:
            raise KVTransferError("the prefill worker's answer names no job to check its KV by")
        if type(first) is not int or first < 0:
            raise KVTransferError("the prefill worker's answer has no valid 'first' block")
        with self.lock:
            session = self.sessions[conn]
        mac = PullMac(session.key, session.pulls, encode_frame(header))
        session.pulls += 1
        key = job_key(self.secret, name)
        tags = BlockTags(key, first, count, self.config.layout.layer_bytes)
        got = recv_views(conn, views, tags.tracker(views).advance)
        trailer = recv_exact(conn, (count + 1) * MAC_BYTES)
        mac.update(trailer[:-MAC_BYTES])
        check(mac.digest(), trailer[-MAC_BYTES:])
        check(tags.tags(), trailer[:-MAC_BYTES])
        return got


def _peer(job: dict[str, Any]) -> Peer:
    return str(job["host"]), int(job["port"])
