"""Consumer side of the transfer process: pulls KV blocks into a decode worker's cache.

For each ``pull`` job from the worker it connects to the prefill worker's agent, sends the
request id, the remote block ids and its compatibility description, receives the blocks'
bytes straight into the mapped memory of its own (already allocated) blocks, acknowledges,
and reports ``done`` with ``ok``, the bytes, the seconds and when it started (epoch seconds,
for the decode worker's trace span of the pull). Every job is reported exactly once, failed
or not, because the engine frees the destination blocks only then.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kv_transfer.agent_context import AgentConfig, Reporter
from kv_transfer.auth import connect
from kv_transfer.client import release
from kv_transfer.errors import KVTransferError
from kv_transfer.wire import recv_frame, recv_views, send_frame, tune

log = logging.getLogger("kv_transfer.consumer")


class Unanswered(ConnectionError):
    """The connection failed before the peer answered the pull (nothing was received)."""


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
        self.pool = ThreadPoolExecutor(config.max_parallel, thread_name_prefix="kv-pull")
        self.active: dict[str, socket.socket] = {}
        self.cancelled: set[str] = set()  # active pulls cancelled (never retried)
        self.idle: dict[tuple[str, int], list[socket.socket]] = {}
        self.lock = threading.Lock()

    def handle(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "pull":
            self.pool.submit(self._pull_job, message)
        elif op == "release":
            self.pool.submit(self._release_job, message)
        elif op == "cancel":
            self._cancel(str(message["req"]))
        else:
            log.warning("unknown control message %r", op)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            for conns in self.idle.values():
                for conn in conns:
                    conn.close()
            self.idle.clear()

    def _connect(self, peer: tuple[str, int], reuse: bool = True) -> tuple[socket.socket, bool]:
        """An idle connection to the peer (pulls reuse connections) or a new one; True when
        it is a kept one, which may have died with the peer meanwhile."""
        with self.lock:
            conns = self.idle.get(peer)
            if conns and reuse:
                return conns.pop(), True
        conn = connect(peer[0], peer[1], self.secret, self.config.io_timeout_s)
        tune(conn)
        return conn, False

    def _forget(self, peer: tuple[str, int]) -> None:
        """Close every kept connection to ``peer`` (one of them was found dead: the peer
        restarted, and the others are dead too)."""
        with self.lock:
            conns = self.idle.pop(peer, [])
        for conn in conns:
            conn.close()

    def _keep(self, peer: tuple[str, int], conn: socket.socket) -> None:
        with self.lock:
            self.idle.setdefault(peer, []).append(conn)

    def _cancel(self, req: str) -> None:
        with self.lock:
            conn = self.active.get(req)
            if conn is not None:
                self.cancelled.add(req)
        if conn is not None:
            log.info("cancelling the pull of %s", req)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _release_job(self, job: dict[str, Any]) -> None:
        try:
            release(job["host"], int(job["port"]), str(job["remote_req"]), secret=self.secret)
        except (OSError, KVTransferError) as exc:
            log.warning(
                "could not release %s on %s:%s: %s",
                job["remote_req"],
                job["host"],
                job["port"],
                exc,
            )

    def _pull_job(self, job: dict[str, Any]) -> None:
        req = str(job["req"])
        started = time.perf_counter()
        result: dict[str, Any] = {"op": "done", "req": req, "ok": False, "started": time.time()}
        peer = (str(job["host"]), int(job["port"]))
        conn = None
        try:
            conn, reused = self._connect(peer)
            with self.lock:
                self.active[req] = conn
            try:
                result["bytes"] = self._pull(conn, job)
            except Unanswered:
                with self.lock:
                    if not reused or req in self.cancelled:
                        raise
                # A kept connection whose peer restarted: try once on a fresh one.
                log.info("kept connection to %s:%s is dead; reconnecting", *peer)
                conn.close()
                self._forget(peer)
                conn, _ = self._connect(peer, reuse=False)
                with self.lock:
                    self.active[req] = conn
                result["bytes"] = self._pull(conn, job)
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
            self._acknowledge(peer, conn, ok=result["ok"])

    def _acknowledge(self, peer: tuple[str, int], conn: socket.socket, ok: bool) -> None:
        if not ok:
            conn.close()  # the producer unpins when the connection drops
            return
        try:
            send_frame(conn, {"op": "ack", "ok": True})
        except OSError:
            conn.close()
            return
        self._keep(peer, conn)

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
        }
        try:
            send_frame(conn, {**request, "compat": self.config.compat})
            header = recv_frame(conn)  # bounded: an answer, never more than CONTROL_FRAME
        except (ConnectionError, BrokenPipeError) as exc:  # closed before any answer
            raise Unanswered(f"the peer closed the connection before answering: {exc}") from exc
        if not header.get("ok"):
            raise KVTransferError(str(header.get("error", "refused")))
        if int(header["nbytes"]) != expected:
            raise KVTransferError(f"peer offers {header['nbytes']} bytes, want {expected}")
        return recv_views(conn, layout.views(self.regions, local))
