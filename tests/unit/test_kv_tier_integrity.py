"""The shared KV tier holds only what a worker with the deployment secret wrote.

Each "worker" here is LMCache's own storage stack (``CreateStorageBackends``: its local CPU
level and its remote backend) built from exactly the environment a pdserve worker gives its
engine (``kv_tier.lmcache_env``), over a shared ``fs`` tier in a temporary directory, with
LMCache's own memory objects and connectors: no engine, but every layer the engine's chunks
pass through between LMCache and the tier. A lookup is what the engine's lookup asks the tier
(``batched_contains``), a retrieval what it loads (``get_blocking``, ``batched_get_blocking``).
tests/integration/test_kv_tier_redis_auth.py does the same over a password-protected Redis.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend import CreateStorageBackends

from kv_transfer import tier_plugin
from kv_transfer.tier_integrity import REJECTIONS, RejectionLog
from kv_transfer.tier_record import Rejected, open_record, seal, tier_key
from pdserve.worker import kv_tier
from prefill_service.config import PrefillSettings

LAYERS, HEADS, HEAD_SIZE, CHUNK = 2, 2, 8, 16
MODEL = "SmolLM2-135M-Instruct#0123456789ab"  # as the CPU copier names it: model#compat digest


def metadata() -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.float32, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_SIZE),
        chunk_size=CHUNK, role="worker",
    )  # fmt: skip


def key(n: int) -> CacheEngineKey:
    return CacheEngineKey(MODEL, 1, 0, 0x5EED0000 + n, torch.float32)


def worker_env(url: str, secret_file: str, kind: str = "fs", **more: str) -> dict[str, str]:
    """The environment a pdserve worker gives its engine for this tier."""
    settings = PrefillSettings(port=50100, kv_tier=kind, kv_tier_url=url,  # type: ignore[arg-type]
                               kv_tier_cpu_gib=0.02, kv_tier_chunk_tokens=CHUNK)  # fmt: skip
    return {**kv_tier.lmcache_env(settings, secret_file), **more}


class Worker:
    """One worker's LMCache storage: LMCache's factory, configured from ``env`` alone."""

    def __init__(self, env: dict[str, str], loop: asyncio.AbstractEventLoop) -> None:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
        with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
            self.config = LMCacheEngineConfig.from_env()
            self.backends = CreateStorageBackends(self.config, metadata(), loop)
        self.local = self.backends["LocalCPUBackend"]
        remote = [b for name, b in self.backends.items() if name.startswith("RemoteBackend")]
        self.remote = remote[0] if remote else None

    def store(self, k: CacheEngineKey, seed: int) -> torch.Tensor:
        meta = metadata()
        obj = self.local.allocate(meta.get_shapes(), meta.get_dtypes())
        data = torch.randn(obj.tensor.shape, generator=torch.Generator().manual_seed(seed))
        obj.tensor.copy_(data)
        assert self.remote is not None
        self.remote.submit_put_task(k, obj).result(10)
        obj.ref_count_down()
        return data

    def lookup(self, *keys: CacheEngineKey) -> int:
        assert self.remote is not None
        return int(self.remote.batched_contains(list(keys)))

    def retrieve(self, k: CacheEngineKey) -> torch.Tensor | None:
        assert self.remote is not None
        one = self.remote.get_blocking(k)
        (batched,) = self.remote.batched_get_blocking([k])
        assert (one is None) == (batched is None)
        if one is None:
            return None
        assert batched is not None and torch.equal(one.tensor, batched.tensor)
        data = one.tensor.clone()
        one.ref_count_down()
        batched.ref_count_down()
        return data

    def close(self) -> None:
        # Only the local level: LMCache's RedisConnector.close waits, on LMCache's event loop,
        # for a coroutine on that same loop (pq_executor.shutdown(wait=True)) and never returns.
        self.local.close()


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def secret(path: Path, value: str) -> str:
    path.write_text(value + "\n")
    return str(path)


@pytest.fixture
def tier(tmp_path: Path) -> Path:
    return tmp_path / "tier"


@pytest.fixture
def workers(tmp_path: Path, tier: Path, loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    """``make()`` builds a worker of this deployment (same secret) or, with ``env``, another."""
    made: list[Worker] = []
    ours = secret(tmp_path / "secret", "a" * 64)

    def make(env: dict[str, str] | None = None) -> Worker:
        made.append(Worker(env or worker_env(str(tier), ours), loop))
        return made[-1]

    yield make
    for w in made:
        w.close()


def chunk_file(tier: Path, k: CacheEngineKey) -> Path:
    return tier / (k.to_string().replace("/", "-SEP-") + ".data")


def test_the_engine_environment_loads_the_authenticating_plugin_and_no_other_remote(
    tmp_path: Path, workers: Any
) -> None:
    env = worker_env("/shared/kv", str(tmp_path / "secret"))
    assert "LMCACHE_REMOTE_URL" not in env
    assert env["LMCACHE_REMOTE_STORAGE_PLUGINS"] == tier_plugin.PLUGIN
    assert env[tier_plugin.TIER_URL_ENV] == "fs://host:0/shared/kv"
    w = workers()
    assert [n for n in w.backends if n.startswith("RemoteBackend")] == ["RemoteBackend-pdserve"]
    assert "IntegrityConnector" in repr(w.remote.connection)


def test_a_chunk_stored_by_a_worker_with_the_secret_is_a_hit_for_another(
    tier: Path, workers: Any
) -> None:
    a, b = workers(), workers()
    data = [a.store(key(i), seed=i) for i in range(3)]
    assert chunk_file(tier, key(0)).is_file()
    assert b.lookup(key(0), key(1), key(2), key(3)) == 3, "the stored prefix, not the 4th"
    assert b.local.contains(key(0)), "a verified lookup leaves the chunk in the CPU level"
    for i in range(3):
        got = b.retrieve(key(i))
        assert got is not None and torch.equal(got, data[i])


def flip(path: Path, where: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[where] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "where", [-1, -40, 120, 60], ids=["tag", "last-payload-byte", "payload", "header"]
)
def test_a_chunk_with_one_byte_changed_is_a_miss(tier: Path, workers: Any, where: int) -> None:
    a, b = workers(), workers()
    a.store(key(0), seed=1)
    flip(chunk_file(tier, key(0)), where)
    before = REJECTIONS.total
    assert b.lookup(key(0)) == 0
    assert b.retrieve(key(0)) is None
    assert not b.local.contains(key(0)), "nothing of it reached the worker's CPU level"
    assert REJECTIONS.total > before, "counted"


def test_a_chunk_stored_without_pdserve_is_a_miss(tmp_path: Path, tier: Path, workers: Any) -> None:
    """Right key, no MAC: LMCache's own remote backend, as a process that has the tier's
    location but not pdserve's plugin (or not the secret) writes it."""
    stock = workers({**worker_env(str(tier), ""), "LMCACHE_REMOTE_STORAGE_PLUGINS": "",
                     "LMCACHE_REMOTE_URL": f"fs://host:0/{str(tier).lstrip('/')}"})  # fmt: skip
    assert stock.remote is not None and "Integrity" not in repr(stock.remote.connection)
    stock.store(key(0), seed=1)
    assert chunk_file(tier, key(0)).is_file()
    b = workers()
    assert b.lookup(key(0)) == 0
    assert b.retrieve(key(0)) is None


