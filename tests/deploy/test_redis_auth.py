"""The Redis servers of the deployments (the prefix index's and the KV tier's) admit only
clients with the password: compose's REDIS_PASSWORD, Kubernetes' Secret pdserve-redis. The
servers' own commands are run here, as rendered, on a local redis-server: a client without the
password may only PING, and the password is on no command line."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from pdserve.cluster.redis_server import USER
from tests.deploy.support import (
    COMPOSE_FILE,
    COMPOSE_REDIS_PASSWORD,
    KV_TIER_COMPOSE_FILE,
    KV_TIER_OVERLAYS,
    OVERLAYS,
    _empty_file,
    compose_config,
    find_tool,
    kustomize,
    objects,
    pod_spec,
    workloads,
)
from tests.helpers import redis_process

WITH_TIER = ("-f", str(KV_TIER_COMPOSE_FILE))
HOSTS = {"REDIS_URL": "redis", "KV_TIER_URL": "tier-redis"}


@contextmanager
def running(command: list[str], password: str) -> Iterator[tuple[int, int]]:
    """The server ``command`` starts (a deployment's, on a free loopback port): (port, pid)."""
    env = {"PATH": os.environ["PATH"], "REDIS_PASSWORD": password}

    def argv(port: int) -> list[str]:
        return [*command, "--port", str(port), "--bind", "127.0.0.1"]

    with redis_process(argv, password, env) as (port, process):
        yield port, process.pid


def check_server(command: list[str], password: str) -> None:
    """Anyone may PING; only ``USER`` with ``password`` may do anything else; the password
    is on no command line (of the shell, which execs redis-server)."""
    with running(command, password) as (port, pid):
        assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        anonymous = redis.Redis(port=port, socket_timeout=5)
        admitted = redis.Redis(port=port, username=USER, password=password, socket_timeout=5)
        try:
            assert anonymous.ping()
            for call in (lambda: anonymous.set("k", "v"), lambda: anonymous.keys("*")):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    call()
            assert admitted.set("k", "v") and admitted.get("k") == b"v"
        finally:
            anonymous.close()
            admitted.close()


def local(command: list[str]) -> list[str]:
    """A deployment's command with this machine's redis-server."""
    return [find_tool("redis-server") if arg == "redis-server" else arg for arg in command]


# ---- docker compose


def test_compose_needs_the_password() -> None:
    argv = [find_tool("docker-compose"), "-f", str(COMPOSE_FILE), "--env-file", _empty_file()]
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/")}
    done = subprocess.run([*argv, "config"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0 and "REDIS_PASSWORD" in done.stderr


def compose_clients(svc: dict[str, dict[str, Any]]) -> Iterator[tuple[str, str, str]]:
    """(service, variable, URL) of every Redis URL a pdserve service gets."""
    for name, service in svc.items():
        for var, value in (service.get("environment") or {}).items():
            if var.startswith("PDSERVE_") and var.endswith(tuple(HOSTS)):
                yield name, var, str(value)


@pytest.mark.parametrize("args", [(), WITH_TIER], ids=["index", "index+tier"])
def test_every_compose_client_logs_in_and_no_server_command_holds_the_password(
    args: tuple[str, ...],
) -> None:
    svc = dict(compose_config(*args, "--profile", "gpu")["services"])
    clients = list(compose_clients(svc))
    assert {n for n, _, _ in clients} >= {"gateway", "prefill", "decode", "prefill-gpu"}
    for name, var, value in clients:
        url = urlsplit(value)
        host = next(h for suffix, h in HOSTS.items() if var.endswith(suffix))
        assert (url.username, url.password, url.hostname, url.port) == (
            USER, COMPOSE_REDIS_PASSWORD, host, 6379), (name, var)  # fmt: skip
    servers = [n for n in ("redis", "tier-redis") if n in svc]
    assert servers == (["redis", "tier-redis"] if args else ["redis"])
    for name in servers:
        assert COMPOSE_REDIS_PASSWORD not in " ".join(svc[name]["command"]), name
        assert svc[name]["environment"]["REDIS_PASSWORD"] == COMPOSE_REDIS_PASSWORD


@pytest.mark.parametrize("name", ["redis", "tier-redis"])
def test_the_compose_redis_commands_admit_only_the_password(name: str) -> None:
    command = compose_config(*WITH_TIER)["services"][name]["command"]
    # `config` prints "$$" for a literal "$" (its output is a compose file); compose runs "$".
    check_server(local([arg.replace("$$", "$") for arg in command]), COMPOSE_REDIS_PASSWORD)


# ---- Kubernetes


def redis_containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        w["metadata"]["name"]: c
        for w in workloads(docs)
        for c in pod_spec(w)["containers"]
        if w["metadata"]["name"] in ("redis", "tier-redis")
    }


def from_secret(entry: dict[str, Any]) -> tuple[str, str]:
    ref = entry["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


@pytest.mark.parametrize("path", OVERLAYS)
def test_every_kubernetes_client_logs_in_with_the_secret(path: str) -> None:
    docs = kustomize(path)
    servers = redis_containers(docs)
    assert set(servers) == ({"redis", "tier-redis"} if path in KV_TIER_OVERLAYS else {"redis"})
    for name, c in servers.items():
        env = {e["name"]: e for e in c["env"]}
        assert from_secret(env["REDIS_PASSWORD"]) == ("pdserve-redis", "password"), name
        assert "$REDIS_PASSWORD" in c["command"][2] and "REDIS_PASSWORD" not in str(c["args"])
    seen = set()
    for w in workloads(docs):
        for c in pod_spec(w)["containers"]:
            names = [e["name"] for e in c.get("env", [])]
            for i, entry in enumerate(c.get("env", [])):
                if not entry["name"].endswith(tuple(HOSTS)) or not entry["name"].startswith(
                    "PDSERVE_"
                ):
                    continue
                seen.add(entry["name"])
                url = urlsplit(entry["value"])
                assert (url.username, url.password) == (USER, "$(REDIS_PASSWORD)"), entry
                assert url.hostname in HOSTS.values() and url.port == 6379, entry
                # Kubernetes expands $(VAR) only from variables defined before it.
                assert "REDIS_PASSWORD" in names[:i], f"{w['metadata']['name']}: {names}"
                password = c["env"][names.index("REDIS_PASSWORD")]
                assert from_secret(password) == ("pdserve-redis", "password")
    assert {"PDSERVE_GATEWAY_REDIS_URL", "PDSERVE_PREFILL_REDIS_URL"} <= seen
    if path in KV_TIER_OVERLAYS:
        assert {"PDSERVE_PREFILL_KV_TIER_URL", "PDSERVE_DECODE_KV_TIER_URL"} <= seen
    assert "pdserve-redis" not in objects(docs, "Secret"), "created by the operator, never here"


@pytest.mark.parametrize("name", ["redis", "tier-redis"])
def test_the_kubernetes_redis_commands_admit_only_the_password(name: str) -> None:
    c = redis_containers(kustomize(KV_TIER_OVERLAYS[0]))[name]
    check_server(local([*c["command"], *c["args"]]), "fedcba9876543210fedcba9876543210")
