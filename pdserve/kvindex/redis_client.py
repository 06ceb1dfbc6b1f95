"""The one way pdserve makes a Redis client from a URL: a single server or a Redis Cluster.

``redis://`` and ``rediss://`` (TLS) name one server (or a managed service's one endpoint);
``redis+cluster://`` and ``rediss+cluster://`` name any node of a Redis Cluster, whose slots
the client learns from it (``redis.asyncio.RedisCluster``: it follows MOVED/ASK redirections
and relearns the slots after a failover). User and password go in the URL as usual
(``redis+cluster://user:password@host:port``), and so do redis-py's own TLS parameters, such
as the CA that signed the server's certificate: ``rediss://host:port/0?ssl_ca_certs=ca.pem``
(without it the system's CAs are trusted). An ``ssl_*`` parameter in a plain ``redis://`` URL
is refused (``ValueError``): the cluster client would ignore it and talk without TLS, and the
single-server one fail on its first call.

``UNAVAILABLE_ERRORS`` are what either client raises when the store cannot serve a call (a
connection refused or timed out, a cluster without a master for a slot, a slot on the move);
callers turn them into ``IndexUnavailable``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

CLUSTER_SUFFIX = "+cluster"
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)

MAX_CONNECTIONS = 64  # per process, single server: more concurrent calls wait for a free one
# Per process and cluster node. The cluster client has no blocking pool: a call beyond this
# fails at once (IndexUnavailable: that request is routed by load only), so it is larger.
CLUSTER_MAX_CONNECTIONS = 256


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].endswith(CLUSTER_SUFFIX)


def make_client(url: str, timeout_s: float = 2.0) -> Any:
    """A ``redis.asyncio.Redis`` or ``RedisCluster`` for ``url`` (see the module docstring);
    both run the same commands on keys of one slot, scripts and pipelines included. Raises
    ``ValueError`` for TLS parameters in a URL without TLS."""
    scheme, _, rest = url.partition("://")
    tls_params = [name for name in parse_qs(urlsplit(url).query) if name.startswith("ssl_")]
    if tls_params and not scheme.startswith("rediss"):
        raise ValueError(f"{', '.join(tls_params)}: TLS parameters in a {scheme}:// URL (no TLS)")
    if is_cluster_url(url):
        # On a connection error, a cluster that is down or a slot not covered, the client
        # relearns the slots and tries once more (redirections are followed regardless).
        # redis-py's default is 10 more tries, each of a pipeline after 0.25 s: a lookup
        # would stall for seconds while a master fails over, where failing it routes that
        # request by load at once; the next call after the failover finds the new master.
        return aioredis.RedisCluster.from_url(
            f"{scheme.removesuffix(CLUSTER_SUFFIX)}://{rest}",
            max_connections=CLUSTER_MAX_CONNECTIONS,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
    # A blocking pool: with more concurrent calls than connections a call waits (up to
    # timeout_s) for one, where the default pool fails it at once ("Too many connections"),
    # which at 256 concurrent requests turned prefix routing off.
    # One retry on a connection error: after a Redis restart every idle pooled connection is
    # closed by the server, and without it each failed its next call once (a prefix lookup
    # routed by load only, a worker's index write put off until the next check). The retry
    # reconnects; with Redis down it fails as fast as the first try (connection refused), and
    # a timeout is not retried (a hung Redis would double every wait).
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    return aioredis.Redis.from_pool(pool)
