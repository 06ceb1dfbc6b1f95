"""A private certificate authority for pdserve's internal mutual TLS (``pdserve.rpc.tls``).

``pdserve up`` makes a fresh one on every start and ``pdserve certs`` writes a set for docker
compose and Kubernetes; the Redis TLS tests use it too. Every certificate it issues is for
server and client use and names ``pdserve.rpc.tls.SERVER_NAME`` (the one name every internal
client checks, see that module) besides the process's own name. Keys are ECDSA P-256, made
and signed with ``cryptography``.

A set is written in the layout of a cert-manager Secret (``kubernetes.io/tls`` with the CA):
one directory per process, holding ``ca.crt``, ``tls.crt`` and ``tls.key`` (mode 0600). The
CA's own key is never written: it lives only while the set is made, so no file can mint
another certificate; to add a process, make a new set.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.rpc.tls import CA_FILE, CERT_FILE, KEY_FILE, SERVER_NAME

DEFAULT_VALID = datetime.timedelta(days=365)
# Tolerated clock skew between the machine making a set and the ones using it.
_BACKDATE = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class Issued:
    """One certificate and its key, both PEM; ``ca`` is the issuing CA's certificate."""

    ca: bytes
    cert: bytes
    key: bytes

    def write(self, directory: Path) -> Path:
        """``directory`` (mode 0700) with ``ca.crt``, ``tls.crt`` and ``tls.key`` (0600)."""
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        (directory / CA_FILE).write_bytes(self.ca)
        (directory / CERT_FILE).write_bytes(self.cert)
        _write_private(directory / KEY_FILE, self.key)
        return directory


class Authority:
    """A CA made in memory: ``issue`` signs certificates with it."""

    def __init__(
        self, common_name: str = "pdserve internal CA", valid: datetime.timedelta = DEFAULT_VALID
    ) -> None:
        self.valid = valid
        self._key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        self.cert = (
            _builder(self.name, self.name, self._key, self._key, valid)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_usage(cert_sign=True), critical=True)
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str, dns: Sequence[str] = (), ips: Sequence[str] = ()) -> Issued:
        """A certificate with common name ``name``, for server and client use, whose SANs are
        ``SERVER_NAME``, ``name`` (when it is a DNS name), ``dns`` and the IP addresses
        ``ips``."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        names = [SERVER_NAME, *([name] if _dns_name(name) else []), *dns]
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dict.fromkeys(names)]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        cert = (
            _builder(subject, self.name, key, self._key, self.valid)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_usage(cert_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return Issued(self.cert_pem, cert.public_bytes(serialization.Encoding.PEM), key_pem)


def write_set(
    directory: Path, names: Sequence[str], valid: datetime.timedelta = DEFAULT_VALID
) -> dict[str, Path]:
    """A fresh CA and one certificate per name of ``names``, each in ``directory/<name>/``
    (``Issued.write``); returns each name's directory."""
    bad = [n for n in names if not n or "/" in n or n.startswith(".")]
    if bad or len(set(names)) != len(names):
        raise ValueError(f"process names must be distinct, non-empty file names: {list(names)}")
    ca = Authority(valid=valid)
    directory.mkdir(parents=True, exist_ok=True)
    return {name: ca.issue(name).write(directory / name) for name in names}


def _write_private(path: Path, data: bytes) -> None:
    # Created 0600, never briefly readable by others (a chmod after write_bytes would be).
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)


def _dns_name(name: str) -> bool:
    """True for a name a DNS SAN can hold (letters, digits, '-', '.'), not an IP address."""
    try:
        ipaddress.ip_address(name)
        return False
    except ValueError:
        return bool(name) and all(c.isascii() and (c.isalnum() or c in "-.") for c in name)


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer_key: ec.EllipticCurvePrivateKey,
    valid: datetime.timedelta,
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    public = key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + valid)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    )


def _usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign,
        crl_sign=cert_sign, encipher_only=False, decipher_only=False,
    )  # fmt: skip
