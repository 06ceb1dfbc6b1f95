"""pdserve up with a KV tier: the flags every worker gets, their validation, the tier Redis."""

from __future__ import annotations

import argparse
import itertools
import shutil
from pathlib import Path
from typing import get_args

import pytest
from pydantic import ValidationError

from decode_service.config import DecodeSettings
from pdserve import settings as shared
from pdserve.cli.main import build_parser
from pdserve.cluster import tier as up_tier
from pdserve.cluster.supervisor import ChildSpec
from pdserve.cluster.up import (
    UpSettings,
    add_arguments,
    build_specs,
    private_redis_specs,
    ready_banner,
)
from pdserve.worker import kv_tier
from pdserve.worker.config import WorkerSettings
from prefill_service.config import PrefillSettings


def parse(*argv: str) -> UpSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return shared.from_args(UpSettings, parser.parse_args(argv))


def workers(s: UpSettings) -> dict[str, ChildSpec]:
    specs, _ = build_specs(s, gpus=[], cores=[0, 1])
    return {spec.name: spec for spec in specs}


def tier_args(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The --kv-tier* flags of a worker's argv with their values, in order."""
    pairs = itertools.pairwise(argv)
    return tuple(
        item for flag, value in pairs if flag.startswith("--kv-tier") for item in (flag, value)
    )


def worker_settings(spec: ChildSpec) -> WorkerSettings:
    """The settings the real worker command builds from the argv up gives it."""
    role = spec.argv[3]
    cls = PrefillSettings if role == "prefill" else DecodeSettings
    args = build_parser(role).parse_args(list(spec.argv[3:]))
    return shared.from_args(cls, args)


def test_up_offers_exactly_the_worker_tier_kinds() -> None:
    worker = WorkerSettings.model_fields["kv_tier"].annotation
    assert get_args(up_tier.TierKind) == get_args(worker)
    assert UpSettings.model_fields["kv_tier"].annotation == up_tier.TierKind


def test_no_tier_flags_by_default() -> None:
    for spec in workers(parse()).values():
        assert not any(arg.startswith("--kv-tier") for arg in spec.argv), spec.name


def test_every_worker_names_the_same_shared_tier() -> None:
    url = "redis://10.0.0.5:6379/3"
    s = parse("--prefill", "2", "--decode", "2", "--kv-tier", "redis", "--kv-tier-url", url,
              "--kv-tier-cpu-gib", "0.5", "--redis-url", "redis://10.0.0.5:6379/0")  # fmt: skip
    specs = workers(s)
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        assert tier_args(specs[name].argv) == (
            "--kv-tier", "redis", "--kv-tier-cpu-gib", "0.5", "--kv-tier-url", url,
        )  # fmt: skip
    assert tier_args(specs["gateway"].argv) == (), "the gateway learns the tier from workers"
    identities = {kv_tier.identity(worker_settings(specs[n])) for n in specs if n != "gateway"}
    assert identities == {"redis:10.0.0.5:6379/3"}


def test_cpu_tier_passes_its_size_and_no_url() -> None:
    spec = workers(parse("--kv-tier", "cpu", "--kv-tier-cpu-gib", "4"))["decode-0"]
    assert tier_args(spec.argv) == ("--kv-tier", "cpu", "--kv-tier-cpu-gib", "4")
    worker = worker_settings(spec)
    assert (worker.kv_tier, worker.kv_tier_cpu_gib, worker.kv_tier_url) == ("cpu", 4.0, "")


def test_disk_tier_gives_each_worker_a_directory_of_its_own(tmp_path: Path) -> None:
    s = parse("--prefill", "2", "--kv-tier", "disk", "--kv-tier-url", f"{tmp_path}/")
    urls = {name: worker_settings(spec).kv_tier_url for name, spec in workers(s).items()
            if name != "gateway"}  # fmt: skip
    assert urls == {
        "prefill-0": f"{tmp_path}/prefill-0",
        "prefill-1": f"{tmp_path}/prefill-1",
        "decode-0": f"{tmp_path}/decode-0",
    }


def test_fs_tier_is_one_directory_for_all(tmp_path: Path) -> None:
    specs = workers(parse("--kv-tier", "fs", "--kv-tier-url", str(tmp_path)))
    urls = {worker_settings(specs[n]).kv_tier_url for n in ("prefill-0", "decode-0")}
    assert urls == {str(tmp_path)}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--kv-tier", "fs"), "--kv-tier fs needs --kv-tier-url: a directory every worker"),
        (("--kv-tier", "disk"), "--kv-tier disk needs --kv-tier-url"),
        (("--kv-tier", "lm"), "lm://host:port"),
        (("--kv-tier", "lm", "--kv-tier-url", "http://cache:65432"), "lm://host:port"),
        (("--kv-tier", "redis", "--kv-tier-url", "10.0.0.5:6379"), "must be redis://"),
        (("--kv-tier-url", "redis://x:6379/1"), "--kv-tier-url needs --kv-tier"),
        (("--kv-tier", "cpu", "--kv-tier-url", "/tmp/x"), "takes no --kv-tier-url"),
        (("--kv-tier", "cpu", "--kv-tier-cpu-gib", "0"), "greater than 0"),
    ],
)
def test_settings_that_cannot_work_are_refused_before_anything_starts(
    argv: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        parse(*argv)


def test_unknown_tier_kind_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit):
        parse("--kv-tier", "s3")


