"""Mutual TLS between the gateway and the workers' gRPC servers.

Every process of a deployment reads its TLS identity from the directory named by
``PDSERVE_TLS_DIR``, in the layout cert-manager writes into a Secret: ``ca.crt`` (the private
CA every internal certificate is signed by), ``tls.crt`` (this process's certificate, chain
allowed) and ``tls.key`` (its key). When it is set:

* a worker's gRPC server (``pdserve.rpc.server.GrpcServer`` given the identity) listens with
  TLS only and requires a client certificate signed by ``ca.crt``: a client without one, with
  one from another CA, or in plain text fails the handshake, before any request reaches grpc's
  handlers (tests/integration/test_worker_mtls.py);
* every internal client (``pdserve.rpc.client.GrpcClient``, so the gateway's worker clients;
  ``pdserve up``'s readiness probes; the image's health check) dials with the same identity and
  accepts only a server certificate signed by ``ca.crt``.

``pdserve up`` makes a private CA and a certificate per process (``pdserve.rpc.ca``) in its log
directory; ``pdserve certs`` writes such a set for docker compose and Kubernetes, where
cert-manager can issue it instead (docs/deploy.md).

The deployment secret's tokens (``pdserve.rpc.auth``) are still checked inside the TLS
connection (defence in depth): TLS keeps the traffic from being read, altered or replayed on
the way; a leaked key and certificate without the secret, or the secret without a
certificate, opens no worker; and the tokens bind calls to one worker id.

**Hostname rule: one fixed name.** Clients check the server's certificate for the name
``SERVER_NAME`` ("pdserve-internal", ``grpc.ssl_target_name_override``), not for the host they
dialled. Workers are dialled by addresses nobody knows when certificates are made: pod IPs that
workers register in Redis on Kubernetes (cert-manager's Certificate cannot name them), compose
service names, 127.0.0.1 under ``pdserve up``. The trust boundary is the private CA, as it is
the deployment secret for the tokens: whoever holds a certificate of the deployment's CA with
that name is an internal process. Which worker answers is checked by the tokens' binding to
the worker id (``pdserve.rpc.auth``), not by TLS. Certificates from ``pdserve.rpc.ca`` also
carry the process's own name, so a deployment that wants per-host names can still see them.

**Rotation.** A worker's server reads its directory again at the first handshake after one of
its files changed (``ServerIdentityReload``, grpc's dynamic server credentials): a certificate
renewed in place (cert-manager updating the mounted Secret) serves new connections without
restarting the worker, whose engine and KV cache would be lost with it. A set that is not whole
yet (a key that does not match the certificate, a file half written) is not taken: the last good
identity goes on serving and the next change is tried again. Clients look at their directory
again at most once a second, when they start a call (``ClientIdentity``): after a change, the
gateway's worker clients open new channels with the new identity, and the old channels close
once the calls on them end. So a CA rotated under a running gateway (the workers restarted
with certificates of the new CA) costs no gateway restart.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

TLS_DIR_ENV = "PDSERVE_TLS_DIR"
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
# The name every internal server's certificate carries and every internal client checks.
SERVER_NAME = "pdserve-internal"
CHANNEL_OPTIONS = (("grpc.ssl_target_name_override", SERVER_NAME),)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsIdentity:
    """A process's CA, certificate and key (PEM bytes), as read by ``load``; ``names`` are
    the DNS names of its certificate."""

    ca: bytes
    cert: bytes
    key: bytes
    names: tuple[str, ...] = ()
    directory: str = ""

    def server_credentials(self) -> grpc.ServerCredentials:
        """TLS for a worker's server: clients must present a certificate of ``ca``. An identity
        read from a directory is read again when its files change (``ServerIdentityReload``)."""
        self.check_server_name()
        if not self.directory:
            return grpc.ssl_server_credentials(
                [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
            )
        return grpc.dynamic_ssl_server_credentials(
            self.server_configuration(), ServerIdentityReload(self), True
        )

    def server_configuration(self) -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(self.key, self.cert)], root_certificates=self.ca
        )

    def check_server_name(self) -> None:
        if SERVER_NAME not in self.names:
            raise ValueError(
                f"{self.directory}/{CERT_FILE} does not name {SERVER_NAME!r}, the name every "
                f"internal client checks: issue it with that DNS name (docs/deploy.md)"
            )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS for a client: trusts only ``ca``, presents this certificate."""
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def load(directory: str | Path) -> TlsIdentity:
    """The identity in ``directory``; ValueError naming the file when one is missing or is
    not PEM of its kind, or when the key is not the certificate's."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    base = Path(directory)
    data = {}
    for name in (CA_FILE, CERT_FILE, KEY_FILE):
        try:
            data[name] = (base / name).read_bytes()
        except OSError as exc:
            raise ValueError(f"{TLS_DIR_ENV}: cannot read {base / name}: {exc}") from exc
    try:
        x509.load_pem_x509_certificates(data[CA_FILE])
        cert = x509.load_pem_x509_certificates(data[CERT_FILE])[0]
        key = serialization.load_pem_private_key(data[KEY_FILE], password=None)
    except ValueError as exc:
        raise ValueError(f"{TLS_DIR_ENV}: {base} holds no valid PEM {CA_FILE}, "
                         f"{CERT_FILE} and unencrypted {KEY_FILE}: {exc}") from exc  # fmt: skip
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        # A set caught half rewritten (the certificate renewed, the key not yet), or a wrong key.
        raise ValueError(f"{TLS_DIR_ENV}: {base / KEY_FILE} is not the key of {base / CERT_FILE}")
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = tuple(sans.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        names = ()
    return TlsIdentity(data[CA_FILE], data[CERT_FILE], data[KEY_FILE], names, str(base))


def _stamp(directory: str) -> tuple[tuple[int, int, int], ...] | None:
    """What changes when a file of the identity is replaced or rewritten (a Secret volume swaps
    a symlink; a rewrite changes the size or time); None while one cannot be read."""
    try:
        stats = [os.stat(Path(directory) / name) for name in (CA_FILE, CERT_FILE, KEY_FILE)]
    except OSError:
        return None
    return tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in stats)


class IdentityWatch:
    """An identity read from a directory, read again when one of its files changed (inode,
    size or time) and the files form a whole, valid set again (``check``: a further test a
    set must pass); until then the last good identity holds."""

    def __init__(
        self, identity: TlsIdentity, check: Callable[[TlsIdentity], None] | None = None
    ) -> None:
        self.identity = identity
        self.check = check
        self.stamp = _stamp(identity.directory)
        self.generation = 0  # counts the identities taken after the first
        self.lock = threading.Lock()  # grpc calls a server's fetcher from several threads

    def fresh(self) -> TlsIdentity | None:
        """The directory's identity when it changed since the last look and is whole, else
        None (keep the current one)."""
        stamp = _stamp(self.identity.directory)
        with self.lock:
            if stamp is None or stamp == self.stamp:
                return None
            self.stamp = stamp
            try:
                fresh = load(self.identity.directory)
                if self.check is not None:
                    self.check(fresh)
            except ValueError as exc:
                log.warning("TLS: the changed identity in %s is not taken (the current one "
                            "serves on): %s", self.identity.directory, exc)  # fmt: skip
                return None
            self.identity = fresh
            self.generation += 1
        log.info("TLS: new connections use the identity read again from %s", fresh.directory)
        return fresh


class ServerIdentityReload:
    """grpc's certificate-configuration fetcher for a server's identity: called by grpc at
    the start of each TLS handshake, it returns the directory's identity when its files
    changed and form a whole, valid set again, else None (keep serving the current one)."""

    def __init__(self, identity: TlsIdentity) -> None:
        self.watch = IdentityWatch(identity, TlsIdentity.check_server_name)

    def __call__(self) -> Any:
        fresh = self.watch.fresh()
        return fresh.server_configuration() if fresh is not None else None


class ClientIdentity:
    """The identity a process's clients dial with: its directory looked at again at most
    every ``CLIENT_CHECK_S`` seconds, when a client is about to start a call
    (``pdserve.rpc.client.GrpcClient`` then opens a new channel with it). One per directory
    and process (``client_identity``)."""

    def __init__(self, identity: TlsIdentity) -> None:
        self.watch = IdentityWatch(identity)
        self.looked = time.monotonic()

    def current(self) -> tuple[TlsIdentity, int]:
        """The identity and its generation (a new one: dial with it from now on)."""
        now = time.monotonic()
        if now - self.looked >= CLIENT_CHECK_S:
            self.looked = now
            self.watch.fresh()
        return self.watch.identity, self.watch.generation


# How often a client looks whether its identity's files changed (a stat of three files).
CLIENT_CHECK_S = 1.0
_client_identities: dict[str, ClientIdentity] = {}


def client_identity(identity: TlsIdentity) -> ClientIdentity | None:
    """The process's ``ClientIdentity`` for ``identity``'s directory; None for an identity not
    read from one (it never changes)."""
    if not identity.directory:
        return None
    found = _client_identities.get(identity.directory)
    if found is None:
        found = _client_identities[identity.directory] = ClientIdentity(identity)
    return found


def tls_dir() -> str:
    """The directory named by ``PDSERVE_TLS_DIR`` ("" when unset)."""
    return os.environ.get(TLS_DIR_ENV, "")


@functools.cache
def deployment_tls() -> TlsIdentity | None:
    """This process's identity, or None (plain text); ValueError when the directory is bad."""
    return load(tls_dir()) if tls_dir() else None


DEPLOYMENT_TLS: Any = object()  # a default meaning: this process's ``deployment_tls()``


def resolve(tls: Any) -> TlsIdentity | None:
    """``tls`` itself, or the process's identity for ``DEPLOYMENT_TLS``."""
    return deployment_tls() if tls is DEPLOYMENT_TLS else tls


def aio_channel(
    address: str, options: Sequence[tuple[str, Any]] = (), tls: TlsIdentity | None = None
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to an internal server: mutual TLS with ``tls``, else plain."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    opts = [*options, *CHANNEL_OPTIONS]
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=opts)


def channel(
    address: str, options: Sequence[tuple[str, Any]] = (), tls: TlsIdentity | None = None
) -> grpc.Channel:
    """The same as a blocking channel (health checks, tests)."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    opts = [*options, *CHANNEL_OPTIONS]
    return grpc.secure_channel(address, tls.channel_credentials(), options=opts)
