"""The second KV tier (LMCache) of a worker: where it lives, how it is named, its settings.

With a tier, a worker's engine runs vLLM's ``MultiConnector`` over our ``PdserveConnector``
(first: the prefill→decode hand-off wins whenever it has blocks) and our LMCache connector
(``kv_transfer.lmcache_tier``). LMCache reads its settings from ``LMCACHE_*`` environment
variables in the engine process; pdserve sets the ones the tier needs and leaves every other
``LMCACHE_*`` variable the user set alone (they pass through).

A tier is *shared* when other workers can read what this one stored (redis, fs, lm); its
identity ``<backend>:<location>`` is reported in the worker's capabilities so that the gateway
can count a prefix held there as available to every worker with the same identity.

A shared tier is also storage other processes can write, so LMCache reaches it only through
pdserve's remote storage plugin (``kv_transfer.tier_integrity``), which authenticates every
chunk with the deployment secret: a worker without the secret refuses to start with a shared
tier. The tier's location (a Redis URL may hold a password) travels to the engine in
``TIER_URL_ENV``, never in LMCache's own configuration, which LMCache logs.
"""

from __future__ import annotations

import json
import os
from urllib.parse import urlsplit, urlunsplit

from kv_transfer import tier_plugin
from pdserve.worker.config import WorkerSettings

SHARED = ("redis", "fs", "lm")
# LMCache hashes token chunks; the default uses Python's per-process hash(), so two
# processes would never find each other's chunks.
HASH_ALGORITHM = "sha256_cbor"
EXTRA_CONFIG_ENV = "LMCACHE_EXTRA_CONFIG"
# LMCache's remote storage is pdserve's to configure (only through its authenticating plugin):
# the worker removes these from the engine's environment whenever it runs a tier.
REMOTE_ENV = ("LMCACHE_REMOTE_URL", "LMCACHE_REMOTE_STORAGE_PLUGINS")


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


def private_directory(path: str) -> None:
    """The ``disk`` tier's directory, made 0700 when missing; one that other users may write
    is refused: its chunks carry no MAC (the worker alone reads and writes them), so only the
    worker's own user may be able to put files there."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if info.st_mode & 0o022 or info.st_uid != os.getuid():
        raise TierConfigError(
            f"--kv-tier disk: {path} is writable by other users or owned by another one; the "
            "disk tier's chunks are not authenticated, so its directory must be the worker "
            "user's alone (chmod 700, or another --kv-tier-url)"
        )


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


def lmcache_env(
    settings: WorkerSettings, secret_file: str = "", extra_config: str = ""
) -> dict[str, str]:
    """The variables the engine process needs for the configured tier. ``secret_file`` is the
    deployment secret's path (shared tiers); ``extra_config`` the user's own
    ``LMCACHE_EXTRA_CONFIG`` (JSON), to which the plugin's entries are added."""
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
        private_directory(url)
        env["LMCACHE_LOCAL_DISK"] = f"file://{url}"
        env["LMCACHE_MAX_LOCAL_DISK_SIZE"] = f"{max(settings.kv_tier_cpu_gib * 4, 1):g}"
    elif kind in SHARED:
        env["LMCACHE_REMOTE_STORAGE_PLUGINS"] = tier_plugin.PLUGIN
        env["LMCACHE_REMOTE_SERDE"] = "naive"
        try:
            extra = json.loads(extra_config) if extra_config.strip() else {}
        except ValueError as exc:
            raise TierConfigError(f"{EXTRA_CONFIG_ENV} is not JSON: {exc}") from exc
        if not isinstance(extra, dict):
            raise TierConfigError(f"{EXTRA_CONFIG_ENV} must be a JSON object")
        extra.update(tier_plugin.plugin_config(secret_file))
        env[EXTRA_CONFIG_ENV] = json.dumps(extra)
        env[tier_plugin.TIER_URL_ENV] = f"fs://host:0/{url.lstrip('/')}" if kind == "fs" else url
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
    """Fail before the engine starts if the tier cannot work (bad settings, a shared tier
    without the deployment secret, no LMCache)."""
    from pdserve.rpc.secret import deployment_secret

    if settings.kv_tier == "off":
        return
    tier_url(settings)
    if settings.kv_tier_chunk_tokens % 16:
        raise TierConfigError("--kv-tier-chunk-tokens must be a multiple of 16")
    if settings.kv_tier in SHARED and deployment_secret() is None:
        raise TierConfigError(
            f"--kv-tier {settings.kv_tier} is shared with every process that can write the "
            "tier, and a worker loads only chunks authenticated with the deployment secret: "
            "set PDSERVE_SECRET_FILE (the same secret file on every worker; `pdserve up` "
            "writes one), or use --kv-tier cpu or disk"
        )
    from pdserve.worker import lmcache_deps

    broken = lmcache_deps.problems([settings.kv_tier])
    if broken:
        raise TierConfigError(
            f"--kv-tier {settings.kv_tier} needs LMCache and its backend, which do not import "
            f"({broken[0]}); {lmcache_deps.INSTALL_HINT}"
        )
