"""A private ``redis-server`` on a free loopback port, for ``pdserve up`` and the tests.

It keeps no data on disk (no RDB/AOF) and lives exactly as long as its owner. ``pdserve up``
runs ``server_command`` as one of its supervised children (restarted like the others);
``RedisServer`` starts and stops one directly (tests, benchmarks).

redis-server cannot bind port 0 and report the port, so a free port is chosen and then bound
by the server a moment later; another process may take it in between. A server that was
asked for any port therefore retries with a fresh one when its own process did not come up,
and "up" means *this* process answers (``INFO server``'s ``process_id``), never merely that
something on the port says PONG.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

START_TIMEOUT_S = 10.0
START_ATTEMPTS = 5  # fresh ports tried when the port was ours to choose


class RedisServerError(RuntimeError):
    pass


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` different loopback ports free now. All are held until all are chosen: ports
    chosen one after another can repeat (a make test run once gave a gateway the same port
    for HTTP and gRPC)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def server_command(port: int, maxmemory_bytes: int | None = None) -> list[str]:
    """The command line of a private server on ``port``; raises ``RedisServerError``.

    Without ``maxmemory_bytes`` the server never evicts (what the prefix index and registry
    need); with it, it evicts the least recently used keys beyond that size (a cache, such as
    the KV tier's chunks)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisServerError(
            "redis-server is not installed (Debian: apt-get install redis-server), "
            "or pass --redis-url to use an existing Redis"
        )
    limit = [] if maxmemory_bytes is None else [
        "--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", "allkeys-lru"]  # fmt: skip
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--protected-mode", "yes", *limit]  # fmt: skip


def answers(port: int) -> bool:
    """Whether a Redis answers on ``port`` (blocking, at most about a second)."""
    return _server_pid(port) is not None


def _server_pid(port: int) -> int | None:
    """The process id of the Redis answering on ``port`` (None: none answers)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"INFO server\r\n")
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
    def __init__(self, port: int = 0, log_file: Path | None = None) -> None:
        self.port = port or free_port()
        self._any_port = port == 0  # until it first starts: then clients know the port
        self.log_file = log_file
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start (again, after ``stop``, on the same port); raises ``RedisServerError``."""
        server_command(self.port)  # raises if not installed: before any attempt
        for _ in range(START_ATTEMPTS if self._any_port else 1):
            if self._launch():
                self._any_port = False
                return self
            if self._any_port:
                self.port = free_port()  # ours was taken meanwhile: another one
        raise RedisServerError(f"redis-server did not start on port {self.port}")

    def _launch(self) -> bool:
        """True once this process answers; False (and stopped) if it exited or timed out."""
        args = server_command(self.port)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        self.process = process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                                  start_new_session=True)  # fmt: skip
        if self.log_file:
            out.close()  # type: ignore[union-attr]  # the child has its own copy
        deadline = time.monotonic() + START_TIMEOUT_S
        while _server_pid(self.port) != process.pid:
            if process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
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
