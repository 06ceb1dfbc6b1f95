"""The deployment secret file: creation by ``pdserve up``, loading, and the gRPC token."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kv_transfer.auth import load_secret
from pdserve.cluster import up
from pdserve.rpc.auth import target, token, valid
from pdserve.rpc.secret import SECRET_FILE_ENV, is_loopback


def test_up_writes_a_fresh_owner_only_secret_and_passes_only_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    env = up.deployment_secret_env(tmp_path / "logs")
    path = Path(env[SECRET_FILE_ENV])
    assert path.parent == tmp_path / "logs"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = load_secret(path)
    assert secret is not None and len(secret) == 64
    assert secret.decode() not in str(env)
    again = up.deployment_secret_env(tmp_path / "logs")
    assert load_secret(again[SECRET_FILE_ENV]) != secret  # a new one per run


def test_up_uses_the_callers_secret_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = tmp_path / "mine"
    mine.write_text("x" * 32)
    monkeypatch.setenv(SECRET_FILE_ENV, str(mine))
    assert up.deployment_secret_env(tmp_path / "logs") == {SECRET_FILE_ENV: str(mine)}


def test_bad_secret_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_secret(tmp_path / "missing")
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="at least 16"):
        load_secret(short)
    assert load_secret("") is None


def test_grpc_tokens_are_per_rpc_and_expire() -> None:
    secret = b"s" * 32
    assert valid(secret, "Prefill", token(secret, "Prefill", now=1000), now=1100)
    assert not valid(secret, "Decode", token(secret, "Prefill", now=1000), now=1000)
    assert not valid(secret, "Prefill", token(secret, "Prefill", now=1000), now=1500)
    assert not valid(b"t" * 32, "Prefill", token(secret, "Prefill", now=1000), now=1000)
    assert not valid(secret, "Prefill", "garbage", now=1000)
    assert not valid(secret, "Prefill", None)


def test_grpc_tokens_bound_to_a_worker_open_only_that_worker() -> None:
    secret = b"s" * 32
    bound = token(secret, "Prefill", now=1000, worker_id="prefill-a.pod")
    assert target(bound) == "prefill-a.pod" and target(token(secret, "Prefill", now=1000)) == ""
    assert valid(secret, "Prefill", bound, now=1000, worker_id="prefill-a.pod")
    assert valid(secret, "Prefill", bound, now=1000)  # a server that knows no id of its own
    assert not valid(secret, "Prefill", bound, now=1000, worker_id="prefill-b")
    assert not valid(secret, "Decode", bound, now=1000, worker_id="prefill-a.pod")
    forged = bound.removesuffix("prefill-a.pod") + "prefill-b"  # the same HMAC, another name
    assert not valid(secret, "Prefill", forged, now=1000, worker_id="prefill-b")
    unbound = token(secret, "Prefill", now=1000)
    assert valid(secret, "Prefill", unbound, now=1000, worker_id="prefill-b")
    assert token(secret, "Prefill", now=1000, worker_id="pr\u00e9fill") == unbound  # not ASCII


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("")
