"""The private redis-server of ``pdserve up`` and the tests: its port may be taken between
choosing and binding it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from pdserve.cluster import redis_server
from pdserve.cluster.redis_server import (
    RedisServer,
    RedisServerError,
    chosen_port_range,
    free_ports,
    server_command,
)
from tests.helpers import redis_process


@contextmanager
def squatter() -> Iterator[int]:
    """Another process's listener on a port of its own: accepts connections and never
    answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_ports_chosen_together_differ_and_lie_below_the_ephemeral_range() -> None:
    """Chosen one after another, two ports can repeat (a gateway once got the same port for
    HTTP and gRPC); chosen together they cannot. None is where the kernel hands out ports to
    other processes' connections and port-0 binds meanwhile."""
    ports = free_ports(32)
    assert len(set(ports)) == 32
    assert all(port in chosen_port_range() for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        assert sock.getsockname()[1] not in chosen_port_range()


def test_a_chosen_port_taken_before_the_server_binds_it_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with squatter() as chosen:
        picks = iter([[chosen]])  # the choice another process takes before the server binds it
        monkeypatch.setattr(
            redis_server, "free_ports", lambda n: next(picks, None) or free_ports(n)
        )
        server = RedisServer()
        assert server.port == chosen
        with server:
            assert server.port != chosen
            client = redis.Redis.from_url(server.url, socket_timeout=5)
            assert client.ping() and client.info("server")["process_id"] == server.process.pid
            client.close()
            # A restart keeps the port clients know.
            port = server.port
            server.stop()
            server.start()
            assert server.port == port and server.process is not None


def test_a_port_asked_for_is_not_replaced() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.listen()
        with pytest.raises(RedisServerError, match=str(port)):
            RedisServer(port).start()


@contextmanager
def started(maxmemory_bytes: int | None = None) -> Iterator[redis.Redis]:
    """redis-server run as pdserve up runs it (``server_command``), and a client to it."""
    with redis_process(lambda port: server_command(port, maxmemory_bytes)) as (port, _):
        client = redis.Redis(port=port, socket_timeout=5)
        yield client
        client.close()


def test_the_tier_redis_evicts_old_chunks_and_the_index_redis_never_evicts() -> None:
    chunk, chunks = b"x" * 256 * 1024, 40  # 10 MiB into a 4 MiB tier
    with started(maxmemory_bytes=4 * 2**20) as tier:
        for i in range(chunks):
            tier.set(f"chunk-{i}", chunk)  # never "OOM command not allowed"
        assert 0 < tier.dbsize() < chunks
        assert tier.exists(f"chunk-{chunks - 1}"), "the newest chunk stays"
        assert tier.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
    with started() as index:
        config = index.config_get("maxmemory*")
        assert config["maxmemory"] == "0" and config["maxmemory-policy"] == "noeviction"


def test_a_redis_process_whose_port_was_taken_starts_again_on_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tests' own redis-servers (``tests.helpers.redis_process``) retry like
    ``RedisServer``: redis-server exits when its port is taken."""
    with squatter() as chosen:
        picks = iter([[chosen]])
        monkeypatch.setattr(
            redis_server, "free_ports", lambda n: next(picks, None) or free_ports(n)
        )
        with redis_process(server_command) as (port, process):
            assert port != chosen
            client = redis.Redis(port=port, socket_timeout=5)
            assert client.info("server")["process_id"] == process.pid
            client.close()
