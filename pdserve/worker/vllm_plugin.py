"""A vLLM general plugin (entry point ``vllm.general_plugins``): loaded by every vLLM process
of this environment, it does something only where a pdserve setting asks for it.

``PDSERVE_ENGINE_SPIN_PAUSE_S``: how long an engine process sleeps between two looks at vLLM's
shared-memory message queue while it waits for the next message (vLLM: none, it calls
``sched_yield`` in a loop for up to 1 s after each message, then sleeps until the next one is
announced). On the CPU the engine-core (scheduler) process and the model-runner process pass
every step through that queue, and each spins while the other works. When every core runs an
engine's OpenMP thread, as pdserve's workers do, the spinning scheduler takes its share of a
core the model needs. A pause of a fraction of a millisecond costs that much latency per
message and almost no CPU. (Sleeping until the announcement alone does not work: vLLM's
announcements are dropped while one is still unread, and the reader then sleeps until its
timeout.)
"""

from __future__ import annotations

import os
import time
from typing import Any

PAUSE_ENV = "PDSERVE_ENGINE_SPIN_PAUSE_S"


def register() -> None:
    value = os.environ.get(PAUSE_ENV, "")
    if not value:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    condition: Any = shm_broadcast.SpinCondition
    first = getattr(condition, "_pdserve_pause_s", None) is None
    condition._pdserve_pause_s = float(value)
    if not first:
        return
    vllm_wait = condition.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        # Where vLLM would yield the CPU and look again at once, sleep a little first; past
        # its busy period, vLLM's own wait (sleep until announced, or the timeout).
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(condition._pdserve_pause_s)
        else:
            vllm_wait(self, timeout_ms)

    condition.wait = wait
