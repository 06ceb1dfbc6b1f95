"""Work a peer of the KV port can cause before (and after) it authenticates is bounded in time,
bytes and connection slots; many honest decode workers are still served.

The producer is always a real transfer process (``kv_transfer.agent``) over a memfd region;
pulls go through real consumer agents, except in the 64-consumer test (see there).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from kv_transfer import bench
from kv_transfer.agent_context import AgentConfig, Reporter
from kv_transfer.announce import Announcer
from kv_transfer.auth import connect, load_secret, new_secret
from kv_transfer.consumer import Consumer
from kv_transfer.handle import AgentHandle
from kv_transfer.scheduler import new_owner
from kv_transfer.wire import LineChannel, recv_frame, send_frame
from tests.helpers import wait_pinned

GEO = bench.Geometry(blocks=4, block_bytes=4096)


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_text(new_secret() + "\n")
    path.chmod(0o600)
    return path


class Region:
    """A memfd region of ``blocks`` blocks laid out as the CPU KV cache (see ``bench``)."""

    def __init__(self, blocks: int, seed: int) -> None:
        self.fd, self.memory, self.layout = bench.make_region(GEO, blocks, seed)

    def digest(self, blocks: list[int]) -> str:
        return bench.blocks_digest(self.memory, self.layout, blocks)

    def close(self) -> None:
        os.close(self.fd)


class Stand:
    """One producer agent and any number of consumer agents, all with the same secret."""

    def __init__(self, secret_file: Path, stderr: Path | None = None, **producer: Any) -> None:
        self.secret_file = secret_file
        self.secret = load_secret(secret_file)
        self.p_region = Region(16, seed=1)
        self.regions: list[Region] = [self.p_region]
        self.agents: list[AgentHandle] = []
        with stderr_into(stderr):
            self.producer = self._start("producer", self.p_region, **producer)
        self.port = self.producer.port

    def _start(self, role: str, region: Region, **settings: Any) -> AgentHandle:
        agent = bench.start_agent(
            role, region.fd, region.layout, secret_file=str(self.secret_file), **settings
        )
        self.agents.append(agent)
        return agent

    def consumer(self, **settings: Any) -> tuple[AgentHandle, Region]:
        region = Region(8, seed=len(self.regions) + 1)
        self.regions.append(region)
        return self._start("consumer", region, **settings), region

    def serve(self, req: str, blocks: list[int]) -> None:
        self.producer.channel.send({"op": "serve", "req": req, "blocks": blocks})

    def pull(self, consumer: AgentHandle, req: str, remote: list[int], local: list[int]) -> None:
        consumer.channel.send(pull_job(req, self.port, remote, local))

    def pull_is_correct(
        self, consumer: tuple[AgentHandle, Region], req: str, remote: list[int], local: list[int]
    ) -> float:
        """Pull a served job; check its bytes; return the seconds it took as this test saw."""
        started = time.monotonic()
        self.pull(consumer[0], req, remote, local)
        done = next_message(consumer[0])
        seconds = time.monotonic() - started
        assert done["op"] == "done" and done["ok"], done
        assert consumer[1].digest(local) == self.p_region.digest(remote)
        return seconds

    def close(self) -> None:
        for agent in self.agents:
            agent.stop()
        for region in self.regions:
            region.close()


def pull_job(req: str, port: int, remote: list[int], local: list[int]) -> dict[str, Any]:
    return {"op": "pull", "req": req, "host": "127.0.0.1", "port": port, "remote_req": req,
            "remote_blocks": remote, "local_blocks": local}  # fmt: skip


def next_message(agent: AgentHandle, timeout_s: float = 60.0) -> dict[str, Any]:
    return next_line(agent.channel, timeout_s)


def next_line(channel: LineChannel, timeout_s: float = 60.0) -> dict[str, Any]:
    channel.sock.settimeout(timeout_s)
    try:
        message = channel.recv()
    finally:
        channel.sock.settimeout(None)
    assert message is not None, "the control channel was closed"
    return message


@contextmanager
def stderr_into(path: Path | None) -> Iterator[None]:
    """Processes started inside inherit ``path`` as their stderr (this one's is restored)."""
    if path is None:
        yield
        return
    saved = os.dup(2)
    with path.open("ab") as sink:
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def client_connections(pid: int, port: int, status: str) -> int:
    """The process's TCP connections to ``port`` in ``status`` (e.g. psutil.CONN_ESTABLISHED)."""
    return sum(
        1
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == status
    )


@pytest.fixture
def stand(secret_file: Path, request: pytest.FixtureRequest) -> Iterator[Stand]:
    s = Stand(secret_file, **getattr(request, "param", {}))
    yield s
    s.close()


# ---- (a) slow handshakes: a deadline for each, and a gate that sheds the oldest -------------

HANDSHAKE_S = 4.0
TRICKLE_TICK_S = 1.0


class Trickle:
    """``n`` connections that send one byte of a never-finished handshake frame every
    ``TRICKLE_TICK_S``; half from 127.0.0.1 (the consumers' own address), half spread over
    30 other loopback addresses. Records when each was opened and seen closed."""

    def __init__(self, port: int, n: int) -> None:
        self.socks: list[socket.socket] = []
        self.opened: list[float] = []
        self.closed: dict[int, float] = {}
        self.sent: dict[int, int] = {}
        self.stop = threading.Event()
        payload = struct.pack("!I", 1000) + b"a" * 1000
        for i in range(n):
            source = "127.0.0.1" if i % 2 == 0 else f"127.0.0.{2 + (i // 2) % 30}"
            sock = socket.create_connection(("127.0.0.1", port), 30, (source, 0))
            sock.setblocking(False)
            self.socks.append(sock)
            self.opened.append(time.monotonic())
        self.payload = payload
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def open_count(self) -> int:
        return len(self.socks) - len(self.closed)

    def _run(self) -> None:
        poller = select.poll()
        by_fd = {sock.fileno(): n for n, sock in enumerate(self.socks)}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        next_tick = 0.0
        while not self.stop.is_set() and len(self.closed) < len(self.socks):
            for fd, _ in poller.poll(100):
                n = by_fd[fd]
                try:
                    data = self.socks[n].recv(4096)  # the hello frame, or the end
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._closed(n, poller)
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + TRICKLE_TICK_S
                for n, sock in enumerate(self.socks):
                    if n in self.closed:
                        continue
                    sent = self.sent.get(n, 0)
                    try:
                        sock.send(self.payload[sent : sent + 1])
                        self.sent[n] = sent + 1
                    except BlockingIOError:
                        pass
                    except OSError:
                        self._closed(n, poller)

    def _closed(self, n: int, poller: select.poll) -> None:
        if n not in self.closed:
            self.closed[n] = time.monotonic()
            poller.unregister(self.socks[n].fileno())

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for sock in self.socks:
            sock.close()


@pytest.mark.parametrize(
    "stand", [{"handshake_timeout_s": HANDSHAKE_S, "lease_s": 120.0}], indirect=True
)
def test_300_trickling_handshakes_neither_slow_a_pull_nor_outlive_the_deadline(
    stand: Stand,
) -> None:
    """The trickle holds every handshake slot it can (more than ``max_connections`` sockets)
    and keeps each just under any per-read timeout. A decode worker's new connection still
    gets in (it cuts off the oldest trickler of its address) and its pull takes about as long
    as the same pull without the trickle; every trickling connection is closed by the
    handshake deadline."""
    calm, busy = stand.consumer(), stand.consumer()
    for req in ("calm", "busy"):
        stand.serve(req, [3, 9, 12])
        wait_pinned(stand.port, req, stand.secret)
    baseline = stand.pull_is_correct(calm, "calm", [3, 9, 12], [0, 5, 2])
    trickle = Trickle(stand.port, 300)
    try:
        held = trickle.open_count()
        seconds = stand.pull_is_correct(busy, "busy", [3, 9, 12], [0, 5, 2])
        still_open = trickle.open_count()
        last_opened = trickle.opened[-1]
        # Wait for every trickler's end: the deadline plus a tick to notice, and load slack.
        limit = last_opened + HANDSHAKE_S + TRICKLE_TICK_S + 4.0
        while trickle.open_count() and time.monotonic() < limit:
            time.sleep(0.2)
        lifetimes = [trickle.closed.get(n, time.monotonic()) - t for n, t in
                     enumerate(trickle.opened)]  # fmt: skip
    finally:
        trickle.close()
    assert still_open >= 32, (held, still_open)  # the pull ran while the gate was full
    assert seconds < baseline + 1.0, (seconds, baseline)
    assert max(lifetimes) < HANDSHAKE_S + TRICKLE_TICK_S + 3.0, sorted(lifetimes)[-5:]
    assert max(trickle.sent.values()) >= 2  # they did trickle: each byte came in time
    assert next_message(stand.producer)["reason"] == "sent"
    assert next_message(stand.producer)["reason"] == "sent"


# ---- (b) malformed frames: counted refusals, never a traceback --------------------------

BEFORE_AUTH = [
    b"[" * 1024,  # nested past the parser's recursion limit
    b'{"op":"auth","nonce":"' + bytes([0xC3, 0x28]) + b'"}',  # not UTF-8
    b'{"op":"auth","nonce":["x"]}',  # a wrong type
    b"[1,2,3]",  # not an object
]
AFTER_AUTH = [
    b"[" * 60_000,
    b'{"op":"pull","req":"r","blocks":[1e400]}',  # a block id that is no integer
    b'{"op":"pull","req":"r","blocks":[0],"compat":"bench"}',  # not an object
    b'{"op":"release"}',  # neither req nor key
    b'{"op":{"a":{"b":1}}}',
    b'{"op":"renew","req":NaN}',
]


def send_raw(conn: socket.socket, body: bytes) -> None:
    conn.sendall(struct.pack("!I", len(body)) + body)


def closed_by_peer(conn: socket.socket) -> bool:
    conn.settimeout(30)
    try:
        return conn.recv(65536) == b""
    except ConnectionResetError:
        return True


def test_malformed_frames_before_and_after_the_handshake_are_counted_refusals(
    secret_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_LOG_LEVEL", "info")
    monkeypatch.setenv("PDSERVE_LOG_FORMAT", "text")
    log_path = tmp_path / "producer.log"
    stand = Stand(secret_file, stderr=log_path)
    try:
        consumer = stand.consumer()
        for body in BEFORE_AUTH:
            with socket.create_connection(("127.0.0.1", stand.port), timeout=30) as conn:
                assert recv_frame(conn)["op"] == "hello"
                send_raw(conn, body)
                assert closed_by_peer(conn), body[:40]
        for body in AFTER_AUTH:
            with connect("127.0.0.1", stand.port, stand.secret, 30) as conn:
                send_raw(conn, body)
                assert closed_by_peer(conn), body[:40]
        # Still serving, on the same port:
        stand.serve("after", [4, 7])
        stand.pull_is_correct(consumer, "after", [4, 7], [1, 2])
        with connect("127.0.0.1", stand.port, stand.secret, 30) as conn:
            send_frame(conn, {"op": "renew", "req": "nobody"})
            assert recv_frame(conn) == {"ok": True, "found": False}
    finally:
        stand.close()
    log = log_path.read_text()
    assert "Traceback" not in log and "RecursionError" not in log, log[-3000:]
    refusals = [line for line in log.splitlines() if "refused KV connection #" in line]
    total = len(BEFORE_AUTH) + len(AFTER_AUTH)
    for n in range(1, total + 1):  # each counted, in order (all below the log's rate limit)
        assert any(f"#{n} from" in line for line in refusals), (n, refusals)
    assert sum("an authenticated peer" in line for line in refusals) == len(AFTER_AUTH)
    assert any("nests deeper" in line for line in refusals)
    assert any("not valid JSON" in line for line in refusals)


# ---- (c) many decode workers, and each holds few connections to one prefill worker ------


@pytest.mark.parametrize(
    "stand",
    [{}, {"max_unauthenticated": 4, "max_unauthenticated_per_address": 2}],
    indirect=True,
    ids=["default-bounds", "tight-bounds"],
)
def test_64_consumers_pull_from_one_producer_at_once(stand: Stand) -> None:
    """64 ``Consumer`` objects, each as in a decode worker's transfer process (its own
    connections, thread pool, KV region and result channel), live in this test's process
    (64 processes are too heavy for a small CI machine); the producer is a real agent. All
    64 connect at once from one address; where that is more handshakes than the producer's
    bounds admit (tight-bounds), it cuts the oldest off, their connects try again, and every
    pull still succeeds."""
    consumers: list[tuple[Consumer, LineChannel, Region]] = []
    try:
        for n in range(64):
            region = Region(4, seed=100 + n)
            stand.regions.append(region)
            ours, theirs = socket.socketpair()
            config = AgentConfig(role="consumer", layout=region.layout, region_fds=(),
                                 compat={"bench": "1"}, bind_host="127.0.0.1")  # fmt: skip
            consumer = Consumer(
                config, [memoryview(region.memory)], Reporter(LineChannel(theirs)), stand.secret
            )
            consumers.append((consumer, LineChannel(ours), region))
        remote = {n: [n % 16, (n + 5) % 16] for n in range(64)}
        for n in range(64):
            stand.serve(f"r{n}", remote[n])
        for n, (consumer, _, _) in enumerate(consumers):
            consumer.handle(pull_job(f"r{n}", stand.port, remote[n], [n % 4, (n + 1) % 4]))
        for n, (_, results, region) in enumerate(consumers):
            done = next_line(results, 120.0)
            assert done["ok"], done
            assert region.digest([n % 4, (n + 1) % 4]) == stand.p_region.digest(remote[n])
        finished = [next_message(stand.producer) for _ in range(64)]
        assert {m["reason"] for m in finished} == {"sent"}
        assert {m["req"] for m in finished} == {f"r{n}" for n in range(64)}
    finally:
        for consumer, results, _ in consumers:
            consumer.close()
            consumer.reporter.channel.close_writer(1.0)
            consumer.reporter.channel.sock.close()
            results.sock.close()


@pytest.mark.parametrize("stand", [{"register_wait_s": 20.0}], indirect=True)
def test_a_consumer_holds_at_most_its_cap_of_connections_to_one_producer(stand: Stand) -> None:
    """Eight pulls at once (the consumer's ``max_parallel``) wait in the producer for their
    jobs, each holding its connection: the consumer opens only ``max_peer_connections``."""
    agent, region = stand.consumer(max_peer_connections=2, max_parallel=8)
    for n in range(8):
        stand.pull(agent, f"q{n}", [n], [n])
    deadline = time.monotonic() + 30
    counts: list[int] = []
    while time.monotonic() < deadline and len(counts) < 10:
        established = client_connections(agent.process.pid, stand.port, psutil.CONN_ESTABLISHED)
        if established:
            counts.append(established)
        time.sleep(0.2)
    for n in range(8):
        stand.serve(f"q{n}", [n])
    results = [next_message(agent) for _ in range(8)]
    assert all(r["ok"] for r in results), results
    assert region.digest(list(range(8))) == stand.p_region.digest(list(range(8)))
    assert max(counts) == 2, counts
    assert client_connections(agent.process.pid, stand.port, psutil.CONN_ESTABLISHED) <= 2


# ---- (d) idle authenticated connections ----------------------------------------------------


@pytest.mark.parametrize("stand", [{"idle_timeout_s": 1.0}], indirect=True)
def test_an_idle_connection_is_closed_and_the_next_pull_reconnects(stand: Stand) -> None:
    consumer = stand.consumer()
    stand.serve("first", [1, 2])
    stand.pull_is_correct(consumer, "first", [1, 2], [3, 4])  # its connection is kept
    pid = consumer[0].process.pid
    started = time.monotonic()  # before the connection: its idle time starts after this
    with connect("127.0.0.1", stand.port, stand.secret, 30) as idle:
        assert closed_by_peer(idle)  # within 30 s (never: it times out)
        assert time.monotonic() - started >= 1.0, "closed before it was idle for its timeout"
    # The consumer's kept connection was closed by the producer too (it waits in CLOSE_WAIT).
    assert client_connections(pid, stand.port, psutil.CONN_ESTABLISHED) == 0
    assert client_connections(pid, stand.port, psutil.CONN_CLOSE_WAIT) == 1
    stand.serve("second", [5, 6])
    stand.pull_is_correct(consumer, "second", [5, 6], [7, 0])
    assert [next_message(stand.producer)["reason"] for _ in range(2)] == ["sent", "sent"]


@pytest.mark.parametrize("stand", [{"idle_timeout_s": 1.0, "register_wait_s": 5.0}],
                         indirect=True)  # fmt: skip
def test_the_engines_announcer_reconnects_after_an_idle_close(stand: Stand) -> None:
    """The prefill engine's scheduler keeps one connection to its agent for announcements; after
    a quiet spell the agent closes it, and the next announcement goes over a new one (a frame
    is never written to a connection the peer has closed: it would be lost)."""
    consumer = stand.consumer()
    owner = new_owner()
    stand.producer.channel.send({"op": "owner", "epoch": owner[0], "key": owner[1]})
    assert next_message(stand.producer) == {"op": "owner", "ok": True}
    announcer = Announcer("127.0.0.1", [stand.port], stand.secret, owner)
    try:
        announcer.announce("a1", 1, [1], "")
        stand.pull_is_correct(consumer, "a1", [1], [1])
        time.sleep(2.5)  # idle past the timeout: the announcer's connection is closed
        announcer.announce("a2", 2, [2], "")  # no copy through the worker: only this one
        stand.pull_is_correct(consumer, "a2", [2], [2])
    finally:
        announcer.close()
    assert [next_message(stand.producer)["req"] for _ in range(2)] == ["a1", "a2"]
