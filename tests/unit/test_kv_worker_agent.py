"""The worker half of the connector ends the engine when its transfer process is gone."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kv_transfer.errors import KVTransferError
from kv_transfer.handle import AgentHandle
from kv_transfer.wire import LineChannel
from kv_transfer.worker import WorkerSide


def side_with(process: subprocess.Popen[bytes]) -> WorkerSide:
    import socket

    ours, theirs = socket.socketpair()
    theirs.close()
    side = WorkerSide(role="consumer", agent_settings={}, compat={})
    side.agent = AgentHandle(process, LineChannel(ours), 0)
    return side


def test_a_dead_transfer_process_stops_the_engine_step() -> None:
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    side = side_with(process)
    with pytest.raises(KVTransferError, match="exited with code 3"):
        side.collect(set())


def test_a_live_transfer_process_lets_the_step_go_on(monkeypatch: Any) -> None:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        side = side_with(process)
        monkeypatch.setattr(side.agent.channel, "poll", lambda: [])  # type: ignore[union-attr]
        assert side.collect(set()) == (set(), set(), set())
    finally:
        process.kill()
        process.wait()
