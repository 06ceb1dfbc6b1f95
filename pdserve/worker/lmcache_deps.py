"""Does LMCache, the second KV tier (docs/kv-tier.md), import completely?

LMCache is installed without dependency resolution (requirements/kv-tier.txt says why), so a
missing package shows only when the module needing it is imported, and LMCache imports its
remote backends lazily: when one fails it logs an error and keeps the engine running without
the tier ("degraded mode (recompute)"). The install steps (Makefile, Dockerfiles) therefore
import every module the tier loads and fail loudly: ``python -m pdserve.worker.lmcache_deps``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from importlib import metadata

INSTALL_HINT = "pip install --no-deps -r requirements/kv-tier.txt (make install does)"

# What every tier loads, then what each backend adds (the tier kinds of --kv-tier).
COMMON = (
    "lmcache.v1.cache_engine",
    "lmcache.v1.storage_backend",  # local CPU and disk backends (aiofile, caio)
    "lmcache.integration.vllm.vllm_v1_adapter",  # what vLLM's LMCache connector loads
)
BACKENDS: dict[str, tuple[str, ...]] = {
    "cpu": (),
    "disk": (),
    "redis": ("lmcache.v1.storage_backend.connector.redis_connector",),
    "fs": ("lmcache.v1.storage_backend.connector.fs_connector",),
    "lm": ("lmcache.v1.storage_backend.connector.lm_connector",),
}


def modules(kinds: Iterable[str] = BACKENDS) -> list[str]:
    """The modules the given tier kinds need, common ones first ("off" needs none)."""
    wanted = [kind for kind in kinds if kind != "off"]
    if not wanted:
        return []
    return [*COMMON, *(m for kind in wanted for m in BACKENDS[kind])]


def problems(kinds: Iterable[str] = BACKENDS) -> list[str]:
    """One line per module that does not import: the module, its error."""
    found = []
    for name in modules(kinds):
        try:
            importlib.import_module(name)
        except Exception as exc:  # an ImportError, or whatever a half-installed package raises
            found.append(f"{name}: {type(exc).__name__}: {exc}")
    return found


def main(argv: list[str] | None = None) -> int:
    """Check the tier kinds named in ``argv`` (default: all); 0 when every module imports."""
    kinds = argv if argv is not None else sys.argv[1:]
    unknown = [kind for kind in kinds if kind not in BACKENDS and kind != "off"]
    if unknown:
        print(f"unknown tier kind(s) {unknown}; known: {sorted(BACKENDS)}", file=sys.stderr)
        return 2
    kinds = kinds or list(BACKENDS)
    found = problems(kinds)
    if found:
        print("LMCache (the KV tier) does not import completely:", file=sys.stderr)
        for line in found:
            print(f"  {line}", file=sys.stderr)
        print(f"Install it with: {INSTALL_HINT}", file=sys.stderr)
        return 1
    version = metadata.version("lmcache")
    print(f"LMCache {version}: every module of the KV tier imports ({', '.join(kinds)})")
    return 0


if __name__ == "__main__":
    # LMCache logs its device detection and plugin discovery at INFO on import. Only here, in
    # a process of its own: set by main(), it stayed in a caller's environment (the test run
    # then started workers whose LMCache logged nothing below WARNING).
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    sys.exit(main())
