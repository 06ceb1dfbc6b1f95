"""Producer side of the transfer process: serves a prefill worker's pinned KV blocks.

Jobs arrive from the worker (``serve``: request id + block ids) one engine step after vLLM
finished the prefill; a decode worker's pull may arrive before that, so a pull waits up to
``register_wait_s`` for its job. Every job ends exactly once, reported to the worker as
``finished`` so the engine unpins the blocks: after a completed pull ("sent"), a failed one
("error"), an explicit release ("released"), or when its lease runs out ("lease"). A job is
never expired while its blocks are being sent; ``renew`` pushes an unpulled job's lease out.
A job may carry a ``key`` (the prefill worker's own request id, which the engine does not
know): the worker's service releases by that key when the request is aborted, also when the
abort overtakes the job's registration (the release is then applied on arrival).

Only peers that pass the handshake of ``kv_transfer.auth`` may pull, release or renew. Work
for a peer is bounded before and after it has proven itself:

* connections: at most ``max_connections`` are served at once (more are closed at accept); of
  those at most ``max_unauthenticated`` may be in the handshake, and at most
  ``max_unauthenticated_per_address`` from one address: a new one beyond either bound cuts
  off the oldest (``HandshakeGate``), so the rest stay free for authenticated peers and slow
  handshakes cannot keep new ones out;
* time: the whole handshake must be done ``handshake_timeout_s`` after the accept (one
  deadline for all its reads and writes, not a per-read timeout); an authenticated
  connection is closed after ``idle_timeout_s`` without a request, and a request frame must
  arrive within ``io_timeout_s`` of its first byte;
* bytes: every frame is bounded before it is read (``HANDSHAKE_FRAME`` before the handshake,
  then by the KV layout), and a frame that is not a bounded JSON object or a request with
  fields of the wrong type is a refusal, counted and logged at a limited rate
  (``_log_refusal``), before and after the handshake alike: never a traceback.

Nothing blocks while the job lock is held (results go through the non-blocking ``Reporter``).
A job remembers its prompt's digest (from the engine's hand-off) and serves only a pull that
names the same digest, so blocks are never handed out for another prompt, and only a
contiguous run of its blocks, in order (what a decode worker lacks after its own prefix hit).

A job is registered once (``kv_transfer.registry``): its two announcements carry the number
the engine gave it, and a number seen before is a duplicate for the life of the agent. Over
the KV port only announcements signed by this worker's own engine are accepted. A pull that
names the number of a job that has ended, or the epoch of an earlier engine start, fails at
once instead of waiting ``register_wait_s``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kv_transfer import compat
from kv_transfer.agent_context import AgentConfig, Reporter
from kv_transfer.auth import AuthenticationFailed, HandshakeGate, Ticket, server_handshake
from kv_transfer.errors import JobEnded, KVTransferError, PromptMismatch, UnknownRequest
from kv_transfer.integrity import MAC_BYTES, PullMac, Session, job_key, tag_blocks
from kv_transfer.registry import Owner, SeqWindow
from kv_transfer.wire import (
    CONTROL_FRAME,
    ConnectionClosed,
    FrameTooLarge,
    MalformedFrame,
    encode_frame,
    recv_frame,
    send_frame,
    send_views,
    tune,
    wait_readable,
)
from pdserve.runtime.supervise import start_thread

log = logging.getLogger("kv_transfer.producer")

# A release that arrives before its job is remembered this long, and at most this many.
EARLY_RELEASE_TTL_S = 120.0
MAX_EARLY_RELEASES = 4096
# Bytes of one block id in a JSON list, at most ("4294967295,").
_BLOCK_ID_BYTES = 11
# What bad input raises while a request is read and served: a refusal, not a failure.
_MALFORMED = (FrameTooLarge, ValueError, KeyError, TypeError, ArithmeticError)


@dataclass
class Job:
    blocks: list[int]
    deadline: float
    digest: str = ""
    in_flight: bool = False
    key: str = ""
    seq: int | None = None  # the engine's number for the job (None: unnumbered, tests only)
    name: str = ""  # the producer's name for it, unique for all time: its block tags' key
    tags: bytes | None = None  # its blocks' tags (kv_transfer.integrity), once computed
    tagging: threading.Lock = field(default_factory=threading.Lock)
    ended: bool = False


class ForeignAnnouncement(ValueError):
    """A ``serve`` over the KV port that this worker's own engine did not sign."""


