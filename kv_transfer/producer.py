"""Producer side of the transfer process: serves a prefill worker's pinned KV blocks.

Jobs arrive from the worker (``serve``: request id + block ids) one engine step after vLLM
finished the prefill; a decode worker's pull may arrive before that, so a pull waits up to
``register_wait_s`` for its job. Every job ends exactly once, reported to the worker as
``finished`` so the engine unpins the blocks: after a completed pull ("sent"), a failed one
("error"), an explicit release ("released"), or when its lease runs out ("lease"). A job is
never expired while its blocks are being sent.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kv_transfer import compat
from kv_transfer.agent import AgentConfig, Reporter
from kv_transfer.errors import KVTransferError, UnknownRequest
from kv_transfer.wire import (
    ConnectionClosed,
    encode_frame,
    recv_frame,
    send_frame,
    send_views,
    tune,
)

log = logging.getLogger("kv_transfer.producer")

# A release that arrives before its job is remembered this long.
EARLY_RELEASE_TTL_S = 120.0


@dataclass
class Job:
    blocks: list[int]
    deadline: float
    in_flight: bool = False


class Producer:
    def __init__(self, config: AgentConfig, regions: list[memoryview], reporter: Reporter):
        self.config = config
        self.regions = regions
        self.reporter = reporter
        self.jobs: dict[str, Job] = {}
        self.early_releases: dict[str, float] = {}
        self.cond = threading.Condition()
        self.closed = False
        self.listener = socket.create_server((config.bind_host, config.port), backlog=128)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True).start()
        threading.Thread(target=self._lease_loop, name="kv-lease", daemon=True).start()

    # ---- worker side -------------------------------------------------------------------
    def handle(self, message: dict[str, Any]) -> None:
        if message.get("op") != "serve":
            log.warning("unknown control message %r", message.get("op"))
            return
        req, blocks = str(message["req"]), [int(b) for b in message["blocks"]]
        with self.cond:
            if self.early_releases.pop(req, None) is not None:
                self._finish(req, "released")
                return
            self.jobs[req] = Job(blocks, time.monotonic() + self.config.lease_s)
            self.cond.notify_all()

    def close(self) -> None:
        self.closed = True
        self.listener.close()

    def _finish(self, req: str, reason: str, **stats: Any) -> None:
        """Report the job's end; caller holds ``cond``."""
        self.jobs.pop(req, None)
        self.reporter.send({"op": "finished", "req": req, "reason": reason, **stats})

    def _lease_loop(self) -> None:
        while not self.closed:
            time.sleep(0.25)
            now = time.monotonic()
            with self.cond:
                for req, job in list(self.jobs.items()):
                    if not job.in_flight and job.deadline < now:
                        log.warning("lease of %s expired unpulled; unpinning its blocks", req)
                        self._finish(req, "lease")
                for req, t in list(self.early_releases.items()):
                    if t + EARLY_RELEASE_TTL_S < now:
                        del self.early_releases[req]

    # ---- network side ------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()

    def _serve_conn(self, conn: socket.socket) -> None:
        """Serve requests on one connection until the peer closes it (pulls reuse it)."""
        with conn:
            tune(conn)
            try:
                while not self.closed:
                    conn.settimeout(None)  # idle between requests is fine
                    try:
                        request = recv_frame(conn)
                    except ConnectionClosed:
                        return
                    conn.settimeout(self.config.io_timeout_s)
                    self._serve_one(conn, request)
            except (OSError, ValueError) as exc:
                log.warning("transfer connection failed: %s", exc)

    def _serve_one(self, conn: socket.socket, request: dict[str, Any]) -> None:
        op = request.get("op")
        if op == "pull":
            self._serve_pull(conn, request)
        elif op == "release":
            send_frame(conn, {"ok": True, "found": self._release(str(request["req"]))})
        else:
            send_frame(conn, {"ok": False, "error": f"unknown operation {op!r}"})

    def _release(self, req: str) -> bool:
        with self.cond:
            job = self.jobs.get(req)
            if job is None:
                self.early_releases[req] = time.monotonic()
                return False
            if not job.in_flight:
                self._finish(req, "released")
            return True

    def _claim(self, req: str, blocks: list[int]) -> Job:
        """Wait for the job, check the blocks, and mark it in flight."""
        deadline = time.monotonic() + self.config.register_wait_s
        with self.cond:
            while req not in self.jobs:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    raise UnknownRequest(
                        f"prefill worker holds no KV blocks for request {req} "
                        "(unknown, already pulled or released, or its lease expired)"
                    )
                self.cond.wait(left)
            job = self.jobs[req]
            if job.in_flight:
                raise UnknownRequest(f"request {req} is already being pulled")
            missing = Counter(blocks) - Counter(job.blocks)
            if missing:
                raise KVTransferError(f"blocks {sorted(missing)[:5]} are not pinned for {req}")
            job.in_flight = True
            return job

    def _serve_pull(self, conn: socket.socket, request: dict[str, Any]) -> None:
        req, blocks = str(request["req"]), [int(b) for b in request["blocks"]]
        try:
            compat.check(self.config.compat, request.get("compat", {}), who="decode worker")
            self.config.layout.check_blocks(blocks)
            self._claim(req, blocks)
        except (KVTransferError, ValueError) as exc:
            send_frame(conn, {"ok": False, "error": str(exc)})
            if not isinstance(exc, UnknownRequest):
                self._release(req)  # the decode side gives up on it: unpin now
            return
        started, sent, reason = time.perf_counter(), 0, "error"
        try:
            nbytes = len(blocks) * self.config.layout.bytes_per_block
            header = memoryview(encode_frame({"ok": True, "nbytes": nbytes}))
            # One scatter/gather write for header and blocks: the puller wakes up once.
            views = self.config.layout.views(self.regions, blocks)
            sent = send_views(conn, [header, *views]) - len(header)
            reason = "sent" if recv_frame(conn).get("ok") else "error"
        finally:
            seconds = time.perf_counter() - started
            with self.cond:
                self._finish(req, reason, bytes=sent, seconds=seconds, blocks=len(blocks))
