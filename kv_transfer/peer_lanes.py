"""``PeerLanes``: the consumer's jobs queued by the prefill agent they go to, each agent with
its own workers.

A job to an unreachable or silent prefill agent holds a worker for up to its connect timeout;
a shared pool lets a handful of such jobs hold every worker, and then a pull from a healthy
agent waits behind them. Here each agent (a lane) runs at most ``per_peer`` jobs at once, on
threads of its own: a stalled agent holds only its own lane, and the jobs queued there hold no
thread at all. A lane's threads start as its jobs arrive and end after ``linger_s`` without
one (starting a thread costs more than handing a job to a waiting one).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

log = logging.getLogger("kv_transfer.consumer")

Peer = tuple[str, int]
Job = Callable[[], None]
LINGER_S = 5.0


class PeerLanes:
    def __init__(self, per_peer: int, name: str = "kv-pull", linger_s: float = LINGER_S) -> None:
        self.per_peer = max(1, per_peer)
        self.name = name
        self.linger_s = linger_s
        self.lock = threading.Lock()
        self.queues: dict[Peer, deque[Job]] = {}
        self.wakeups: dict[Peer, threading.Condition] = {}  # over ``lock``, one a lane
        self.running: Counter[Peer] = Counter()  # each lane's threads, waiting ones included
        self.waiting: Counter[Peer] = Counter()  # of those, the ones waiting for a job
        self.closed = False

    def submit(self, peer: Peer, job: Job) -> None:
        """Run ``job`` on one of ``peer``'s workers, after the jobs queued there before it.
        Ignored once closed. ``job`` reports its own outcome (it must not raise)."""
        with self.lock:
            if self.closed:
                return
            queue = self.queues.setdefault(peer, deque())
            queue.append(job)
            if self.waiting[peer]:
                self.wakeups[peer].notify()
            if len(queue) <= self.waiting[peer] or self.running[peer] >= self.per_peer:
                return  # a worker of this lane takes it
            self.running[peer] += 1
            self.wakeups.setdefault(peer, threading.Condition(self.lock))
        worker = threading.Thread(
            target=self._work, args=(peer,), name=f"{self.name}-{peer[0]}:{peer[1]}", daemon=True
        )
        worker.start()

    def queued(self, peer: Peer) -> int:
        with self.lock:
            return len(self.queues.get(peer, ()))

    def workers(self, peer: Peer) -> int:
        with self.lock:
            return self.running[peer]

    def close(self) -> None:
        """Drop every queued job and end the waiting workers; running jobs finish."""
        with self.lock:
            self.closed = True
            self.queues.clear()
            for wakeup in self.wakeups.values():
                wakeup.notify_all()

    def _work(self, peer: Peer) -> None:
        while True:
            with self.lock:
                job = self._next(peer)
                if job is None:
                    self.running[peer] -= 1
                    if self.running[peer] <= 0:
                        del self.running[peer]
                        if not self.queues.get(peer):
                            self.queues.pop(peer, None)
                            self.wakeups.pop(peer, None)
                    return
            try:
                job()
            except Exception:  # a bug in one job must not end the lane with jobs queued
                log.exception("a KV job for %s:%s failed", *peer)

    def _next(self, peer: Peer) -> Job | None:
        """The lane's next job, waiting up to ``linger_s`` for one; caller holds ``lock``."""
        deadline = time.monotonic() + self.linger_s
        while not self.closed:
            queue = self.queues.get(peer)
            if queue:
                return queue.popleft()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.waiting[peer] += 1
            try:
                self.wakeups[peer].wait(left)
            finally:
                self.waiting[peer] -= 1
                if self.waiting[peer] <= 0:
                    del self.waiting[peer]
        return None
