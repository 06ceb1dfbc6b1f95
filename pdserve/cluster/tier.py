"""``pdserve up`` with a second KV tier (docs/kv-tier.md): what each worker it starts is told,
and when it starts a tier Redis of its own.

``--kv-tier redis`` without ``--kv-tier-url`` gets a private redis-server for the tier, started
and supervised like the one for the prefix index, but with ``maxmemory`` and LRU eviction: the
tier is a cache whose chunks may go, while the index and the worker registry must never be
evicted, so the two never share a Redis and so never one memory limit. Like the index's, it
admits only clients with the password ``pdserve up`` writes next to the deployment secret
(``up.redis_password``; docs/kv-tier.md, "Redis: only clients with the password").
"""

from __future__ import annotations

from typing import Literal

from pdserve.worker import kv_tier
from pdserve.worker.config import WorkerSettings

TierKind = Literal["off", "cpu", "disk", "redis", "fs", "lm"]
GIB = 2**30
# What --kv-tier-url must name, where pdserve up has no default for it.
URL_NEEDED = {
    "disk": "a directory (each worker spills into a subdirectory of its own)",
    "fs": "a directory every worker can reach (they share it)",
    "lm": "lm://host:port of a running LMCache server",
}


def private_redis(kind: str, url: str) -> bool:
    """Whether ``pdserve up`` starts the tier's redis-server (redis and no URL given)."""
    return kind == "redis" and not url


def settings_problem(kind: str, url: str, redis_url: str) -> str | None:
    """Why these tier settings cannot work (the workers' own check, made before any of them
    starts), or None."""
    if kind == "off":
        return "--kv-tier-url needs --kv-tier" if url else None
    if kind == "cpu" and url:
        return "--kv-tier cpu keeps chunks in each worker's memory: it takes no --kv-tier-url"
    if kind in URL_NEEDED and not url:
        return f"--kv-tier {kind} needs --kv-tier-url: {URL_NEEDED[kind]}"
    if private_redis(kind, url):
        return None
    worker = WorkerSettings.model_construct(kv_tier=kind, kv_tier_url=url, redis_url=redis_url)
    try:
        kv_tier.tier_url(worker)
    except kv_tier.TierConfigError as exc:
        return str(exc)
    return None


def worker_flags(kind: str, url: str, cpu_gib: float, worker: str) -> list[str]:
    """The tier flags of worker ``worker`` ("prefill-0", ...); none with the tier off."""
    if kind == "off":
        return []
    if kind == "disk":  # LMCache's disk backend belongs to one process: a directory each
        url = f"{url.rstrip('/')}/{worker}"
    flags = ["--kv-tier", kind, "--kv-tier-cpu-gib", f"{cpu_gib:g}"]
    return [*flags, "--kv-tier-url", url] if url else flags


def maxmemory_bytes(gib: float) -> int:
    return int(gib * GIB)
