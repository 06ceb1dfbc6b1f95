"""A private ``redis-server`` on a free loopback port, for ``pdserve up`` and the tests.

It keeps no data on disk (no RDB/AOF) and lives exactly as long as its owner. ``pdserve up``
runs ``server_command`` as one of its supervised children (restarted like the others);
``RedisServer`` starts and stops one directly (tests, benchmarks).

redis-server cannot bind port 0 and report the port (``--port 0`` turns TCP off), so a free
port is chosen and then bound by the server a moment later; another process may take it in
between. Ports are therefore chosen below the kernel's ephemeral range (``free_ports``), where
no other process gets a port without naming it, and a server that was asked for any port
retries with a fresh one when its own process did not come up. "Up" means *this* process
answers (``INFO server``'s ``process_id``), never merely that something on the port says
PONG.

With a password (``pdserve up`` always gives one) the server admits clients as the ACL file
``write_acl`` writes says: user ``USER`` with that password may do anything, a client without
it may only PING (liveness probes need no credentials) and is refused everything else. The
password is never on the server's command line (the file holds its SHA-256); clients get it
in their URL (``with_credentials``), which ``redacted`` strips for printing.

With ``tls`` (``TlsFiles``: a certificate, its key and the CA that signed it) the server
speaks only TLS on its port (no plain port) and asks clients for no certificate: they log in
with the password as usual. Its ``url`` is ``rediss://`` with the CA in redis-py's own query
parameter, ``ssl_ca_certs``.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

START_TIMEOUT_S = 10.0
START_ATTEMPTS = 5  # fresh ports tried when the port was ours to choose
CHOICE_TRIES = 1000  # random ports tried by free_ports
USER = "pdserve"  # the one user a password-protected private server admits


class RedisServerError(RuntimeError):
    pass


@dataclass(frozen=True)
class TlsFiles:
    """A server's certificate and key (PEM), and the CA certificate that signed it, which
    clients check the server against (and cluster nodes each other)."""

    cert: Path
    key: Path
    ca: Path

    def server_options(self) -> list[str]:
        """redis-server's options to serve TLS on ``port`` instead of plain TCP."""
        return ["--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key),
                "--tls-ca-cert-file", str(self.ca), "--tls-auth-clients", "no"]  # fmt: skip

    def url(self, scheme: str, port: int, path: str = "") -> str:
        """A ``scheme`` URL of the server on ``port`` that trusts this CA, in redis-py's query
        parameter ``ssl_ca_certs`` (read by both its clients, ``Redis`` and ``RedisCluster``)."""
        query = urlencode({"ssl_ca_certs": str(self.ca)})
        return f"{scheme}://127.0.0.1:{port}{path}?{query}"

    def context(self) -> ssl.SSLContext:
        """A client's context: the server's certificate must be the CA's, for its address."""
        return ssl.create_default_context(cafile=str(self.ca))


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` different loopback ports free now, for a process that must be told its port
    before it binds it (its start must try again on fresh ports when one was taken meanwhile).

    They lie below the kernel's ephemeral range (``chosen_port_range``): a port that binding
    port 0 reports lies inside it, where any other process's outgoing connection or port-0
    bind may get it before the server binds it; below it only a process that names the port
    can take it. All are held until all are chosen, so none repeats."""
    ports = chosen_port_range()
    sockets: list[socket.socket] = []
    try:
        for _ in range(CHOICE_TRIES):
            if len(sockets) == count:
                break
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", random.randrange(ports.start, ports.stop)))
            except OSError:  # in use (or lingering): another one
                sock.close()
                continue
            sockets.append(sock)
        if len(sockets) < count:
            raise RedisServerError(f"no {count} free loopback ports in {ports}")
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def chosen_port_range() -> range:
    """Where ``free_ports`` chooses: from 10000 up to the ephemeral range's first port."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        low = int(text.split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return range(10000, max(low, 12000))


def write_acl(path: Path, password: str) -> Path:
    """Write (mode 0600) the ACL file of a server that admits ``USER`` with ``password`` and
    lets a client without it only PING."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    text = f"user default on nopass -@all +ping\nuser {USER} on #{digest} ~* &* +@all\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return path


def with_credentials(url: str, password: str) -> str:
    """``url`` logging in as ``USER`` with ``password``."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{USER}:{quote(password, safe='')}@{netloc}"))


def has_credentials(url: str) -> bool:
    return "://" in url and urlsplit(url).password is not None


def redacted(url: str) -> str:
    """``url`` without user and password (fit for a log)."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def server_command(
    port: int,
    maxmemory_bytes: int | None = None,
    acl_file: Path | None = None,
    cluster: list[str] | None = None,
    tls: TlsFiles | None = None,
) -> list[str]:
    """The command line of a private server on ``port``; raises ``RedisServerError``.

    Without ``maxmemory_bytes`` the server never evicts (what the prefix index and registry
    need); with it, it evicts the least recently used keys beyond that size (a cache, such as
    the KV tier's chunks). With ``acl_file`` (``write_acl``) it admits whom that file says.
    ``cluster``: the options of a Redis Cluster node (``RedisServer.cluster_options``).
    With ``tls`` it serves TLS on ``port`` and nothing else (``--port 0``: no plain port)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisServerError(
            "redis-server is not installed (Debian: apt-get install redis-server), "
            "or pass --redis-url to use an existing Redis"
        )
    limit = [] if maxmemory_bytes is None else [
        "--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", "allkeys-lru"]  # fmt: skip
    acl = [] if acl_file is None else ["--aclfile", str(acl_file)]
    ports = ["--port", str(port)] if tls is None else [
        "--port", "0", "--tls-port", str(port), *tls.server_options()]  # fmt: skip
    return [binary, *ports, "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--protected-mode", "yes", *limit, *acl,
            *(cluster or [])]  # fmt: skip


def answers(port: int, password: str | None = None, tls: TlsFiles | None = None) -> bool:
    """Whether a Redis answers on ``port`` (blocking, at most about a second); with
    ``password``, as ``USER``; with ``tls``, over TLS."""
    return server_pid(port, password, tls) is not None


def _command(*args: str) -> bytes:
    """One command in RESP (a password may hold any character)."""
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _connect(port: int, tls: TlsFiles | None) -> socket.socket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=0.5)
    if tls is None:
        return raw
    try:  # the handshake, under the same timeout
        return tls.context().wrap_socket(raw, server_hostname="127.0.0.1")
    except BaseException:
        raw.close()
        raise


def server_pid(port: int, password: str | None = None, tls: TlsFiles | None = None) -> int | None:
    """The process id of the Redis answering on ``port`` (None: none answers); with ``tls``,
    one that answers over TLS with a certificate of ``tls.ca``'s."""
    auth = b"" if password is None else _command("AUTH", USER, password)
    try:
        with _connect(port, tls) as conn:
            conn.sendall(auth + _command("INFO", "server"))
            reply = b""
            while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    return None
                reply += chunk
    except OSError:
        return None
    line = reply.split(b"process_id:", 1)[1].split(b"\r\n", 1)[0]
    return int(line) if line.strip().isdigit() else None


class RedisServer:
    """A private server; with ``password``, one that admits ``USER`` with it (``url`` logs in);
    with ``maxmemory_bytes``, one that evicts (see ``server_command``); with ``cluster_dir``,
    a Redis Cluster node keeping its cluster state there (``pdserve.cluster.redis_cluster``
    joins nodes into a cluster), whose cluster bus port (``bus_port``) is chosen with its port;
    with ``tls``, one that speaks only TLS (a cluster node: to the other nodes too).
    """

    def __init__(
        self,
        port: int = 0,
        log_file: Path | None = None,
        password: str | None = None,
        maxmemory_bytes: int | None = None,
        cluster_dir: Path | None = None,
        cluster_node_timeout_ms: int = 1000,
        tls: TlsFiles | None = None,
    ) -> None:
        self.tls = tls
        self.cluster_dir = cluster_dir
        self.cluster_node_timeout_ms = cluster_node_timeout_ms
        self.bus_port = 0
        self.port = port or self._choose_ports()
        self._any_port = port == 0  # until it first starts: then clients know the port
        self.log_file = log_file
        self.password = password
        self.maxmemory_bytes = maxmemory_bytes
        self.process: subprocess.Popen[bytes] | None = None
        self._acl_dir: str | None = None

    @property
    def url(self) -> str:
        if self.tls is None:
            url = f"redis://127.0.0.1:{self.port}/0"
        else:
            url = self.tls.url("rediss", self.port, "/0")
        return url if self.password is None else with_credentials(url, self.password)

    def _choose_ports(self) -> int:
        """A fresh port (and, for a cluster node, a fresh bus port: by default Redis takes
        port + 10000, which may lie in the ephemeral range, so it is chosen too)."""
        if self.cluster_dir is None:
            return free_port()
        port, self.bus_port = free_ports(2)
        return port

    def cluster_options(self) -> list[str] | None:
        if self.cluster_dir is None:
            return None
        state = self.cluster_dir / f"nodes-{self.port}.conf"
        # With TLS the bus and a replica's link to its master are TLS too (the plain port is
        # off), and the nodes announce their TLS port to clients.
        tls = [] if self.tls is None else ["--tls-cluster", "yes", "--tls-replication", "yes"]
        # --dir: a replica writes the snapshot it syncs from its master to its directory.
        return ["--dir", str(self.cluster_dir),
                "--cluster-enabled", "yes", "--cluster-port", str(self.bus_port),
                "--cluster-node-timeout", str(self.cluster_node_timeout_ms),
                "--cluster-config-file", str(state), *tls]  # fmt: skip

    def _acl_file(self) -> Path | None:
        if self.password is None:
            return None
        if self._acl_dir is None:
            self._acl_dir = tempfile.mkdtemp(prefix="pdserve-redis-")
        return write_acl(Path(self._acl_dir) / "users.acl", self.password)

    def start(self) -> RedisServer:
        """Start (again, after ``stop``, on the same port); raises ``RedisServerError``."""
        server_command(self.port)  # raises if not installed: before any attempt
        for _ in range(START_ATTEMPTS if self._any_port else 1):
            if self._launch():
                self._any_port = False
                return self
            if self._any_port:
                self.port = self._choose_ports()  # ours was taken meanwhile: another one
        raise RedisServerError(f"redis-server did not start on port {self.port}")

    def _launch(self) -> bool:
        """True once this process answers; False (and stopped) if it exited or timed out."""
        args = server_command(
            self.port, self.maxmemory_bytes, self._acl_file(), self.cluster_options(), self.tls
        )
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        self.process = process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                                  start_new_session=True)  # fmt: skip
        if self.log_file:
            out.close()  # type: ignore[union-attr]  # the child has its own copy
        deadline = time.monotonic() + START_TIMEOUT_S
        while server_pid(self.port, self.password, self.tls) != process.pid:
            if process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                return False
            time.sleep(0.05)
        return True

    def kill(self) -> None:
        """End the server at once (SIGKILL), as a crash would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        if self._acl_dir is not None:
            shutil.rmtree(self._acl_dir, ignore_errors=True)
            self._acl_dir = None
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
