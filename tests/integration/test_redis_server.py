"""The private redis-server of ``pdserve up`` and the tests: its port may be taken between
choosing and binding it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from pdserve.redis_server import RedisServer, RedisServerError


@contextmanager
def squatter(port: int) -> Iterator[socket.socket]:
    """Another process's listener on ``port``: accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield sock


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
