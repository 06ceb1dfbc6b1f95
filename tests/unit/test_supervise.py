"""Supervised background work (``pdserve.runtime.supervise``): a loop that raised is restarted,
or, where that is not safe, takes its process down loudly; it never dies silently."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

from gateway.config import GatewaySettings
from gateway.discovery import RegistryDiscovery
from gateway.pool import WorkerPool
from kv_transfer.announce import Announcer
from pdserve.kvindex.memory import MemoryRegistry
from pdserve.runtime import supervise
from pdserve.runtime.tasks import cancel_and_wait

WAIT_S = 10.0  # far above what any of this takes: only a dead loop reaches it


class Boom(RuntimeError):
    pass


def fail_once(real: Any) -> Any:
    """``real`` that raises ``Boom`` on its first call only."""
    calls = {"n": 0}

    def call(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise Boom("injected")
        return real(*args, **kwargs)

    return call


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_backoff_doubles_and_is_capped() -> None:
    assert supervise.backoff_s(1) == supervise.FIRST_BACKOFF_S
    assert supervise.backoff_s(2) == 2 * supervise.FIRST_BACKOFF_S
    assert supervise.backoff_s(100) == supervise.MAX_BACKOFF_S


def test_a_thread_that_raised_is_restarted_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    before = supervise.restarts["t-restart"]
    done = threading.Event()
    body = fail_once(done.set)
    supervise.start_thread(body, "t-restart")
    assert done.wait(WAIT_S), "the loop was not restarted"
    assert supervise.restarts["t-restart"] == before + 1
    failure = [r for r in caplog.records if "t-restart" in r.getMessage()]
    assert failure and failure[0].exc_info is not None and failure[0].exc_info[0] is Boom


def test_a_thread_that_returned_is_not_restarted() -> None:
    calls: list[int] = []
    thread = supervise.start_thread(lambda: calls.append(1), "t-return")
    thread.join(WAIT_S)
    assert not thread.is_alive() and calls == [1]


def test_a_thread_that_cannot_restart_takes_the_process_down_loudly() -> None:
    result = run_python(
        """
        import time
        from pdserve.runtime.supervise import start_thread
        def loop():
            raise RuntimeError("writer broke")
        start_thread(loop, "t-exit", restart=False)
        time.sleep(30)
        print("still alive")
        """
    )
    assert result.returncode == supervise.EXIT_CODE, result
    assert "still alive" not in result.stdout
    assert "t-exit" in result.stderr and "RuntimeError: writer broke" in result.stderr


def test_the_control_channel_writer_takes_the_process_down_loudly() -> None:
    """A writer that failed mid-message left the stream unreadable: no silent half-channel."""
    result = run_python(
        """
        import socket, time
        from kv_transfer.wire import LineChannel
        class Broken:
            def sendall(self, data):
                raise RuntimeError("half a message written")
        ours, theirs = socket.socketpair()
        channel = LineChannel(ours)
        channel.start_writer("kv-report")
        channel.sock = Broken()
        channel.send({"op": "finished"})
        time.sleep(30)
        print("still alive")
        """
    )
    assert result.returncode == supervise.EXIT_CODE, result
    assert "kv-report" in result.stderr and "half a message written" in result.stderr


def test_the_announcer_thread_is_restarted() -> None:
    before = supervise.restarts["kv-announce"]
    announcer = Announcer("127.0.0.1", [1], None, ("epoch", "key"))
    sent: list[str] = []
    arrived = threading.Event()

    def send(port: int, message: dict[str, Any]) -> None:
        sent.append(message["req"])
        arrived.set()

    announcer._send = fail_once(send)  # type: ignore[method-assign]
    announcer.announce("lost", 1, [0], "digest")
    announcer.announce("after", 2, [1], "digest")
    try:
        assert arrived.wait(WAIT_S), "the announcer died with its first message"
        assert sent == ["after"]
        assert supervise.restarts["kv-announce"] == before + 1
    finally:
        announcer.close()


async def test_a_task_that_raised_is_restarted() -> None:
    before = supervise.restarts["a-restart"]
    runs: list[int] = []
    forever = asyncio.Event()

    async def loop() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise Boom("injected")
        await forever.wait()

    task = supervise.start_task(loop, "a-restart")
    for _ in range(int(WAIT_S / 0.01)):
        if len(runs) == 2:
            break
        await asyncio.sleep(0.01)
    assert len(runs) == 2 and supervise.restarts["a-restart"] == before + 1
    await cancel_and_wait(task)
    assert task.cancelled() and len(runs) == 2


def test_a_task_that_cannot_restart_takes_the_process_down_loudly() -> None:
    result = run_python(
        """
        import asyncio
        from pdserve.runtime.supervise import start_task
        async def loop():
            raise RuntimeError("state lost")
        async def main():
            start_task(loop, "a-exit", restart=False)
            await asyncio.sleep(30)
            print("still alive")
        asyncio.run(main())
        """
    )
    assert result.returncode == supervise.EXIT_CODE, result
    assert "a-exit" in result.stderr and "RuntimeError: state lost" in result.stderr


def test_a_task_that_ends_unasked_takes_the_process_down_and_one_stopped_does_not() -> None:
    result = run_python(
        """
        import asyncio
        from pdserve.runtime.supervise import exit_if_ended
        async def main():
            stopping = asyncio.Event()
            stopped = asyncio.create_task(stopping.wait())
            exit_if_ended(stopped, "server-a", stopping.is_set)
            stopping.set()
            await stopped
            await asyncio.sleep(0.1)
            print("stopped as asked")
            ended = asyncio.create_task(asyncio.sleep(0))
            exit_if_ended(ended, "server-b", stopping.clear)
            await asyncio.sleep(30)
            print("still alive")
        asyncio.run(main())
        """
    )
    assert result.returncode == supervise.EXIT_CODE, result
    assert "stopped as asked" in result.stdout and "still alive" not in result.stdout
    assert "server-b ended unexpectedly" in result.stderr and "server-a" not in result.stderr


async def test_the_pool_refresh_loop_goes_on_after_a_failure() -> None:
    pool = WorkerPool(GatewaySettings(health_interval_s=0.01, control_timeout_s=0.5))
    before = supervise.restarts["gateway-pool-refresh"]
    refreshed = asyncio.Event()

    async def paced_refresh(interval_s: float) -> None:
        refreshed.set()
        await asyncio.sleep(interval_s)

    await pool.start()
    pool.paced_refresh = fail_once(paced_refresh)  # type: ignore[method-assign]
    try:
        await asyncio.wait_for(refreshed.wait(), WAIT_S)
        assert supervise.restarts["gateway-pool-refresh"] == before + 1
    finally:
        await pool.close()


async def test_the_discovery_loop_goes_on_after_a_failure() -> None:
    pool = WorkerPool(GatewaySettings(control_timeout_s=0.5))
    discovery = RegistryDiscovery(pool, MemoryRegistry(), interval_s=0.01)
    before = supervise.restarts["gateway-discovery"]
    synced = asyncio.Event()

    async def sync() -> None:
        synced.set()

    await discovery.start(first_pass_s=5.0)
    discovery.sync = fail_once(sync)  # type: ignore[method-assign]
    try:
        await asyncio.wait_for(synced.wait(), WAIT_S)
        assert supervise.restarts["gateway-discovery"] == before + 1
    finally:
        await discovery.close()
        await pool.close()
