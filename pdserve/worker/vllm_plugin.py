"""A vLLM general plugin (entry point ``vllm.general_plugins``): loaded by every vLLM process
of this environment, it does something only where a pdserve setting asks for it.

``PDSERVE_ENGINE_SPIN_PAUSE_S``: how long an engine process sleeps between two looks at vLLM's
shared-memory message queue while it waits for the next message (vLLM: none, it calls
``sched_yield`` in a loop for up to 1 s after each message, then sleeps until the next one is
announced). On the CPU the engine-core (scheduler) process and the model-runner process pass
every step through that queue, and each spins while the other works. When every core runs an
engine's OpenMP thread, as pdserve's workers do, the spinning scheduler takes its share of a
core the model needs. (Sleeping until the announcement alone does not work: vLLM's
announcements are dropped while one is still unread, and the reader then sleeps until its
timeout.)

``PDSERVE_ENGINE_SPIN_PAUSE_MAX_S``: the pause grows with the wait, to an eighth of the time
waited so far, up to this (default: no growth). A short wait (the model runner waiting for
the scheduler's next step) is seen within a fraction of a millisecond; a long one (the
scheduler waiting for a model step) costs few wake-ups, each of which would take a core from
an engine's OpenMP thread, and at most this much latency.
"""

from __future__ import annotations

import os
import time
from typing import Any

PAUSE_ENV = "PDSERVE_ENGINE_SPIN_PAUSE_S"
MAX_PAUSE_ENV = "PDSERVE_ENGINE_SPIN_PAUSE_MAX_S"
# A pause grows to this share of the time the reader has waited so far (up to the longest).
GROWTH = 0.125


def register() -> None:
    value = os.environ.get(PAUSE_ENV, "")
    if not value:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    condition: Any = shm_broadcast.SpinCondition
    first = getattr(condition, "_pdserve_pause_s", None) is None
    shortest = condition._pdserve_pause_s = float(value)
    longest = os.environ.get(MAX_PAUSE_ENV, "")
    condition._pdserve_max_pause_s = max(float(longest), shortest) if longest else shortest
    if not first:
        return
    vllm_wait = condition.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        # Where vLLM would yield the CPU and look again at once, sleep a little first; past
        # its busy period, vLLM's own wait (sleep until announced, or the timeout).
        now = time.monotonic()
        if now > self.last_read + self.busy_loop_s:
            vllm_wait(self, timeout_ms)
            return
        # A wait begins with the first look after a read (reads move last_read).
        if getattr(self, "_pdserve_read", None) != self.last_read:
            self._pdserve_read, self._pdserve_since = self.last_read, now
        waited = now - self._pdserve_since
        pause = min(condition._pdserve_max_pause_s, waited * GROWTH)
        time.sleep(max(condition._pdserve_pause_s, pause))

    condition.wait = wait
