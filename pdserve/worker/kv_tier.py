"""The second KV tier (LMCache) of a worker: where it lives, how it is named, its settings.

With a tier, a worker's engine runs vLLM's ``MultiConnector`` over our ``PdserveConnector``
(first: the prefill→decode hand-off wins whenever it has blocks) and our LMCache connector
(``kv_transfer.lmcache_tier``). LMCache reads its settings from ``LMCACHE_*`` environment
variables in the engine process; pdserve sets the ones the tier needs and leaves every other
``LMCACHE_*`` variable the user set alone (they pass through).

A tier is *shared* when other workers can read what this one stored (redis, fs, lm); its
identity ``<backend>:<location>`` is reported in the worker's capabilities so that the gateway
can count a prefix held there as available to every worker with the same identity.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from pdserve.worker.config import WorkerSettings

SHARED = ("redis", "fs", "lm")
# LMCache hashes token chunks; the default uses Python's per-process hash(), so two
# processes would never find each other's chunks.
HASH_ALGORITHM = "sha256_cbor"


class TierConfigError(ValueError):
    """The tier settings cannot work (shown to the user as is)."""


def tier_url(settings: WorkerSettings) -> str:
    """The tier's location, with pdserve's defaults filled in ("" for cpu/off)."""
    kind, url = settings.kv_tier, settings.kv_tier_url
    if kind in ("off", "cpu"):
        return ""
    if kind == "redis":
        url = url or _next_db(settings.redis_url)
        if not url:
            raise TierConfigError("--kv-tier redis needs --kv-tier-url or --redis-url")
        if not url.startswith(("redis://", "rediss://")):
            raise TierConfigError(f"--kv-tier-url for redis must be redis://…, not {url!r}")
        return url
    if kind == "lm":
        if not url.startswith("lm://"):
            raise TierConfigError("--kv-tier lm needs --kv-tier-url lm://host:port")
        return url
    if not url:  # fs, disk: a directory
        raise TierConfigError(f"--kv-tier {kind} needs --kv-tier-url <directory>")
    return url


def _next_db(redis_url: str) -> str:
    """The index's Redis with the next database number: the tier's keys never mix with the
    index's (``redis://h:p`` and ``redis://h:p/0`` → ``redis://h:p/1``)."""
    if not redis_url:
        return ""
    parts = urlsplit(redis_url)
    db = parts.path.strip("/") or "0"
    if not db.isdigit():
        return ""
    return urlunsplit(parts._replace(path=f"/{int(db) + 1}"))


def identity(settings: WorkerSettings) -> str:
    """``<backend>:<location>`` of a shared tier (no credentials), "" otherwise."""
    if settings.kv_tier not in SHARED:
        return ""
    url = tier_url(settings)
    if settings.kv_tier == "fs":
        return f"fs:{url.rstrip('/')}"
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    path = parts.path.rstrip("/") or ("/0" if settings.kv_tier == "redis" else "")
    return f"{settings.kv_tier}:{host}{port}{path}"


def lmcache_env(settings: WorkerSettings) -> dict[str, str]:
    """The LMCACHE_* variables the engine process needs for the configured tier."""
    kind = settings.kv_tier
    if kind == "off":
        return {}
    url = tier_url(settings)
    env = {
        "LMCACHE_CHUNK_SIZE": str(settings.kv_tier_chunk_tokens),
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": f"{settings.kv_tier_cpu_gib:g}",
        "LMCACHE_PRE_CACHING_HASH_ALGORITHM": HASH_ALGORITHM,
        # The engine's step loop must not wait on a slow tier: stores run in the background.
        "LMCACHE_USE_LAYERWISE": "False",
    }
    if kind == "disk":
        env["LMCACHE_LOCAL_DISK"] = f"file://{url}"
        env["LMCACHE_MAX_LOCAL_DISK_SIZE"] = f"{max(settings.kv_tier_cpu_gib * 4, 1):g}"
    elif kind == "fs":
        env["LMCACHE_REMOTE_URL"] = f"fs://host:0/{url.lstrip('/')}"
        env["LMCACHE_REMOTE_SERDE"] = "naive"
    elif kind in ("redis", "lm"):
        env["LMCACHE_REMOTE_URL"] = url
        env["LMCACHE_REMOTE_SERDE"] = "naive"
    return env


def connector(role: str, gpu: bool) -> dict[str, object]:
    """KVTransferConfig fields of the tier's connector: ours on the CPU (LMCache has no CPU
    copier of its own), vLLM's stock LMCache connector on GPUs."""
    from kv_transfer import TIER_CONNECTOR_MODULE, TIER_CONNECTOR_NAME

    if gpu:
        return {"kv_connector": "LMCacheConnectorV1", "kv_role": role}
    return {
        "kv_connector": TIER_CONNECTOR_NAME,
        "kv_connector_module_path": TIER_CONNECTOR_MODULE,
        "kv_role": role,
    }


def check(settings: WorkerSettings) -> None:
    """Fail before the engine starts if the tier cannot work (bad settings, no LMCache)."""
    if settings.kv_tier == "off":
        return
    tier_url(settings)
    if settings.kv_tier_chunk_tokens % 16:
        raise TierConfigError("--kv-tier-chunk-tokens must be a multiple of 16")
    from pdserve.worker import lmcache_deps

    broken = lmcache_deps.problems([settings.kv_tier])
    if broken:
        raise TierConfigError(
            f"--kv-tier {settings.kv_tier} needs LMCache and its backend, which do not import "
            f"({broken[0]}); {lmcache_deps.INSTALL_HINT}"
        )
