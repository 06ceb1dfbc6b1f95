"""The consumer's per-prefill-agent queues (``kv_transfer.peer_lanes.PeerLanes``) and how the
consumer reports pulls that never start: each exactly once."""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kv_transfer import bench
from kv_transfer.agent_context import AgentConfig
from kv_transfer.consumer import Consumer
from kv_transfer.peer_lanes import PeerLanes

A, B = ("10.0.0.1", 1), ("10.0.0.2", 1)
WAIT_S = 10.0  # only ever reached when the behaviour is broken


def wait_until(condition: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)


def test_a_stalled_peer_holds_only_its_own_workers_and_its_queue_no_thread() -> None:
    lanes = PeerLanes(2, linger_s=0.05)
    release, started = threading.Event(), threading.Semaphore(0)

    def stalled() -> None:
        started.release()
        release.wait(WAIT_S)

    for _ in range(5):
        lanes.submit(A, stalled)
    for _ in range(2):
        assert started.acquire(timeout=WAIT_S)
    other = threading.Event()
    lanes.submit(B, other.set)
    assert other.wait(WAIT_S), "a job for another peer waited behind the stalled one"
    assert lanes.workers(A) == 2 and lanes.queued(A) == 3
    assert not started.acquire(timeout=0.1)  # the cap holds: no third job of A started
    release.set()
    wait_until(lambda: lanes.workers(A) == 0 and lanes.workers(B) == 0)
    for _ in range(3):
        assert started.acquire(timeout=WAIT_S)  # the queued ones ran too


def test_a_lane_runs_its_jobs_in_order_and_survives_a_job_that_raises() -> None:
    lanes = PeerLanes(1)
    ran: list[int] = []
    done = threading.Event()

    def broken() -> None:
        raise RuntimeError("a bug")

    lanes.submit(A, broken)
    for n in range(5):
        lanes.submit(A, functools.partial(ran.append, n))
    lanes.submit(A, done.set)
    assert done.wait(WAIT_S)
    assert ran == [0, 1, 2, 3, 4]


def test_a_waiting_worker_takes_the_next_job_and_ends_after_its_linger() -> None:
    lanes = PeerLanes(4, linger_s=0.5)
    threads: list[int] = []
    done = threading.Event()

    def job() -> None:
        threads.append(threading.get_ident())
        done.set()

    for _ in range(3):
        done.clear()
        lanes.submit(A, job)
        assert done.wait(WAIT_S)
        wait_until(lambda: lanes.waiting[A] == 1)  # back to waiting for the next one
    assert len(set(threads)) == 1 and lanes.workers(A) == 1
    wait_until(lambda: lanes.workers(A) == 0)
    assert A not in lanes.queues and A not in lanes.wakeups


def test_close_drops_the_queued_jobs_and_refuses_new_ones() -> None:
    lanes = PeerLanes(1)
    release, running = threading.Event(), threading.Event()
    ran: list[str] = []

    def first() -> None:
        running.set()
        release.wait(WAIT_S)

    lanes.submit(A, first)
    assert running.wait(WAIT_S)
    lanes.submit(A, lambda: ran.append("queued"))
    lanes.close()
    lanes.submit(B, lambda: ran.append("after close"))
    release.set()
    wait_until(lambda: lanes.workers(A) == 0)
    assert ran == []


class Reports:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        with self.lock:
            self.messages.append(message)

    def of(self, req: str) -> list[dict[str, Any]]:
        with self.lock:
            return [m for m in self.messages if m.get("req") == req]


@pytest.fixture
def consumer() -> Iterator[tuple[Consumer, Reports]]:
    fd, _, layout = bench.make_region(bench.Geometry(blocks=1, block_bytes=64), 4, seed=1)
    os.close(fd)
    config = AgentConfig(
        role="consumer", layout=layout, region_fds=(), compat={}, connect_timeout_s=0.3
    )
    reports = Reports()
    agent = Consumer(config, [], reports)  # type: ignore[arg-type]
    yield agent, reports
    agent.close()


def test_a_duplicate_or_malformed_pull_is_refused_and_reported_once(
    consumer: tuple[Consumer, Reports],
) -> None:
    agent, reports = consumer
    with socket.socket() as silent:  # listens, never accepts: the first pull times out
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        pull = {"op": "pull", "req": "r", "host": "127.0.0.1", "port": silent.getsockname()[1],
                "remote_req": "r", "remote_blocks": [0], "local_blocks": [0]}  # fmt: skip
        agent.handle(pull)
        agent.handle(dict(pull))
        agent.handle({"op": "pull", "req": "no-peer", "local_blocks": [0]})
        wait_until(lambda: len(reports.of("r")) == 2)
    duplicate, timed_out = reports.of("r")
    assert "already queued or running" in duplicate["error"]
    assert "no connection within connect_timeout_s (0.3 s)" in timed_out["error"]
    [malformed] = reports.of("no-peer")
    assert not malformed["ok"] and "names no prefill agent" in malformed["error"]
    time.sleep(0.5)  # a second report would come within a connect timeout
    assert len(reports.messages) == 3