class Producer:
    def __init__(
        self,
        config: AgentConfig,
        regions: list[memoryview],
        reporter: Reporter,
        secret: bytes | None = None,
    ):
        self.config = config
        self.regions = regions
        self.reporter = reporter
        self.secret = secret
        self.jobs: dict[str, Job] = {}
        self.keys: dict[str, str] = {}  # job key -> request id
        # Releases that overtook their job, by ("req" | "key", name) -> when they came.
        self.early_releases: dict[tuple[str, str], float] = {}
        self.window = SeqWindow()  # job numbers seen (registered or ended)
        self.owner = Owner()
        self.cond = threading.Condition()
        self.closed = False
        # A pull names at most every block once more than the cache has (duplicates refused).
        self.frame_limit = CONTROL_FRAME + _BLOCK_ID_BYTES * config.layout.num_blocks
        self.slots = threading.BoundedSemaphore(config.max_connections)
        self.gate = HandshakeGate(
            min(config.max_unauthenticated, config.max_connections),
            config.max_unauthenticated_per_address,
        )
        self.refusals = 0
        # Jobs are named "<this process's random name>:<count>" (their tags' keys).
        self.name, self.named = secrets.token_hex(8), itertools.count(1)
        self.to_tag: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.listener = socket.create_server((config.bind_host, config.port), backlog=128)
        self.port = self.listener.getsockname()[1]
        # Both keep no state a crash could corrupt: restarted (pdserve.runtime.supervise).
        start_thread(self._accept_loop, "kv-accept")
        start_thread(self._lease_loop, "kv-lease")
        start_thread(self._tag_loop, "kv-tag")

    # ---- worker side -------------------------------------------------------------------
    def handle(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "owner":
            ok = self.owner.set(str(message["epoch"]), str(message["key"]))
            if not ok:
                log.warning("ignoring a second engine identity from the worker")
            self.reporter.send({"op": "owner", "ok": ok})  # the worker ignores it; tests wait
        elif op == "serve":
            seq = message.get("seq")
            self._register(message, None if seq is None else int(seq), in_order=True)
        else:
            log.warning("unknown control message %r", op)

    def _register(self, message: dict[str, Any], seq: int | None, in_order: bool) -> None:
        """A finished prefill's blocks, pinned from now on. Every job is announced twice: at
        once by the engine's scheduler over the KV port (``announce``) and one engine step
        later by the worker process (``in_order``); whichever comes first registers it, the
        other is a no-op, also after the job ended: its number ``seq`` has been seen."""
        req, blocks = str(message["req"]), [int(b) for b in message["blocks"]]
        digest, key = str(message.get("digest") or ""), str(message.get("key") or "")
        with self.cond:
            if seq is not None and not self.window.add(seq, force=in_order):
                return
            if req in self.jobs:
                return
            early = self.early_releases.pop(("req", req), None)
            if key:
                early = self.early_releases.pop(("key", key), None) or early
            if early is not None:
                self._finish(req, "released")
                return
            deadline = time.monotonic() + self.config.lease_s
            name = f"{self.name}:{next(self.named)}"
            self.jobs[req] = job = Job(blocks, deadline, digest, key=key, seq=seq, name=name)
            self.to_tag.put(job)
            if key:
                self.keys[key] = req
            self.cond.notify_all()

    def close(self) -> None:
        self.closed = True
        self.to_tag.put(None)
        self.listener.close()

    def _tag_loop(self) -> None:
        """Tags each job's blocks as it registers, before its pull comes (nothing waits)."""
        while (job := self.to_tag.get()) is not None:
            if not job.ended:
                self._tags(job)

    def _tags(self, job: Job) -> bytes:
        """The job's block tags: computed once, by the tagging thread or by a pull that
        comes first (the other waits for them)."""
        with job.tagging:
            if job.tags is None:
                views = [v.cast("B") for v in self.config.layout.views(self.regions, job.blocks)]
                key = job_key(self.secret, job.name)
                job.tags = tag_blocks(key, views, len(job.blocks), self.config.layout.layer_bytes)
            return job.tags

    def _finish(self, req: str, reason: str, **stats: Any) -> None:
        """Report the job's end; caller holds ``cond`` (reporting never blocks)."""
        job = self.jobs.pop(req, None)
        if job is not None:
            job.ended = True
            if job.key:
                self.keys.pop(job.key, None)
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
                for name, t in list(self.early_releases.items()):
                    if t + EARLY_RELEASE_TTL_S < now:
                        del self.early_releases[name]

    # ---- network side ------------------------------------------------------------------
    def _accept_loop(self) -> None:
        refused = 0
        while not self.closed:
            try:
                conn, peer = self.listener.accept()
            except OSError:
                if self.closed:
                    return
                raise  # out of file descriptors, say: restarted after a backoff
            if not self.slots.acquire(blocking=False):
                conn.close()  # over the cap: refuse at once rather than queue a thread
                refused += 1
                if refused == 1 or refused % 1000 == 0:
                    log.warning(
                        "KV port has %d connections open; refused %d (latest from %s)",
                        self.config.max_connections,
                        refused,
                        peer[0],
                    )
                continue
            ticket = None
            try:
                ticket = self.gate.enter(conn, str(peer[0]))
                threading.Thread(
                    target=self._serve_conn, args=(conn, peer, ticket), daemon=True
                ).start()
            except BaseException:  # the loop is restarted; this connection is given up
                if ticket is not None:
                    self.gate.leave(ticket)
                self.slots.release()
                conn.close()
                raise

    def _serve_conn(self, conn: socket.socket, peer: Any, ticket: Ticket) -> None:
        """Authenticate the peer, then serve its requests until it closes (pulls reuse it)."""
        try:
            with conn:
                try:
                    tune(conn)
                    deadline = ticket.since + self.config.handshake_timeout_s
                    key = server_handshake(
                        conn, self.secret, deadline, lambda: self.gate.admit(ticket)
                    )
                except (AuthenticationFailed, OSError, ValueError) as exc:  # MalformedFrame too
                    self._log_refusal(peer, self._handshake_failure(ticket, exc))
                    return
                finally:
                    self.gate.leave(ticket)  # before the socket closes (see HandshakeGate)
                self._serve_requests(conn, peer, Session(key))
        finally:
            self.slots.release()

    def _handshake_failure(self, ticket: Ticket, exc: Exception) -> str:
        if ticket.cut:
            return "cut off in the handshake by newer unauthenticated connections"
        if isinstance(exc, TimeoutError):
            return f"no handshake within {self.config.handshake_timeout_s} s"
        return str(exc)

    def _log_refusal(self, peer: Any, reason: object, after_auth: bool = False) -> None:
        """The first refusals and then every 1000th: a flood must not flood the log too."""
        with self.cond:
            self.refusals += 1
            count = self.refusals
        if count <= 10 or count % 1000 == 0:
            who = "an authenticated peer at " if after_auth else ""
            log.warning("refused KV connection #%d from %s%s: %s", count, who, peer[0], reason)

    def _serve_requests(self, conn: socket.socket, peer: Any, session: Session) -> None:
        """Serve requests until the peer closes the connection or leaves it idle for
        ``idle_timeout_s`` (it reconnects when it needs one); bad input is a refusal."""
        try:
            while not self.closed:
                if not wait_readable(conn, self.config.idle_timeout_s):
                    log.debug("closing the idle KV connection from %s", peer[0])
                    return
                try:
                    deadline = time.monotonic() + self.config.io_timeout_s
                    request = recv_frame(conn, self.frame_limit, deadline)
                except ConnectionClosed:
                    return
                conn.settimeout(self.config.io_timeout_s)
                self._serve_one(conn, request, session)
        except _MALFORMED as exc:  # before OSError: FrameTooLarge and MalformedFrame are both
            self._log_refusal(peer, exc, after_auth=True)
        except OSError as exc:
            log.warning("transfer connection failed: %s", exc)

    def _serve_one(self, conn: socket.socket, request: dict[str, Any], session: Session) -> None:
        """One request of an authenticated peer; fields of the wrong type raise MalformedFrame."""
        op = request.get("op")
        if op == "pull":
            self._serve_pull(conn, request, session)
        elif op == "release":
            by = "key" if "key" in request else "req"
            send_frame(conn, {"ok": True, "found": self._release(_text(request, by), by)})
        elif op == "renew":
            send_frame(conn, {"ok": True, "found": self._renew(_text(request, "req"))})
        elif op == "serve":  # from this worker's own engine scheduler; no answer
            self._serve_announced(request)
        elif isinstance(op, str):
            send_frame(conn, {"ok": False, "error": f"unknown operation {op[:64]!r}"})
        else:
            raise MalformedFrame("the request names no operation")

    def _serve_announced(self, request: dict[str, Any]) -> None:
        """A job announced over the KV port: registered only when this worker's engine
        signed it (a refusal closes the connection); before the engine's key has arrived it
        is left to the step path."""
        blocks, seq = _block_ids(request), request.get("seq")
        self.config.layout.check_blocks(blocks)
        if type(seq) is not int or seq < 1:
            raise MalformedFrame("'seq' must be a positive integer")
        signed = self.owner.signed(request)
        if signed is None:
            log.debug("announcement of %s before the engine's key; left to the step path", seq)
            return
        if not signed:
            raise ForeignAnnouncement("a job announcement not signed by this worker's engine")
        job = {
            "req": _text(request, "req"),
            "blocks": blocks,
            "digest": _text(request, "digest", ""),
            "key": _text(request, "key", ""),
        }
        self._register(job, seq, in_order=False)

    def _release(self, name: str, by: str = "req") -> bool:
        """Unpin the job of request id (``by="req"``) or key (``by="key"``) ``name`` unless it
        is being pulled; unknown yet: unpin it when it registers. True if it was held."""
        with self.cond:
            req = self.keys.get(name, "") if by == "key" else name
            job = self.jobs.get(req)
            if job is None:
                self._remember_early_release((by, name))
                return False
            if not job.in_flight:
                self._finish(req, "released")
            return True

    def _remember_early_release(self, name: tuple[str, str]) -> None:
        """Caller holds ``cond``. Bounded: the oldest is forgotten first (its lease still
        unpins the blocks, later)."""
        self.early_releases.pop(name, None)
        self.early_releases[name] = time.monotonic()
        while len(self.early_releases) > MAX_EARLY_RELEASES:
            del self.early_releases[next(iter(self.early_releases))]

    def _renew(self, req: str) -> bool:
        """Push an unpulled job's lease out to ``lease_s`` from now; False if there is none."""
        with self.cond:
            job = self.jobs.get(req)
            if job is None:
                return False
            job.deadline = max(job.deadline, time.monotonic() + self.config.lease_s)
            return True

    def _claim(
        self, req: str, blocks: list[int], digest: str, seq: int | None = None, epoch: str = ""
    ) -> Job:
        """Wait for the job (not for one that has ended), check the blocks, mark it in flight."""
        deadline = time.monotonic() + self.config.register_wait_s
        with self.cond:
            if epoch and self.owner.epoch and epoch != self.owner.epoch:
                raise JobEnded(
                    f"the hand-off of request {req} is from an earlier start of this prefill "
                    "worker (epochs differ): its KV blocks are gone"
                )
            while (job := self.jobs.get(req)) is None or seq not in (None, job.seq):
                if seq is not None and self.window.seen(seq):
                    raise JobEnded(
                        f"the KV blocks of request {req} are no longer held by this prefill "
                        "worker (already pulled or released, or its lease expired)"
                    )
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    raise UnknownRequest(
                        f"prefill worker holds no KV blocks for request {req} "
                        "(unknown, already pulled or released, or its lease expired)"
                    )
                self.cond.wait(left)
            if job.in_flight:
                raise UnknownRequest(f"request {req} is already being pulled")
            if job.digest and digest != job.digest:
                raise PromptMismatch(
                    f"request {req} on this prefill worker is for another prompt than the "
                    "decode worker's (prompt digests differ)"
                )
            if not _is_run(job.blocks, blocks):
                raise KVTransferError(
                    f"a pull must name a contiguous run of the {len(job.blocks)} blocks pinned "
                    f"for {req}, in order; blocks {blocks[:5]}... are not one"
                )
            job.in_flight = True
            return job

    def _serve_pull(self, conn: socket.socket, request: dict[str, Any], session: Session) -> None:
        req, blocks = _text(request, "req"), _block_ids(request)
        digest, theirs = _text(request, "digest", ""), request.get("compat", {})
        seq, epoch = request.get("seq"), _text(request, "epoch", "")
        if seq is not None and type(seq) is not int:
            raise MalformedFrame("'seq' must be an integer")
        if not isinstance(theirs, dict) or not all(isinstance(v, str) for v in theirs.values()):
            raise MalformedFrame("'compat' must be an object of strings")
        try:
            compat.check(self.config.compat, theirs, who="decode worker")
            self.config.layout.check_blocks(blocks)
            job = self._claim(req, blocks, digest, seq, epoch)
        except (KVTransferError, ValueError) as exc:
            send_frame(conn, {"ok": False, "error": str(exc)})
            if not isinstance(exc, UnknownRequest | PromptMismatch):
                self._release(req)  # the decode side gives up on it: unpin now
            return
        started, sent, reason = time.perf_counter(), 0, "error"
        try:
            nbytes = len(blocks) * self.config.layout.bytes_per_block
            first = job.blocks.index(blocks[0]) if blocks else 0
            header = encode_frame(
                {"ok": True, "nbytes": nbytes, "req": req, "job": job.name, "first": first}
            )
            views = self.config.layout.views(self.regions, blocks)  # send_views casts them
            # One scatter/gather write for header and blocks: the puller wakes up once. Then
            # the blocks' tags (kv_transfer.integrity: computed when the job registered) and
            # the pull's MAC over header and tags.
            sent = send_views(conn, [memoryview(header), *views]) - len(header)
            tags = self._tags(job)[first * MAC_BYTES : (first + len(blocks)) * MAC_BYTES]
            mac = PullMac(session.key, session.pulls, header)
            session.pulls += 1
            mac.update(tags)
            conn.sendall(tags + mac.digest())
            ack = recv_frame(conn, CONTROL_FRAME, time.monotonic() + self.config.io_timeout_s)
            reason = "sent" if ack.get("ok") else "error"
        finally:
            seconds = time.perf_counter() - started
            with self.cond:
                self._finish(req, reason, bytes=sent, seconds=seconds, blocks=len(blocks))


def _text(request: dict[str, Any], name: str, default: str | None = None) -> str:
    """A string field; an optional one (``default``) may also be absent or null."""
    value = request.get(name)
    if value is None and default is not None:
        return default
    if not isinstance(value, str):
        raise MalformedFrame(f"{name!r} must be a string")
    return value


def _is_run(pinned: list[int], blocks: list[int]) -> bool:
    """True if ``blocks`` is a non-empty contiguous slice of ``pinned``, in the same order."""
    n = len(blocks)
    if not n:
        return False
    starts = (i for i, b in enumerate(pinned[: len(pinned) - n + 1]) if b == blocks[0])
    return any(pinned[i : i + n] == blocks for i in starts)


def _block_ids(request: dict[str, Any]) -> list[int]:
    blocks = request.get("blocks")
    if not isinstance(blocks, list) or not all(type(b) is int for b in blocks):
        raise MalformedFrame("'blocks' must be a list of integers")
    return blocks
