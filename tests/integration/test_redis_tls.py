"""The registry and the prefix index over TLS, as the ACL user with a password: on a
redis-server that speaks only TLS (``rediss://``), and on a Redis Cluster of 3 masters with
one replica each whose nodes speak only TLS, to clients, on the cluster bus and from replica
to master (``rediss+cluster://``). A private CA and a certificate for 127.0.0.1 are made for
the module (``tests.certs``); the URLs name the CA in redis-py's ``ssl_ca_certs`` parameter.
Every test runs on both; a client without TLS, without the CA or with a wrong password is
refused."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from redis.asyncio import RedisCluster
from redis.asyncio.connection import SSLConnection

from pdserve.cluster.redis_cluster import LocalRedisCluster
from pdserve.cluster.redis_server import RedisServer, TlsFiles, with_credentials
from pdserve.kvindex.epochs import new_epoch
from pdserve.kvindex.interfaces import BlockOps, IndexUnavailable, WorkerRecord
from pdserve.kvindex.redis_store import RedisStore
from tests.certs import write_tls_files

M = "model-a"
PASSWORD = "tls secret: /@?"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return write_tls_files(Path(tmp_path_factory.mktemp("tls")))


@pytest.fixture(scope="module")
def server(tls: TlsFiles) -> Iterator[RedisServer]:
    with RedisServer(password=PASSWORD, tls=tls) as s:
        yield s


@pytest.fixture(scope="module")
def cluster(tls: TlsFiles) -> Iterator[LocalRedisCluster]:
    with LocalRedisCluster(masters=3, replicas=1, password=PASSWORD, tls=tls) as c:
        yield c


@pytest.fixture(params=["server", "cluster"])
def url(request: pytest.FixtureRequest) -> str:
    """The ``rediss://`` URL of the TLS server, or the ``rediss+cluster://`` one of the
    cluster: as the ACL user, with the CA."""
    store: RedisServer | LocalRedisCluster = request.getfixturevalue(request.param)
    return store.url


@asynccontextmanager
async def opened(url: str) -> AsyncIterator[RedisStore]:
    store = RedisStore(url, timeout_s=5.0)
    try:
        yield store
    finally:
        await store.close()


def connection_classes(store: RedisStore) -> set[type]:
    if isinstance(store.client, RedisCluster):
        return {node.connection_class for node in store.client.get_nodes()}
    return {store.client.connection_pool.connection_class}


async def test_the_registry_over_tls(url: str) -> None:
    epoch = new_epoch()
    async with opened(url) as store:
        await store.announce(WorkerRecord("p0", "prefill", "a:1", epoch, M), ttl_s=30)
        await store.announce(WorkerRecord("d0", "decode", "a:2", new_epoch(), M), ttl_s=30)
        assert {r.worker_id for r in await store.alive_workers()} >= {"p0", "d0"}
        assert await store.recorded_epoch("p0") == epoch
        await store.withdraw("p0")
        await store.withdraw("d0")
        assert {r.worker_id for r in await store.alive_workers()} & {"p0", "d0"} == set()
        assert connection_classes(store) == {SSLConnection}
        if isinstance(store.client, RedisCluster):
            assert len(store.client.get_primaries()) == 3


async def test_the_index_over_tls(url: str) -> None:
    workers = [f"w{i}" for i in range(64)]
    async with opened(url) as store:
        for i, w in enumerate(workers):
            assert await store.apply(M, w, [BlockOps(cleared=True, stored=range(i % 7))])
        got = await store.longest_prefixes(M, [0, 1, 2, 3, 4, 5], workers)
        assert got == {w: min(i % 7, 6) for i, w in enumerate(workers)}
        assert connection_classes(store) == {SSLConnection}
        if isinstance(store.client, RedisCluster):  # the index lies on every master
            keys = [store.keys.holder_blocks(M, w) for w in workers]
            masters = [store.client.get_node_from_key(k) for k in keys]
            assert len({m.port for m in masters if m is not None}) == 3 and None not in masters


async def test_a_client_without_tls_is_refused(url: str) -> None:
    """``redis://`` (``redis+cluster://``) to the TLS port: the server resets the connection
    (what the client sent first is no TLS handshake)."""
    plain = url.replace("rediss", "redis", 1).partition("?")[0]
    async with opened(plain) as store:
        with pytest.raises(IndexUnavailable):
            await store.registry_epoch()


async def test_a_client_without_the_ca_is_refused(url: str) -> None:
    """Without ``ssl_ca_certs`` the client checks the server against the system's CAs,
    which did not sign its certificate."""
    async with opened(url.partition("?")[0]) as store:
        with pytest.raises(IndexUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            await store.registry_epoch()


async def test_a_wrong_password_is_refused(url: str) -> None:
    async with opened(with_credentials(url, "wrong")) as store:
        with pytest.raises(IndexUnavailable, match="invalid username-password pair"):
            await store.registry_epoch()
