"""``gateway.offload.Offload``: results, errors and context cross the thread; 0 threads runs
inline; closing drops what has not started."""

from __future__ import annotations

import contextvars
import threading

import pytest

from gateway.errors import InvalidRequest
from gateway.offload import Offload

REQUEST = contextvars.ContextVar("request", default="none")


def _where(x: int) -> tuple[int, str, str]:
    return x * 2, threading.current_thread().name, REQUEST.get()


def _refuse() -> None:
    raise InvalidRequest("bad chat", param="messages")


async def test_runs_on_a_worker_thread_with_the_callers_context() -> None:
    offload = Offload(2)
    REQUEST.set("req-1")
    try:
        value, thread, request = await offload.run(_where, 21)
    finally:
        offload.close()
    assert value == 42
    assert thread.startswith("gateway-cpu") and thread != threading.current_thread().name
    assert request == "req-1"


async def test_zero_threads_runs_inline() -> None:
    offload = Offload(0)
    _, thread, _ = await offload.run(_where, 1)
    offload.close()
    assert thread == threading.current_thread().name


@pytest.mark.parametrize("threads", [0, 1])
async def test_domain_errors_reach_the_caller_unchanged(threads: int) -> None:
    offload = Offload(threads)
    with pytest.raises(InvalidRequest) as info:
        await offload.run(_refuse)
    offload.close()
    assert info.value.param == "messages"
