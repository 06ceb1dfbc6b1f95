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
import os
import socket
import sys
from typing import Any

from kv_transfer.agent_context import AgentConfig, Reporter, map_regions
from kv_transfer.auth import load_secret
from kv_transfer.consumer import Consumer
from kv_transfer.producer import Producer
from kv_transfer.wire import LineChannel
from pdserve.telemetry import log as pdlog

log = logging.getLogger("kv_transfer.agent")


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
    agent: Any
    if config.role == "producer":
        agent = Producer(config, regions, reporter, secret)
    else:
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
