"""Background work that never dies silently.

Every long-lived thread and asyncio task of a pdserve process (the KV agent's accept and lease
loops, the worker's KV event sink and heartbeat, the gateway's health checks and discovery,
its HTTP server) is started here, with one of two policies for a loop that raised:

* **restart** (``restart=True``): for a loop that keeps no state a crash could have corrupted.
  One log line with the traceback, a count in ``restarts`` (by name), then the loop is started
  again after a backoff that doubles while it keeps failing at once (``backoff_s``);
* **exit** (``restart=False``): for one that cannot be restarted safely (a half-written
  stream). One critical log line with the traceback, then the process ends with ``EXIT_CODE``
  at once (``os._exit``: a process whose background work broke is not trusted to shut down
  cleanly). Used only in processes that something restarts: ``pdserve up`` restarts a worker
  or gateway that exits, and a worker whose KV agent is gone fails its engine and exits.

A loop that returns (it was told to stop) is not restarted; a task that is cancelled is not
either (its owner stops it: ``pdserve.runtime.tasks.cancel_and_wait``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)

EXIT_CODE = 70  # EX_SOFTWARE: an internal error; the process supervisor restarts it
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
STABLE_S = 30.0  # a run this long resets the backoff

# Restarts so far, by loop name (all threads and tasks of the process).
restarts: Counter[str] = Counter()
_lock = threading.Lock()


def backoff_s(failures_in_a_row: int) -> float:
    """Delay before the ``n``-th restart in a row (1, 2, ...): 0.1 s doubling to 5 s."""
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** max(0, failures_in_a_row - 1))


def die(name: str, exc: BaseException) -> None:
    """Log ``exc`` as what ended ``name`` and end the process with ``EXIT_CODE``."""
    log.critical(
        "background loop %s failed and cannot be restarted safely; exiting (code %d)",
        name,
        EXIT_CODE,
        exc_info=(type(exc), exc, exc.__traceback__),
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)


def _count_restart(name: str, exc: BaseException, delay_s: float) -> None:
    with _lock:
        restarts[name] += 1
        count = restarts[name]
    log.error(
        "background loop %s failed (restart %d, in %.1f s)",
        name,
        count,
        delay_s,
        exc_info=(type(exc), exc, exc.__traceback__),
    )


def start_thread(target: Callable[[], None], name: str, restart: bool = True) -> threading.Thread:
    """Run ``target`` in a daemon thread named ``name`` under the policy (module docstring);
    the thread is started and returned."""

    def run() -> None:
        in_a_row = 0
        while True:
            started = time.monotonic()
            try:
                target()
                return
            except BaseException as exc:  # SystemExit too: no thread may vanish
                if not restart:
                    die(name, exc)
                in_a_row = 1 if time.monotonic() - started >= STABLE_S else in_a_row + 1
                delay = backoff_s(in_a_row)
                _count_restart(name, exc, delay)
                time.sleep(delay)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def start_task(
    factory: Callable[[], Coroutine[Any, Any, None]], name: str, restart: bool = True
) -> asyncio.Task[None]:
    """Run the coroutine ``factory()`` makes in a task named ``name`` under the policy (module
    docstring): after a failure a new one is made. Cancel the returned task to stop it."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        in_a_row = 0
        while True:
            started = loop.time()
            try:
                await factory()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not restart:
                    die(name, exc)
                in_a_row = 1 if loop.time() - started >= STABLE_S else in_a_row + 1
                delay = backoff_s(in_a_row)
                _count_restart(name, exc, delay)
                await asyncio.sleep(delay)

    return asyncio.create_task(run(), name=name)


def exit_if_ended(task: asyncio.Task[Any], name: str, expected: Callable[[], bool]) -> None:
    """The exit policy for a task started elsewhere: once ``task`` ends while ``expected()``
    is false (it raised, or returned though nobody stopped it), the process ends loudly."""

    def on_done(done: asyncio.Task[Any]) -> None:
        if done.cancelled() or expected():
            return
        exc = done.exception()
        die(name, exc if exc is not None else RuntimeError(f"{name} ended unexpectedly"))

    task.add_done_callback(on_done)
