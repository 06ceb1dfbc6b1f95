"""Real redis-servers as ``pdserve up`` starts them, password-protected, and the KV tier's
chunks in one: a client without the password is refused, the password is on no command line,
and a chunk is loaded only if a worker with the deployment secret stored it (the LMCache
storage stack of tests/unit/test_kv_tier_integrity.py, over Redis instead of a directory)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kv_transfer.tier_integrity import REJECTIONS
from pdserve.cluster.redis_server import (
    USER,
    RedisServer,
    answers,
    redacted,
    write_acl,
)
from pdserve.cluster.supervisor import ChildSpec
from pdserve.cluster.up import redis_spec
from tests.helpers import redis_process
from tests.unit.test_kv_tier_integrity import Worker, key, secret, worker_env
from tests.unit.test_kv_tier_integrity import loop as loop  # a fixture: LMCache's event loop

PASSWORD = "0123456789abcdef-not-on-any-command-line"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(password=PASSWORD) as server:
        yield server


def test_a_client_without_the_password_may_only_ping(server: RedisServer) -> None:
    anonymous = redis.Redis.from_url(redacted(server.url), socket_timeout=5)
    wrong = redis.Redis(port=server.port, username=USER, password="guess", socket_timeout=5)
    admitted = redis.Redis.from_url(server.url, socket_timeout=5)
    try:
        assert anonymous.ping(), "liveness probes need no credentials"
        for call in (lambda: anonymous.set("k", "v"), lambda: anonymous.get("k"),
                     lambda: anonymous.keys("*"), lambda: anonymous.flushall()):  # fmt: skip
            with pytest.raises(redis.exceptions.NoPermissionError):
                call()
        with pytest.raises(redis.exceptions.AuthenticationError):
            wrong.ping()
        assert admitted.set("k", "v") and admitted.get("k") == b"v"
        assert admitted.acl_whoami() == USER
    finally:
        for client in (anonymous, wrong, admitted):
            client.close()
    assert answers(server.port, PASSWORD) and not answers(server.port)


def test_up_s_redis_child_keeps_the_password_off_its_command_line(tmp_path: Path) -> None:
    acl_file, specs = write_acl(tmp_path / "acl", PASSWORD), list[ChildSpec]()

    def argv(port: int) -> list[str]:
        specs.append(redis_spec(port, password=PASSWORD, acl_file=acl_file))
        return list(specs[-1].argv)

    with redis_process(argv, PASSWORD) as (port, process):
        spec = specs[-1]
        assert asyncio.run(spec.ready_check()), "up's readiness check logs in"  # type: ignore[misc]
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert PASSWORD.encode() not in cmdline, "what `ps` shows every user"
        assert PASSWORD not in (tmp_path / "acl").read_text()
        anonymous = redis.Redis(port=port, socket_timeout=5)
        with pytest.raises(redis.exceptions.NoPermissionError):
            anonymous.set("k", "v")
        anonymous.close()


@pytest.fixture
def tier_url(server: RedisServer) -> str:
    return server.url  # the tier's URL as workers get it: with the password


def test_a_chunk_in_the_redis_tier_loads_only_if_a_worker_with_the_secret_stored_it(
    tmp_path: Path, server: RedisServer, tier_url: str, loop: asyncio.AbstractEventLoop
) -> None:
    ours = secret(tmp_path / "secret", "a" * 64)
    made: list[Worker] = []

    def worker(env: dict[str, str]) -> Worker:
        made.append(Worker(env, loop))
        return made[-1]

    try:
        a, b = (
            worker(worker_env(tier_url, ours, "redis")),
            worker(worker_env(tier_url, ours, "redis")),
        )
        data = a.store(key(0), seed=3)
        assert b.lookup(key(0)) == 1
        got = b.retrieve(key(0))
        assert got is not None and got.equal(data)

        # Someone with the Redis password but not the deployment secret: LMCache without
        # pdserve's plugin, and raw writes over a genuine chunk.
        stock = worker({**worker_env(tier_url, "", "redis"), "LMCACHE_REMOTE_STORAGE_PLUGINS": "",
                        "LMCACHE_REMOTE_URL": tier_url})  # fmt: skip
        stock.store(key(1), seed=4)
        client = redis.Redis.from_url(tier_url, socket_timeout=5)
        name = key(0).to_string()
        raw = bytearray(client.get(name + "kv_bytes"))  # type: ignore[arg-type]
        raw[len(raw) // 2] ^= 0xFF
        client.set(name + "kv_bytes", bytes(raw))
        client.close()
        c = worker(worker_env(tier_url, ours, "redis"))  # a fresh worker: nothing cached yet
        before = REJECTIONS.total
        assert c.lookup(key(1)) == 0 and c.retrieve(key(1)) is None
        assert c.lookup(key(0)) == 0 and c.retrieve(key(0)) is None
        assert REJECTIONS.total >= before + 4

        # A worker that has the secret but not the Redis password reads and writes nothing.
        outsider = worker(worker_env(redacted(tier_url), ours, "redis"))
        assert outsider.lookup(key(0)) == 0
        with pytest.raises(Exception, match=r"NOPERM|permission"):
            outsider.store(key(2), seed=5)
    finally:
        for w in made:
            w.close()
