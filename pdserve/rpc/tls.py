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

Certificates are read once, at start: a rotated Secret takes effect when the process restarts
(on Kubernetes, roll the Deployments after cert-manager renews).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

TLS_DIR_ENV = "PDSERVE_TLS_DIR"
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
# The name every internal server's certificate carries and every internal client checks.
SERVER_NAME = "pdserve-internal"
CHANNEL_OPTIONS = (("grpc.ssl_target_name_override", SERVER_NAME),)


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
        """TLS for a worker's server: clients must present a certificate of ``ca``."""
        if SERVER_NAME not in self.names:
            raise ValueError(
                f"{self.directory}/{CERT_FILE} does not name {SERVER_NAME!r}, the name every "
                f"internal client checks: issue it with that DNS name (docs/deploy.md)"
            )
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS for a client: trusts only ``ca``, presents this certificate."""
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def load(directory: str | Path) -> TlsIdentity:
    """The identity in ``directory``; ValueError naming the file when one is missing or is
    not PEM of its kind."""
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
        serialization.load_pem_private_key(data[KEY_FILE], password=None)
    except ValueError as exc:
        raise ValueError(f"{TLS_DIR_ENV}: {base} holds no valid PEM {CA_FILE}, "
                         f"{CERT_FILE} and unencrypted {KEY_FILE}: {exc}") from exc  # fmt: skip
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = tuple(sans.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        names = ()
    return TlsIdentity(data[CA_FILE], data[CERT_FILE], data[KEY_FILE], names, str(base))


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