def test_a_chunk_sealed_with_another_secret_is_a_miss(
    tmp_path: Path, tier: Path, workers: Any
) -> None:
    """Right key, a well-formed record with the wrong MAC (another deployment's secret)."""
    other = workers(worker_env(str(tier), secret(tmp_path / "other", "b" * 64)))
    other.store(key(0), seed=1)
    assert other.lookup(key(0)) == 1, "its own deployment reads it"
    b = workers()
    assert b.lookup(key(0)) == 0
    assert b.retrieve(key(0)) is None


def test_a_genuine_chunk_moved_to_another_key_is_a_miss(tier: Path, workers: Any) -> None:
    """The MAC covers the key: a chunk of one prefix never serves as another's."""
    a, b = workers(), workers()
    a.store(key(0), seed=1)
    chunk_file(tier, key(7)).write_bytes(chunk_file(tier, key(0)).read_bytes())
    assert b.lookup(key(7)) == 0
    assert b.retrieve(key(7)) is None
    assert b.lookup(key(0)) == 1


def test_garbage_and_oversized_objects_are_misses_before_any_allocation(
    tier: Path, workers: Any
) -> None:
    b = workers()
    tier.mkdir(parents=True, exist_ok=True)
    chunk_file(tier, key(1)).write_bytes(os.urandom(4096))
    huge = RemoteMetadata(2**30, [torch.Size([2**30, 0, 0, 0])], [None],  # type: ignore[list-item]
                          MemoryFormat.BINARY_BUFFER)  # fmt: skip
    chunk_file(tier, key(2)).write_bytes(huge.serialize() + b"x" * 64)
    before = dict(REJECTIONS.by_reason)
    assert b.lookup(key(1)) == 0 and b.lookup(key(2)) == 0
    assert b.retrieve(key(1)) is None and b.retrieve(key(2)) is None
    new = {r for r, n in REJECTIONS.by_reason.items() if n > before.get(r, 0)}
    assert any(r.startswith("not a pdserve record") and "1073741824 B" in r for r in new), new


def test_a_record_opens_only_with_its_key_and_secret() -> None:
    """The record format alone (kv_transfer.tier_record)."""
    k = tier_key(b"s" * 32)
    payload = memoryview(bytes(range(256)) * 4)
    shapes, dtypes = [torch.Size([2, 1, 8, 16])], [torch.float32]
    record = seal(k, "m@1@0@ab@float32", payload, MemoryFormat.KV_2LTD, shapes, dtypes)
    opened = open_record(k, "m@1@0@ab@float32", memoryview(record))
    assert bytes(opened.payload) == bytes(payload) and opened.shapes == shapes
    assert tier_key(b"s" * 32) != tier_key(b"t" * 32)
    for name, key_, data in [
        ("m@1@0@ac@float32", k, record),  # another chunk's key
        ("m@1@0@ab@float32", tier_key(b"t" * 32), record),  # another secret
        ("m@1@0@ab@float32", k, record[:-1]),  # truncated
        ("m@1@0@ab@float32", k, bytes(payload)),  # not a record
    ]:
        with pytest.raises(Rejected):
            open_record(key_, name, memoryview(data))


