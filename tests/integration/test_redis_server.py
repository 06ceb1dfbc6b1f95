"""The private redis-server of ``pdserve up`` and the tests: its port may be taken between
choosing and binding it."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from pdserve.cluster.redis_server import (
    RedisServer,
    RedisServerError,
    answers,
    free_port,
    free_ports,
    server_command,
)


@contextmanager
def squatter(port: int) -> Iterator[socket.socket]:
    """Another process's listener on ``port``: accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield sock


def test_ports_chosen_together_differ() -> None:
    """Chosen one after another, two ports can repeat (a gateway once got the same port for
    HTTP and gRPC); chosen together they cannot."""
    ports = free_ports(32)
    assert len(set(ports)) == 32


def test_a_chosen_port_taken_before_the_server_binds_it_is_replaced() -> None:
    server = RedisServer()
    chosen = server.port
    with squatter(chosen), server:
        assert server.port != chosen
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        assert client.ping() and client.info("server")["process_id"] == server.process.pid
        client.close()
        # A restart keeps the port clients know.
        server.stop()
        server.start()
        assert server.port != chosen and server.process is not None


def test_a_port_asked_for_is_not_replaced() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.listen()
        with pytest.raises(RedisServerError, match=str(port)):
            RedisServer(port).start()


@contextmanager
def started(argv: list[str], port: int) -> Iterator[redis.Redis]:
    """redis-server run with ``argv`` (as pdserve up runs it), and a client to it."""
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not answers(port):
            assert process.poll() is None, f"redis-server exited: {argv}"
            assert time.monotonic() < deadline, "redis-server did not answer"
            time.sleep(0.05)
        client = redis.Redis(port=port, socket_timeout=5)
        yield client
        client.close()
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_the_tier_redis_evicts_old_chunks_and_the_index_redis_never_evicts() -> None:
    chunk, chunks = b"x" * 256 * 1024, 40  # 10 MiB into a 4 MiB tier
    port = free_port()
    with started(server_command(port, maxmemory_bytes=4 * 2**20), port) as tier:
        for i in range(chunks):
            tier.set(f"chunk-{i}", chunk)  # never "OOM command not allowed"
        assert 0 < tier.dbsize() < chunks
        assert tier.exists(f"chunk-{chunks - 1}"), "the newest chunk stays"
        assert tier.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
    port = free_port()
    with started(server_command(port), port) as index:
        config = index.config_get("maxmemory*")
        assert config["maxmemory"] == "0" and config["maxmemory-policy"] == "noeviction"
