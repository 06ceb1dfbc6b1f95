"""``pdserve.runtime.tasks.cancel_and_wait`` ends a loop that swallowed a cancellation, as Python
3.11's ``asyncio.wait_for`` (inside redis-py) does when the cancel meets a completed write."""

from __future__ import annotations

import asyncio

from pdserve.runtime.tasks import cancel_and_wait


async def test_a_loop_that_swallows_one_cancellation_still_ends() -> None:
    swallowed = asyncio.Event()
    steps = 0

    async def loop() -> None:
        nonlocal steps
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed.is_set():
                    raise
                swallowed.set()  # as wait_for returns the finished result instead
            steps += 1

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # the loop is in its sleep
    await asyncio.wait_for(cancel_and_wait(task), 60)  # a hang guard, far above the need
    assert swallowed.is_set() and task.cancelled() and steps == 1


async def test_what_the_task_raised_is_discarded() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.done()