def test_refused_chunks_are_counted_and_logged_at_most_once_a_minute() -> None:
    now = [100.0]
    lines: list[str] = []
    rejections = RejectionLog(60.0, clock=lambda: now[0], emit=lines.append)
    for i in range(5):
        rejections.note(f"k{i}", "authentication failed")
    now[0] += 61
    rejections.note("k5", "not a pdserve record")
    assert rejections.total == 6 and len(lines) == 2
    assert "refused 1 stored chunk(s)" in lines[0]
    assert "refused 5 stored chunk(s)" in lines[1] and "k5: not a pdserve record" in lines[1]
    assert rejections.by_reason == {"authentication failed": 5, "not a pdserve record": 1}


def test_without_the_secret_the_engine_has_no_shared_tier(tier: Path, workers: Any) -> None:
    """LMCache's side: the plugin refuses to start (pdserve's worker checks first, below)."""
    assert workers(worker_env(str(tier), "")).remote is None


def test_a_worker_without_the_secret_refuses_a_shared_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.rpc.secret import deployment_secret

    shared = PrefillSettings(port=50100, kv_tier="fs", kv_tier_url=str(tmp_path))  # type: ignore[arg-type]
    local = PrefillSettings(port=50100, kv_tier="cpu")  # type: ignore[arg-type]
    monkeypatch.delenv("PDSERVE_SECRET_FILE", raising=False)
    deployment_secret.cache_clear()
    try:
        with pytest.raises(kv_tier.TierConfigError, match="PDSERVE_SECRET_FILE"):
            kv_tier.check(shared)
        kv_tier.check(local)  # the worker's own memory: nothing to authenticate
        monkeypatch.setenv("PDSERVE_SECRET_FILE", secret(tmp_path / "secret", "c" * 64))
        deployment_secret.cache_clear()
        kv_tier.check(shared)
    finally:
        deployment_secret.cache_clear()


def test_the_user_extra_config_is_kept_and_lmcache_logs_no_credentials(tmp_path: Path) -> None:
    url = "redis://pdserve:hunter2-password@tier:6379/0"
    settings = PrefillSettings(port=50100, kv_tier="redis", kv_tier_url=url)  # type: ignore[arg-type]
    env = kv_tier.lmcache_env(settings, "/run/secret", '{"blocking_timeout_secs_x": 3}')
    assert env[tier_plugin.TIER_URL_ENV] == url
    lmcache_visible = {k: v for k, v in env.items() if k.startswith("LMCACHE_")}
    assert "hunter2" not in repr(lmcache_visible)
    extra = json.loads(env["LMCACHE_EXTRA_CONFIG"])
    assert extra["blocking_timeout_secs_x"] == 3
    assert extra[tier_plugin.SECRET_FILE_KEY] == "/run/secret"
    with pytest.raises(kv_tier.TierConfigError, match="JSON"):
        kv_tier.lmcache_env(settings, "/run/secret", "{not json")


@pytest.fixture
def lm_server() -> str:
    """LMCache's own server (``lm://``), in this process."""
    from lmcache.v1.server.__main__ import LMCacheServer

    server = LMCacheServer("127.0.0.1", 0, "cpu")  # binds (and listens) here
    threading.Thread(target=server.run, daemon=True).start()
    return f"lm://127.0.0.1:{server.server_socket.getsockname()[1]}"


def test_the_lmcache_server_tier_loads_only_what_a_worker_with_the_secret_stored(
    tmp_path: Path, lm_server: str, workers: Any
) -> None:
    ours = worker_env(lm_server, secret(tmp_path / "secret", "a" * 64), "lm")
    a, b = workers(ours), workers(ours)

    def stored(w: Worker, k: CacheEngineKey) -> None:
        """The server acknowledges no put: a get on the writer's own connection, which the
        server answers after the put before it, says the put has landed."""
        assert w.remote is not None
        obj = w.remote.get_blocking(k)
        if obj is not None:
            obj.ref_count_down()

    data = a.store(key(0), seed=1)
    stored(a, key(0))
    assert b.lookup(key(0)) == 1
    got = b.retrieve(key(0))
    assert got is not None and torch.equal(got, data)
    stock = workers({**worker_env(lm_server, "", "lm"), "LMCACHE_REMOTE_STORAGE_PLUGINS": "",
                     "LMCACHE_REMOTE_URL": lm_server})  # fmt: skip
    stock.store(key(1), seed=2)  # right key, no MAC
    stock.store(key(0), seed=3)  # over a genuine chunk
    stored(stock, key(0))
    c = workers(ours)
    assert c.lookup(key(1)) == 0 and c.retrieve(key(1)) is None
    assert c.lookup(key(0)) == 0 and c.retrieve(key(0)) is None
