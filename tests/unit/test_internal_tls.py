"""The private CA of internal mutual TLS (``pdserve.rpc.ca``), the sets ``pdserve up`` and
``pdserve certs`` write, and reading them back (``pdserve.rpc.tls.load``)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509

from pdserve.cli.main import main
from pdserve.cluster import up
from pdserve.rpc import tls as rpc_tls
from pdserve.rpc.ca import write_set


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_a_set_is_one_ca_and_a_certificate_per_process_in_cert_managers_layout(
    tmp_path: Path,
) -> None:
    dirs = write_set(tmp_path, ["gateway", "prefill-0"])
    assert set(dirs) == {"gateway", "prefill-0"}
    cas = {(d / rpc_tls.CA_FILE).read_bytes() for d in dirs.values()}
    assert len(cas) == 1, "one CA signs the whole set"
    ca = _cert(dirs["gateway"] / rpc_tls.CA_FILE)
    for name, d in dirs.items():
        assert sorted(p.name for p in d.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
        assert stat.S_IMODE((d / rpc_tls.KEY_FILE).stat().st_mode) == 0o600
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        cert = _cert(d / rpc_tls.CERT_FILE)
        cert.verify_directly_issued_by(ca)
        identity = rpc_tls.load(d)
        assert identity.names == (rpc_tls.SERVER_NAME, name)
    assert not list(tmp_path.rglob("*ca.key")), "the CA's key is never written"


def test_load_names_the_bad_file(tmp_path: Path) -> None:
    d = write_set(tmp_path, ["decode-0"])["decode-0"]
    (d / rpc_tls.KEY_FILE).unlink()
    with pytest.raises(ValueError, match=r"tls\.key"):
        rpc_tls.load(d)
    (d / rpc_tls.KEY_FILE).write_text("not a key")
    with pytest.raises(ValueError, match="no valid PEM"):
        rpc_tls.load(d)


def test_up_makes_a_certificate_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(rpc_tls.TLS_DIR_ENV, raising=False)
    s = up.UpSettings(prefill=2, decode=1)
    env = up.tls_env(s, tmp_path / "logs")
    names = {"prefill-0", "prefill-1", "decode-0", "gateway", up.PROBE_IDENTITY}
    assert set(env) == names
    for name, child in env.items():
        assert child == {rpc_tls.TLS_DIR_ENV: str(tmp_path / "logs" / "tls" / name)}
        assert rpc_tls.load(child[rpc_tls.TLS_DIR_ENV]).names[1] == name
    before = rpc_tls.load(env["gateway"][rpc_tls.TLS_DIR_ENV]).ca
    up.tls_env(s, tmp_path / "logs")
    assert rpc_tls.load(env["gateway"][rpc_tls.TLS_DIR_ENV]).ca != before, "a new CA per run"
    assert up.tls_env(s.model_copy(update={"internal_tls": False}), tmp_path / "off") == {}
    assert not (tmp_path / "off").exists()


def test_up_uses_the_callers_tls_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = write_set(tmp_path / "mine", ["all"])["all"]
    monkeypatch.setenv(rpc_tls.TLS_DIR_ENV, str(mine))
    env = up.tls_env(up.UpSettings(), tmp_path / "logs")
    assert {child[rpc_tls.TLS_DIR_ENV] for child in env.values()} == {str(mine)}
    assert not (tmp_path / "logs" / "tls").exists()


def test_pdserve_certs_writes_a_set_and_keeps_an_existing_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["certs", str(tmp_path), "--names", "gateway,prefill,decode"]) == 0
    first = (tmp_path / "prefill" / rpc_tls.CERT_FILE).read_bytes()
    assert rpc_tls.load(tmp_path / "decode").names == (rpc_tls.SERVER_NAME, "decode")
    assert main(["certs", str(tmp_path)]) == 1
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "prefill" / rpc_tls.CERT_FILE).read_bytes() == first
    assert main(["certs", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "prefill" / rpc_tls.CERT_FILE).read_bytes() != first
    assert main(["certs", str(tmp_path / "x"), "--names", "a,a"]) == 2
