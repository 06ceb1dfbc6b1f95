"""What ``make_client`` makes of a URL's TLS parts (no server: clients connect on first use;
the TLS connections themselves are tests/integration/test_redis_tls.py's)."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection

from pdserve.kvindex.redis_client import make_client

CA = "?ssl_ca_certs=%2Fetc%2Fpdserve%2Fca.pem"


async def test_rediss_is_tls_with_the_ca_of_its_query() -> None:
    client = make_client(f"rediss://pdserve:pw@10.0.0.1:6380/0{CA}")
    assert isinstance(client, Redis)
    pool = client.connection_pool
    assert pool.connection_class is SSLConnection
    assert pool.connection_kwargs["ssl_ca_certs"] == "/etc/pdserve/ca.pem"
    assert pool.connection_kwargs["username"] == "pdserve"
    await client.aclose()


async def test_rediss_cluster_is_tls_on_every_node_with_the_ca() -> None:
    client = make_client(f"rediss+cluster://pdserve:pw@10.0.0.1:6380{CA}")
    assert isinstance(client, RedisCluster)
    assert client.connection_kwargs["connection_class"] is SSLConnection
    assert client.connection_kwargs["ssl_ca_certs"] == "/etc/pdserve/ca.pem"
    await client.aclose()


async def test_plain_urls_stay_plain() -> None:
    client = make_client("redis://10.0.0.1:6379/0")
    assert client.connection_pool.connection_class is Connection
    await client.aclose()
    cluster = make_client("redis+cluster://10.0.0.1:6379")
    assert "ssl_ca_certs" not in cluster.connection_kwargs
    await cluster.aclose()


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_tls_parameters_without_tls_are_refused(scheme: str) -> None:
    """Left to redis-py, the cluster client would ignore the CA and talk in plain text, the
    single-server one raise TypeError on its first call."""
    with pytest.raises(ValueError, match="ssl_ca_certs"):
        make_client(f"{scheme}://10.0.0.1:6379{CA}")
