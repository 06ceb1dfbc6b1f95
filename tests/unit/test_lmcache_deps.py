"""The install-time check of the KV tier's LMCache: which modules, and a loud failure."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import get_args

import pytest

from pdserve.worker import lmcache_deps
from pdserve.worker.config import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]


def test_every_tier_kind_of_the_worker_is_known() -> None:
    kinds = set(get_args(WorkerSettings.model_fields["kv_tier"].annotation))
    assert kinds - {"off"} == set(lmcache_deps.BACKENDS)


def test_modules_per_kind() -> None:
    assert lmcache_deps.modules(["off"]) == []
    assert lmcache_deps.modules(["cpu"]) == list(lmcache_deps.COMMON)
    fs = lmcache_deps.modules(["fs"])
    assert fs[: len(lmcache_deps.COMMON)] == list(lmcache_deps.COMMON)
    assert fs[-1] == "lmcache.v1.storage_backend.connector.fs_connector"
    every = lmcache_deps.modules()
    assert {"lmcache.v1.storage_backend.connector.redis_connector", *fs} <= set(every)


def _imports(monkeypatch: pytest.MonkeyPatch, broken: dict[str, Exception]) -> list[str]:
    seen: list[str] = []

    def fake(name: str) -> ModuleType:
        seen.append(name)
        if name in broken:
            raise broken[name]
        return ModuleType(name)

    monkeypatch.setattr(lmcache_deps, "importlib", SimpleNamespace(import_module=fake))
    monkeypatch.setattr(lmcache_deps.metadata, "version", lambda name: "0.5.6")
    return seen


def test_a_missing_backend_dependency_fails_loudly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fs = "lmcache.v1.storage_backend.connector.fs_connector"
    seen = _imports(monkeypatch, {fs: ModuleNotFoundError("No module named 'aiofiles'")})
    assert lmcache_deps.main([]) == 1
    err = capsys.readouterr().err
    assert f"{fs}: ModuleNotFoundError: No module named 'aiofiles'" in err
    assert "pip install --no-deps -r requirements/kv-tier.txt" in err
    assert set(seen) == set(lmcache_deps.modules()), "every module is tried, not just up to one"


def test_other_errors_on_import_count_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _imports(monkeypatch, {"lmcache.v1.cache_engine": RuntimeError("half installed")})
    assert lmcache_deps.main(["cpu"]) == 1
    assert "RuntimeError: half installed" in capsys.readouterr().err


def test_only_the_named_kinds_are_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fs = "lmcache.v1.storage_backend.connector.fs_connector"
    seen = _imports(monkeypatch, {fs: ModuleNotFoundError("No module named 'aiofiles'")})
    assert lmcache_deps.main(["redis"]) == 0
    assert fs not in seen
    assert "LMCache 0.5.6: every module of the KV tier imports (redis)" in capsys.readouterr().out


def test_the_check_leaves_the_callers_environment_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("LMCACHE_LOG_LEVEL", raising=False)
    _imports(monkeypatch, {})
    before = dict(os.environ)
    assert lmcache_deps.main(["cpu"]) == 0
    assert dict(os.environ) == before
    capsys.readouterr()


def test_unknown_kind_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert lmcache_deps.main(["s3"]) == 2
    assert "unknown tier kind" in capsys.readouterr().err


def test_the_pins_install_without_resolution_and_name_every_package() -> None:
    """The requirements file is what the Makefile and the images install with --no-deps."""
    lines = (ROOT / "requirements" / "kv-tier.txt").read_text().splitlines()
    pins = dict(
        line.split("#", 1)[0].strip().split("==")
        for line in lines
        if line.strip() and not line.startswith("#")
    )
    assert pins["lmcache"] == "0.5.6"
    assert {"sortedcontainers", "aiofile", "caio", "aiofiles", "redis"} <= set(pins)
    assert all(version[0].isdigit() for version in pins.values()), "exact pins only"
    makefile = (ROOT / "Makefile").read_text()
    assert "$(PIP) install -q --no-deps -r $(KV_TIER_REQUIREMENTS)" in makefile
    assert "$(BIN)/python -m pdserve.worker.lmcache_deps" in makefile
