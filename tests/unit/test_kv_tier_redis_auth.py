"""``pdserve up``'s private Redis servers (the prefix index's and the KV tier's) admit only
clients with a password that up writes next to the deployment secret, and that password
reaches the workers and the gateway in their Redis URLs without appearing on a command line
or in the supervisor's log (tests/integration/test_kv_tier_redis_auth.py runs the servers)."""

from __future__ import annotations

import argparse
import stat
from pathlib import Path

import pytest

from decode_service.config import DecodeSettings
from gateway.config import GatewaySettings
from pdserve import settings as shared
from pdserve.cli.main import build_parser
from pdserve.cluster.redis_server import USER, has_credentials, redacted, with_credentials
from pdserve.cluster.up import (
    UpSettings,
    add_arguments,
    build_specs,
    credentials_env,
    private_redis_specs,
    redis_password,
)
from pdserve.worker import kv_tier
from prefill_service.config import PrefillSettings

SETTINGS = {"prefill": PrefillSettings, "decode": DecodeSettings, "gateway": GatewaySettings}


def parse(*argv: str) -> UpSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return shared.from_args(UpSettings, parser.parse_args(argv))


@pytest.fixture
def redis_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")


def test_the_password_is_written_next_to_the_secret_readable_by_its_owner_only(
    tmp_path: Path,
) -> None:
    password, acl = redis_password(parse("--kv-tier", "redis"), tmp_path)
    assert password and len(password) >= 32
    assert (tmp_path / "redis-password").read_text().strip() == password
    assert acl == tmp_path / "redis-users.acl"
    for path in (tmp_path / "redis-password", acl):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    text = acl.read_text()
    assert password not in text, "the ACL file holds only the password's SHA-256"
    assert "user default on nopass -@all +ping" in text and f"user {USER} on #" in text
    assert redis_password(parse("--redis-url", "redis://ext:6379/0"), tmp_path) == (None, None)


@pytest.mark.usefixtures("redis_installed")
def test_no_password_on_a_command_line_or_in_a_childs_logged_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    given = parse("--prefill", "2", "--kv-tier", "redis")
    password, acl = redis_password(given, tmp_path)
    assert password is not None
    s, redis = private_redis_specs(given, password, acl)
    assert has_credentials(s.redis_url) and has_credentials(s.kv_tier_url)
    assert redacted(s.redis_url).startswith("redis://127.0.0.1:") and password not in redacted(
        s.kv_tier_url
    )
    specs, _ = build_specs(s, gpus=[], cores=[0, 1])
    for spec in [*redis, *specs]:
        shown = " ".join(spec.argv) + " " + " ".join(f"{k}={v}" for k, v in spec.env.items())
        assert password not in shown, f"{spec.name}: the password shows in `ps` or in its log"
    for spec in redis:
        assert spec.argv[spec.argv.index("--aclfile") + 1] == str(acl)

    # What the children get instead: up's own environment, which they inherit.
    env = credentials_env(s)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for spec in specs:
        role = spec.argv[3]
        args = build_parser(role).parse_args(list(spec.argv[3:]))
        got = shared.from_args(SETTINGS[role], args)  # type: ignore[arg-type]
        assert got.redis_url == s.redis_url, spec.name
        if role != "gateway":
            assert got.kv_tier_url == s.kv_tier_url, spec.name
            assert password not in kv_tier.identity(got), "capabilities carry no credentials"


def test_urls_without_a_password_stay_on_the_command_line_and_external_ones_move(
    tmp_path: Path,
) -> None:
    plain = parse("--redis-url", "redis://10.0.0.9:6379/0")
    assert credentials_env(plain) == {}
    secret_url = with_credentials("redis://10.0.0.9:6379/0", "p@ss/word")
    assert secret_url == f"redis://{USER}:p%40ss%2Fword@10.0.0.9:6379/0"
    s = parse("--redis-url", secret_url, "--kv-tier", "redis", "--kv-tier-url", secret_url)
    specs, _ = build_specs(s, gpus=[], cores=[0, 1])
    assert all("p%40ss" not in " ".join(spec.argv) for spec in specs)
    assert set(credentials_env(s)) == {
        "PDSERVE_PREFILL_REDIS_URL", "PDSERVE_DECODE_REDIS_URL", "PDSERVE_GATEWAY_REDIS_URL",
        "PDSERVE_PREFILL_KV_TIER_URL", "PDSERVE_DECODE_KV_TIER_URL",
    }  # fmt: skip


def test_the_environment_names_are_the_settings_of_each_command() -> None:
    url = "redis://u:p@h:1/0"
    for name in credentials_env(
        parse("--redis-url", url, "--kv-tier", "redis", "--kv-tier-url", url)
    ):
        role = name.split("_")[1].lower()
        prefix = str(SETTINGS[role].model_config.get("env_prefix"))
        assert name.startswith(prefix) and name[len(prefix) :].lower() in (
            SETTINGS[role].model_fields
        ), name
