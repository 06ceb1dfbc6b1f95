"""The transfer process: moves KV blocks between workers outside the engine's processes.

A vLLM worker process starts one agent (``python -m kv_transfer.agent --ctrl-fd N``) and
passes it, as inherited file descriptors, the shared memory that holds its KV cache and one
end of a control socket. The first control message is the ``AgentConfig``; after that the
worker sends jobs and the agent reports results (newline-delimited JSON, see ``wire``).

A producer agent (prefill worker) serves pinned blocks to pulling consumers over TCP; a
consumer agent (decode worker) pulls blocks straight into its own mapped KV cache. The agent
imports neither torch nor vLLM: it only maps memory and moves bytes, so its copies and
socket calls run on whatever core is free, without the engine's GIL.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

from kv_transfer.auth import load_secret
from kv_transfer.layout import Layout
from kv_transfer.wire import LineChannel
from pdserve import log as pdlog

log = logging.getLogger("kv_transfer.agent")


@dataclass(frozen=True)
class AgentConfig:
    role: str  # "producer" | "consumer"
    layout: Layout
    region_fds: tuple[int, ...]
    compat: dict[str, str]
    bind_host: str = "0.0.0.0"
    port: int = 0
    lease_s: float = 30.0
    register_wait_s: float = 10.0
    io_timeout_s: float = 30.0
    max_parallel: int = 8
    # File holding the deployment secret ("" = none: the port is open, see kv_transfer.auth).
    secret_file: str = ""
    # Producer: connections served at once; more are closed at accept.
    max_connections: int = 256
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "layout"}
        data["region_fds"] = list(self.region_fds)
        data["layout"] = self.layout.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AgentConfig:
        data = dict(data)
        data["layout"] = Layout.from_json(data["layout"])
        data["region_fds"] = tuple(data["region_fds"])
        return cls(**data)


class Reporter:
    """Sender of results to the worker that never blocks its caller.

    The worker reads results once per engine step, and an idle engine takes no steps: a
    blocking write would stall whoever reports (often while holding the producer's lock).
    Results are queued and written by one writer thread instead (``LineChannel``).
    """

    def __init__(self, channel: LineChannel) -> None:
        self.channel = channel
        channel.start_writer("kv-report")

    def send(self, message: dict[str, Any]) -> None:
        self.channel.send(message)


def map_regions(config: AgentConfig) -> list[memoryview]:
    views = []
    for fd, size in zip(config.region_fds, config.layout.region_sizes, strict=True):
        # MAP_POPULATE: fault the pages in now, not on the first pulls.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        views.append(memoryview(mmap.mmap(fd, size, flags=flags)))
        os.close(fd)  # the mapping keeps the memory alive
    return views


def run(ctrl_fd: int) -> int:
    sock = socket.socket(fileno=ctrl_fd)
    channel = LineChannel(sock)
    first = channel.recv()
    if first is None or first.get("op") != "config":
        log.error("expected a config message first, got %r", first)
        return 2
    config = AgentConfig.from_json(first["config"])
    try:
        secret = load_secret(config.secret_file)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    regions = map_regions(config)
    reporter = Reporter(channel)
    if config.role == "producer":
        from kv_transfer.producer import Producer

        agent: Any = Producer(config, regions, reporter, secret)
    else:
        from kv_transfer.consumer import Consumer

        agent = Consumer(config, regions, reporter, secret)
    reporter.send({"op": "ready", "port": agent.port, "pid": os.getpid()})
    while (message := channel.recv()) is not None:
        if message.get("op") == "stop":
            break
        agent.handle(message)
    agent.close()
    channel.close_writer()
    return 0


def _unpin_from_engine_core() -> None:
    """Leave the engine's core: the worker is pinned to one core and spins on it."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:
        pass  # restricted by the container; the inherited set still works


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctrl-fd", type=int, required=True)
    args = parser.parse_args()
    pdlog.setup(f"kv-agent[{os.getpid()}]")  # PDSERVE_LOG_LEVEL / _FORMAT, to stderr
    _unpin_from_engine_core()
    return run(args.ctrl_fd)


if __name__ == "__main__":
    sys.exit(main())
