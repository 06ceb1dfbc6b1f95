"""A server certificate for 127.0.0.1 from a fresh private CA (``pdserve.rpc.ca``, the one
pdserve up and ``pdserve certs`` use), for the Redis TLS tests."""

from __future__ import annotations

import datetime
from pathlib import Path

from pdserve.cluster.redis_server import TlsFiles
from pdserve.rpc.ca import Authority

VALID = datetime.timedelta(days=1)


def write_tls_files(directory: Path, host: str = "127.0.0.1") -> TlsFiles:
    """Write ``ca.pem`` (a fresh CA), ``server.pem`` (a certificate for the IP address
    ``host`` that CA signed, for server and client use) and ``server.key`` into
    ``directory``."""
    issued = Authority("pdserve test CA", VALID).issue(host, ips=[host])
    files = TlsFiles(cert=directory / "server.pem", key=directory / "server.key",
                     ca=directory / "ca.pem")  # fmt: skip
    files.ca.write_bytes(issued.ca)
    files.cert.write_bytes(issued.cert)
    files.key.write_bytes(issued.key)
    files.key.chmod(0o600)
    return files
