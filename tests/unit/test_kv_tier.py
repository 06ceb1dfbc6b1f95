"""Worker KV tier settings: where the tier lives, its identity, LMCache's environment, the
engine's connector configuration, and clear errors for settings that cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_transfer.compat import handoff_connector
from pdserve.worker import kv_tier
from pdserve.worker.engine import kv_transfer_config
from prefill_service.config import PrefillSettings


def settings(**kw: object) -> PrefillSettings:
    return PrefillSettings(port=50100, **kw)  # type: ignore[arg-type]


def test_redis_tier_defaults_to_the_next_database_of_the_index_redis() -> None:
    s = settings(kv_tier="redis", redis_url="redis://10.0.0.5:6379/0")
    assert kv_tier.tier_url(s) == "redis://10.0.0.5:6379/1"
    assert kv_tier.identity(s) == "redis:10.0.0.5:6379/1"
    assert kv_tier.tier_url(settings(kv_tier="redis", redis_url="redis://h:1")) == "redis://h:1/1"


def test_identity_hides_credentials_and_is_empty_for_private_tiers() -> None:
    s = settings(kv_tier="redis", kv_tier_url="redis://user:secret@tier:6380/2")
    assert kv_tier.identity(s) == "redis:tier:6380/2"
    assert kv_tier.identity(settings(kv_tier="cpu")) == ""
    assert kv_tier.identity(settings(kv_tier="disk", kv_tier_url="/var/kv")) == ""
    assert kv_tier.identity(settings(kv_tier="fs", kv_tier_url="/shared/kv/")) == "fs:/shared/kv"


def test_lmcache_environment_of_each_tier(tmp_path: Path) -> None:
    assert kv_tier.lmcache_env(settings()) == {}
    env = kv_tier.lmcache_env(settings(kv_tier="redis", redis_url="redis://h:1/0",
                                       kv_tier_cpu_gib=0.5, kv_tier_chunk_tokens=512))  # fmt: skip
    # The location reaches pdserve's authenticating plugin, not LMCache's configuration
    # (tests/unit/test_kv_tier_integrity.py).
    assert "LMCACHE_REMOTE_URL" not in env
    assert env["PDSERVE_KV_TIER_REMOTE_URL"] == "redis://h:1/1"
    assert env["LMCACHE_REMOTE_STORAGE_PLUGINS"] == "pdserve"
    assert env["LMCACHE_CHUNK_SIZE"] == "512"
    assert env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "0.5"
    assert env["LMCACHE_PRE_CACHING_HASH_ALGORITHM"] == "sha256_cbor"
    assert "LMCACHE_REMOTE_STORAGE_PLUGINS" not in kv_tier.lmcache_env(settings(kv_tier="cpu"))
    disk = kv_tier.lmcache_env(settings(kv_tier="disk", kv_tier_url=f"{tmp_path}/kv"))
    assert disk["LMCACHE_LOCAL_DISK"] == f"file://{tmp_path}/kv"


def test_the_disk_tier_directory_is_the_workers_alone(tmp_path: Path) -> None:
    """Its chunks carry no MAC: a directory others may write is refused, a new one is 0700."""
    made = tmp_path / "new" / "kv"
    kv_tier.lmcache_env(settings(kv_tier="disk", kv_tier_url=str(made)))
    assert made.stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(kv_tier.TierConfigError, match="writable by other users"):
        kv_tier.lmcache_env(settings(kv_tier="disk", kv_tier_url=str(shared)))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"kv_tier": "redis"}, "needs --kv-tier-url or --redis-url"),
        ({"kv_tier": "redis", "kv_tier_url": "http://x"}, "must be redis://"),
        ({"kv_tier": "lm", "kv_tier_url": "redis://x"}, "lm://host:port"),
        ({"kv_tier": "fs"}, "needs --kv-tier-url <directory>"),
        ({"kv_tier": "cpu", "kv_tier_chunk_tokens": 100}, "multiple of 16"),
    ],
)
def test_settings_that_cannot_work_are_refused_before_the_engine_starts(
    kw: dict[str, object], message: str
) -> None:
    with pytest.raises(kv_tier.TierConfigError, match=message):
        kv_tier.check(settings(**kw))


def test_engine_connector_is_the_handoff_alone_or_a_multiconnector_with_the_tier() -> None:
    plain = kv_transfer_config(settings(), engine_id="p0")
    assert plain.kv_connector == "PdserveConnector"
    tiered = kv_transfer_config(settings(kv_tier="cpu"), engine_id="p0")
    assert tiered.kv_connector == "MultiConnector"
    assert tiered.engine_id == "p0" and tiered.kv_role == "kv_producer"
    children = tiered.kv_connector_extra_config["connectors"]
    assert [c["kv_connector"] for c in children] == ["PdserveConnector", "PdserveTierConnector"]
    assert children[0]["kv_connector_extra_config"]["kv_port"] == settings().kv_port
    # What the worker reports (and its abort/release path keys on) is the hand-off connector.
    assert handoff_connector(tiered) == handoff_connector(plain) == "PdserveConnector"


class Lookups:
    """LMCache's synchronous lookup client as the scheduler side sees it: a result per id
    until the request is scheduled (-1: none)."""

    def __init__(self, **found: int) -> None:
        self.found = dict(found)

    def lookup_cache(self, lookup_id: str) -> int:
        return self.found.get(lookup_id, -1)

    def clear_lookup_status(self, lookup_id: str) -> None:
        self.found.pop(lookup_id, None)


def test_lookups_of_requests_that_never_ran_reach_the_worker_across_processes() -> None:
    """The scheduler side names them in the next step's metadata, which reaches the worker
    pickled (vLLM's executor), and the worker unpins each; tests/e2e/test_tier_lookup_pins.py
    shows the pins on a real engine."""
    import pickle
    from types import SimpleNamespace

    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorMetadata

    from kv_transfer.lmcache_tier import PdserveTierConnector

    scheduler = object.__new__(PdserveTierConnector)
    scheduler._unpin = []
    scheduler._lmcache_engine = SimpleNamespace(
        lookup_client=Lookups(never_ran=64, ran=0), async_loading=False,
        load_specs={"never_ran": object()}, _requests_priority={"never_ran": 0},
        request_finished=lambda request, blocks: (False, None),
        build_connector_meta=lambda output: LMCacheConnectorMetadata(),
    )  # fmt: skip
    scheduler._lmcache_engine.lookup_client.clear_lookup_status("ran")  # it was scheduled
    for req_id in ("never_ran", "ran"):
        scheduler.request_finished(SimpleNamespace(request_id=req_id), [])
    assert scheduler._lmcache_engine.load_specs == {}
    assert scheduler._lmcache_engine._requests_priority == {}
    first = pickle.loads(pickle.dumps(scheduler.build_connector_meta(None)))
    second = pickle.loads(pickle.dumps(scheduler.build_connector_meta(None)))

    unpinned: list[str] = []
    worker = object.__new__(PdserveTierConnector)
    worker._lmcache_engine = SimpleNamespace(
        lmcache_engine=SimpleNamespace(lookup_unpin=unpinned.append),
        bind_connector_metadata=lambda meta: None,
    )
    worker.bind_connector_metadata(first)
    worker.bind_connector_metadata(second)
    assert unpinned == ["never_ran"]  # once, and only the request that never ran
