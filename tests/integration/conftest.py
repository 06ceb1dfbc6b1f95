"""Fixtures the integration tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.cluster.redis_server import RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server of the test's own, on a free loopback port."""
    with RedisServer() as server:
        yield server
