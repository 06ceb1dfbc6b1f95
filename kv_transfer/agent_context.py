"""What a transfer process is handed, shared by its producer and consumer roles: its
settings (``AgentConfig``, the first control message), the worker's KV cache mapped into it
(``map_regions``) and the non-blocking channel for its results (``Reporter``).

Below ``kv_transfer.producer`` and ``kv_transfer.consumer``; ``kv_transfer.agent`` (the
process's entry point) sits above all three.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field, fields
from typing import Any

from kv_transfer.layout import Layout
from kv_transfer.wire import LineChannel


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
    # Each read or write of a transfer (and, producer: a whole request frame) within this long.
    io_timeout_s: float = 30.0
    # Consumer: a new connection to a producer agent, TCP connect and handshake together, within
    # this long (apart from io_timeout_s, so that an unreachable prefill worker fails its pulls
    # in seconds, not in a transfer's timeout).
    connect_timeout_s: float = 3.0
    # Consumer: jobs (pulls, releases) running at once to one producer agent, at most (and at
    # most max_peer_connections). Each producer agent has its own workers and queue
    # (kv_transfer.peer_lanes): a stalled one never delays pulls from the others.
    max_parallel: int = 8
    # File holding the deployment secret ("" = none: the port is open, see kv_transfer.auth).
    secret_file: str = ""
    # Producer: connections served at once; more are closed at accept.
    max_connections: int = 256
    # Producer: a connection must complete the handshake within this long of its accept.
    handshake_timeout_s: float = 5.0
    # Producer: connections still in the handshake, at most (of max_connections: the rest are
    # kept for authenticated peers) and from one peer address; a new one beyond either bound
    # cuts off the oldest (see kv_transfer.auth.HandshakeGate).
    max_unauthenticated: int = 64
    max_unauthenticated_per_address: int = 8
    # Producer: an authenticated connection that sends no request for this long is closed.
    idle_timeout_s: float = 300.0
    # Consumer: connections to one producer agent, at most (in use and kept idle together).
    max_peer_connections: int = 4
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "layout"}
        data["region_fds"] = list(self.region_fds)
        data["layout"] = self.layout.to_json()
        return data

    @classmethod
    def tunables(cls, extra: dict[str, Any]) -> dict[str, float | int]:
        """The numeric settings (timeouts, bounds) named in ``extra`` (the connector's
        ``kv_connector_extra_config``), as their types; ValueError for a value that is none."""
        settings: dict[str, float | int] = {}
        for f in fields(cls):
            if f.name not in extra or type(f.default) not in (int, float):
                continue
            kind: type[float] | type[int] = type(f.default)  # type: ignore[assignment]
            try:
                value = kind(extra[f.name])
            except (TypeError, ValueError):
                raise ValueError(
                    f"kv_connector_extra_config {f.name!r} must be a number, not {extra[f.name]!r}"
                ) from None
            if value < 0 or (kind is int and value != float(extra[f.name])):
                raise ValueError(f"kv_connector_extra_config {f.name!r}: {extra[f.name]!r} "
                                 f"is not a non-negative {kind.__name__}")  # fmt: skip
            settings[f.name] = value
        return settings

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


DEFAULT_PORT = 15100  # the first KV port of a prefill worker (one per tensor-parallel rank)


def agent_settings(
    extra: dict[str, Any], producer: bool, rank: int, secret_file: str
) -> dict[str, Any]:
    """A worker's transfer-process settings from the connector's
    ``kv_connector_extra_config``: ``kv_port``, ``kv_bind_host``, and any of ``AgentConfig``'s
    timeouts and bounds (``lease_s``, ``io_timeout_s``, ``max_connections``, ...)."""
    port = int(extra.get("kv_port", DEFAULT_PORT))
    return {
        **AgentConfig.tunables({k: v for k, v in extra.items() if k != "port"}),
        "bind_host": str(extra.get("kv_bind_host", "0.0.0.0")),
        "port": port + rank if producer else 0,
        "secret_file": secret_file,
    }
