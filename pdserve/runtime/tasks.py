"""Stopping background loops reliably.

On Python 3.11, ``asyncio.wait_for`` swallows a cancellation that arrives just as the
operation it waits for completes (CPython gh-86296, fixed in 3.12). redis-py wraps every
command write in ``wait_for`` when a socket timeout is set, so a loop talking to Redis can
absorb ``task.cancel()`` and carry on: ``await task`` after one cancel may never return.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

RECANCEL_S = 0.5  # how long one cancellation may take to end the task before the next


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` until it has ended (a loop with an await between steps ends at the
    next one); what it raised or returned is discarded."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()
