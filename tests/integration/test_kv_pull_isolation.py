"""A decode worker's pulls from one unreachable prefill worker never stall its pulls from the
others, fail within the connect timeout, and a pull cancelled while queued never connects.

A real producer and a real consumer transfer process (``kv_transfer.agent``) over memfd
regions, as in ``test_kv_transport.py``; the unreachable prefill worker is a loopback port
this test holds that never answers (``BlackHole``).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kv_transfer import bench
from kv_transfer.handle import AgentHandle
from tests.helpers import wait_pinned
from tests.integration import test_kv_security as security

GEO = bench.Geometry(blocks=4, block_bytes=4096)
CONNECT_S = 2.0  # the consumer's connect_timeout_s here


class BlackHole:
    """A loopback port that never says hello. ``accept=False``: nobody accepts, backlog 0, so
    the kernel completes one connection and drops the SYNs of the rest (their connect hangs).
    ``accept=True``: every connection is accepted, counted and held open, silent."""

    def __init__(self, accept: bool) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.port = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        if accept:
            self.listener.settimeout(0.05)
            threading.Thread(target=self._accept, daemon=True).start()

    def accepted(self) -> int:
        with self.lock:
            return len(self.held)

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with self.lock:
                self.held.append(conn)

    def close(self) -> None:
        self.stop.set()
        time.sleep(0.1)  # the accept loop sees it within its 0.05 s timeout
        with self.lock:
            for conn in self.held:
                conn.close()
        self.listener.close()


class Stand:
    """One producer agent and one consumer agent over their own regions."""

    def __init__(self, **consumer: Any) -> None:
        self.p_fd, self.p_mem, self.p_layout = bench.make_region(GEO, 8, seed=1)
        self.c_fd, self.c_mem, self.c_layout = bench.make_region(GEO, 8, seed=2)
        self.producer = bench.start_agent("producer", self.p_fd, self.p_layout)
        consumer.setdefault("connect_timeout_s", CONNECT_S)
        self.consumer = bench.start_agent("consumer", self.c_fd, self.c_layout, **consumer)

    def serve(self, req: str, blocks: list[int]) -> None:
        self.producer.channel.send({"op": "serve", "req": req, "blocks": blocks})
        wait_pinned(self.producer.port, req)

    def pull(self, req: str, remote: list[int], local: list[int], port: int = 0) -> None:
        self.consumer.channel.send(
            {
                "op": "pull",
                "req": req,
                "host": "127.0.0.1",
                "port": port or self.producer.port,
                "remote_req": req,
                "remote_blocks": remote,
                "local_blocks": local,
            }
        )

    def timed_pull(self, req: str, block: int, seen: list[dict[str, Any]]) -> float:
        """Seconds from handing the consumer a pull of ``req`` (served, pinned) to its report;
        other reports that arrive meanwhile go to ``seen``."""
        self.serve(req, [block])
        started = time.perf_counter()
        self.pull(req, [block], [block])
        while (done := next_message(self.consumer))["req"] != req:
            seen.append(done)
        elapsed = time.perf_counter() - started
        assert done["ok"], done
        finished = next_message(self.producer)
        assert finished["req"] == req and finished["reason"] == "sent", finished
        src = bench.blocks_digest(self.p_mem, self.p_layout, [block])
        assert bench.blocks_digest(self.c_mem, self.c_layout, [block]) == src
        return elapsed

    def close(self) -> None:
        for agent in (self.producer, self.consumer):
            agent.stop()
        for fd in (self.p_fd, self.c_fd):
            os.close(fd)


def next_message(agent: AgentHandle, timeout_s: float = 10.0) -> dict[str, Any]:
    """The agent's next report, within 10 s unless told otherwise."""
    return security.next_message(agent, timeout_s)


def assert_silent(agent: AgentHandle, seconds: float) -> None:
    with pytest.raises(TimeoutError):
        extra = next_message(agent, seconds)
        pytest.fail(f"unexpected report {extra}")


@pytest.fixture
def stand(request: pytest.FixtureRequest) -> Iterator[Stand]:
    s = Stand(**getattr(request, "param", {}))
    yield s
    s.close()


def test_pulls_to_an_unreachable_prefill_worker_do_not_delay_a_healthy_ones(stand: Stand) -> None:
    """Eight pulls to a port that never answers, queued first, delay a pull from a healthy
    producer by under 1 s (measured against the same pull without them), and each of the eight
    fails within the connect timeout, reported once."""
    hole = BlackHole(accept=False)
    try:
        seen: list[dict[str, Any]] = []
        stand.timed_pull("warm-up", 0, seen)  # the connection to the producer is kept after it
        alone = stand.timed_pull("alone", 1, seen)
        holes = [f"hole-{n}" for n in range(8)]
        for n, req in enumerate(holes):
            stand.pull(req, [0], [n], port=hole.port)
        behind = stand.timed_pull("behind-the-hole", 2, seen)
        assert behind - alone < 1.0, (alone, behind)
        assert seen == [], seen  # the healthy pull came back before any of the eight failed
        # Four at a time (the per-peer cap), each within the connect timeout: all by 2 x 2 s.
        failed = [next_message(stand.consumer, 4 * CONNECT_S) for _ in holes]
        assert sorted(d["req"] for d in failed) == sorted(holes)
        for done in failed:
            assert not done["ok"], done
            assert done["seconds"] < CONNECT_S + 1.0, done
            assert "no connection within connect_timeout_s" in done["error"], done
        assert_silent(stand.consumer, 1.0)  # each reported exactly once
    finally:
        hole.close()


@pytest.mark.parametrize("stand", [{"max_peer_connections": 1}], indirect=True)
def test_a_pull_cancelled_while_queued_never_connects_and_is_reported_once(stand: Stand) -> None:
    """One worker for the silent port: the second pull waits in its queue, is cancelled there,
    is reported failed at once and never opens a connection, also after the first one failed."""
    hole = BlackHole(accept=True)
    try:
        stand.pull("first", [0], [0], port=hole.port)
        deadline = time.monotonic() + CONNECT_S
        while hole.accepted() < 1:
            assert time.monotonic() < deadline, "the first pull never connected"
            time.sleep(0.01)
        stand.pull("queued", [1], [1], port=hole.port)
        stand.consumer.channel.send({"op": "cancel", "req": "queued"})
        cancelled = next_message(stand.consumer)
        assert cancelled["req"] == "queued" and not cancelled["ok"], cancelled
        assert "cancelled before it started" in cancelled["error"]
        first = next_message(stand.consumer, 3 * CONNECT_S)
        assert first["req"] == "first" and not first["ok"], first
        assert "no connection within connect_timeout_s" in first["error"], first
        # The worker is free now: a cancelled pull still in the queue would connect here.
        assert_silent(stand.consumer, 1.0)
        assert hole.accepted() == 1
        # The consumer still pulls from a healthy producer.
        stand.timed_pull("after", 2, [])
    finally:
        hole.close()