@pytest.fixture
def redis_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")


def _option(spec: ChildSpec, name: str) -> str | None:
    return spec.argv[spec.argv.index(name) + 1] if name in spec.argv else None


@pytest.mark.usefixtures("redis_installed")
def test_redis_tier_without_url_gets_a_private_evicting_redis() -> None:
    s, specs = private_redis_specs(parse("--kv-tier", "redis", "--kv-tier-redis-gib", "0.5"))
    index, tier = specs
    assert (index.name, tier.name) == ("redis", "tier-redis")
    assert _option(index, "--maxmemory") is None, "the index's Redis never evicts"
    assert _option(tier, "--maxmemory") == str(2**29)
    assert _option(tier, "--maxmemory-policy") == "allkeys-lru"
    assert tier.stop_stage == index.stop_stage, "stopped after the workers, like the index's"
    tier_port, index_port = _option(tier, "--port"), _option(index, "--port")
    assert tier_port != index_port
    assert s.redis_url == f"redis://127.0.0.1:{index_port}/0"
    assert s.kv_tier_url == f"redis://127.0.0.1:{tier_port}/0"
    for name, spec in workers(s).items():
        if name != "gateway":
            assert worker_settings(spec).kv_tier_url == s.kv_tier_url, name


@pytest.mark.usefixtures("redis_installed")
def test_private_tier_redis_also_next_to_an_external_index() -> None:
    given = parse("--kv-tier", "redis", "--redis-url", "redis://10.0.0.9:6379/0")
    s, specs = private_redis_specs(given)
    assert [spec.name for spec in specs] == ["tier-redis"]
    assert s.redis_url == given.redis_url and s.kv_tier_url.startswith("redis://127.0.0.1:")


@pytest.mark.usefixtures("redis_installed")
def test_no_tier_redis_when_the_tier_has_a_url_or_another_kind() -> None:
    url = "redis://tier.example:6379/0"
    s, specs = private_redis_specs(parse("--kv-tier", "redis", "--kv-tier-url", url))
    assert [spec.name for spec in specs] == ["redis"] and s.kv_tier_url == url
    _, specs = private_redis_specs(parse("--kv-tier", "cpu"))
    assert [spec.name for spec in specs] == ["redis"]
    _, specs = private_redis_specs(parse("--redis-url", "redis://10.0.0.9:6379/0"))
    assert specs == []


def test_ready_banner_names_the_tier() -> None:
    assert ", KV tier cpu" in ready_banner(parse("--kv-tier", "cpu"), Path("logs"))
    assert "KV tier" not in ready_banner(parse(), Path("logs"))
