"""The deployment secret: one shared value that authenticates pdserve's internal traffic.

Every process of a deployment reads it from the file named by ``PDSERVE_SECRET_FILE`` (the
value itself never travels in the environment, on a command line or in a log):

* worker gRPC calls carry an HMAC of it (``pdserve.rpc.auth``), checked by the workers;
* KV transfer connections authenticate with a challenge/response (``kv_transfer.auth``);
* KV hand-offs are sealed with it (``kv_transfer.seal``).

``pdserve up`` writes a fresh one (mode 0600) into its log directory; docker compose and
Kubernetes mount one as a secret file (docs/deploy.md). Without one, workers refuse to listen
on anything but loopback and warn that their internal ports are open to local processes.
"""

from __future__ import annotations

import functools
import ipaddress
import os
from pathlib import Path

from kv_transfer.auth import load_secret, new_secret

SECRET_FILE_ENV = "PDSERVE_SECRET_FILE"


def secret_file() -> str:
    """The path named by ``PDSERVE_SECRET_FILE`` ("" when unset)."""
    return os.environ.get(SECRET_FILE_ENV, "")


@functools.cache
def deployment_secret() -> bytes | None:
    """The secret of this process's deployment, or None; ValueError when the file is bad."""
    return load_secret(secret_file())


def write_new(path: Path) -> Path:
    """Create (or replace) ``path`` holding a fresh secret, readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (new_secret() + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
