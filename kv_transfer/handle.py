"""Starting and stopping a transfer process (see ``agent``); used by the connector's worker
half and by the benchmark. Imports neither torch nor vLLM."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass

from kv_transfer.agent_context import AgentConfig
from kv_transfer.errors import KVTransferError
from kv_transfer.wire import LineChannel

AGENT_START_TIMEOUT_S = 60.0


@dataclass
class AgentHandle:
    """The running transfer process and its control channel."""

    process: subprocess.Popen[bytes]
    channel: LineChannel
    port: int

    @classmethod
    def start(cls, config: AgentConfig, module: str = "kv_transfer.agent") -> AgentHandle:
        """``module``: the process's entry point (the benchmark's unchecked baseline has
        its own, ``kv_transfer.bench_unchecked``)."""
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", module, "--ctrl-fd", str(theirs.fileno())]
        process = subprocess.Popen(
            cmd, pass_fds=[theirs.fileno(), *config.region_fds], stdin=subprocess.DEVNULL
        )
        theirs.close()
        for fd in config.region_fds:
            os.close(fd)
        channel = LineChannel(ours)
        channel.send({"op": "config", "config": config.to_json()})
        ours.settimeout(AGENT_START_TIMEOUT_S)
        ready = channel.recv()
        ours.settimeout(None)
        # From now on sends are queued: the engine thread never blocks on the agent.
        channel.start_writer("kv-ctrl")
        if not ready or ready.get("op") != "ready":
            process.kill()
            raise KVTransferError(
                f"KV transfer process did not start (exit code {process.poll()}); "
                f"is port {config.port} free?"
            )
        return cls(process, channel, int(ready["port"]))

    def stop(self) -> None:
        try:
            self.channel.send({"op": "stop"})
            self.channel.close_writer()
            self.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
