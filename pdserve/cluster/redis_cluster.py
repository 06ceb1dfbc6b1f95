"""A private Redis Cluster on loopback ports, for the tests and benchmarks: ``masters``
masters, each with ``replicas`` replicas (so that a killed master fails over).

Each node is a ``RedisServer`` with cluster options (its port and cluster bus port chosen
together, started again on fresh ones when taken). ``redis-cli --cluster create`` joins them
and assigns the slots; the cluster is up once every node reports ``cluster_state:ok`` and
every replica's link to its master is up. With ``password`` every node admits ``USER`` with
it, as a single private server does (``redis_server.write_acl``); the replicas authenticate to
their masters as that user (set with CONFIG SET, never on a command line), and
``redis-cli`` gets the password from its environment. With ``tls`` every node speaks only
TLS, to clients, on the cluster bus and between master and replica (``RedisServer``), and
``url`` is ``rediss+cluster://`` with the CA in redis-py's ``ssl_ca_certs`` parameter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from pdserve.cluster.redis_server import (
    USER,
    RedisServer,
    RedisServerError,
    TlsFiles,
    with_credentials,
)

UP_TIMEOUT_S = 30.0


class LocalRedisCluster:
    def __init__(
        self,
        masters: int = 3,
        replicas: int = 1,
        password: str | None = None,
        node_timeout_ms: int = 1000,
        tls: TlsFiles | None = None,
    ) -> None:
        self.masters, self.replicas, self.password = masters, replicas, password
        self.tls = tls
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisServer] = []
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        """A ``redis+cluster://`` URL naming the first node (the client finds the others)."""
        port = self.nodes[0].port
        if self.tls is None:
            url = f"redis+cluster://127.0.0.1:{port}"
        else:
            url = self.tls.url("rediss+cluster", port)
        return url if self.password is None else with_credentials(url, self.password)

    def client(self, node: RedisServer) -> redis.Redis:
        """A plain (not cluster) client of one node, for CLUSTER and INFO commands."""
        return redis.Redis(
            host="127.0.0.1",  # the address the nodes' certificate names, with TLS
            port=node.port,
            username=USER if self.password else None,
            password=self.password,
            socket_timeout=5,
            ssl=self.tls is not None,
            ssl_ca_certs=None if self.tls is None else str(self.tls.ca),
        )

    def start(self) -> LocalRedisCluster:
        if shutil.which("redis-cli") is None:
            raise RedisServerError("redis-cli is not installed (Debian: redis-tools)")
        self._dir = Path(tempfile.mkdtemp(prefix="pdserve-cluster-"))
        try:
            for _ in range(self.masters * (1 + self.replicas)):
                node = RedisServer(
                    password=self.password,
                    cluster_dir=self._dir,
                    cluster_node_timeout_ms=self.node_timeout_ms,
                    tls=self.tls,
                )
                self.nodes.append(node.start())
                if self.password is not None:
                    with self.client(node) as c:
                        c.config_set("masteruser", USER)
                        c.config_set("masterauth", self.password)
            self._create()
            self._wait_up()
        except BaseException:
            self.stop()
            raise
        return self

    def _create(self) -> None:
        env = dict(os.environ)
        args = ["redis-cli"]
        if self.password is not None:
            env["REDISCLI_AUTH"] = self.password
            args += ["--user", USER]
        if self.tls is not None:
            args += ["--tls", "--cacert", str(self.tls.ca)]
        args += ["--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"]  # fmt: skip
        done = subprocess.run(args, env=env, capture_output=True, timeout=UP_TIMEOUT_S)
        if done.returncode != 0:
            out = (done.stdout + done.stderr).decode(errors="replace")
            raise RedisServerError(f"redis-cli --cluster create failed:\n{out}")

    def _wait_up(self) -> None:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not self.healthy():
            if time.monotonic() > deadline:
                raise RedisServerError("the Redis Cluster did not come up")
            time.sleep(0.05)

    def healthy(self) -> bool:
        """Every running node says the cluster is ok, and every replica is in sync."""
        for node in self.nodes:
            if node.process is None:
                continue
            try:
                with self.client(node) as c:
                    if c.cluster("INFO").get("cluster_state") != "ok":
                        return False
                    info = c.info("replication")
            except redis.RedisError:
                return False
            if info["role"] == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def master_of(self, key: str) -> RedisServer:
        """The running node that is master of ``key``'s slot now."""
        for node in self.nodes:
            if node.process is None:
                continue
            with self.client(node) as c:
                slot = c.cluster("KEYSLOT", key)
                for start, end, master, *_ in c.cluster("SLOTS"):
                    if start <= slot <= end:
                        port = master[1]
                        return next(n for n in self.nodes if n.port == port)
        raise RedisServerError("no running node")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.nodes = []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
