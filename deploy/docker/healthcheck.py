"""Container health check for every pdserve role (Docker HEALTHCHECK; Kubernetes probes natively).

Usage: ``healthcheck.py [ROLE [FLAGS...]]``. Without arguments the role and its flags come from
the container's main process (``/proc/1/cmdline``, e.g. ``tini -- pdserve prefill --port 50100``).
Hosts and ports are resolved by the role's own settings class, so env (``PDSERVE_PREFILL_PORT``)
and flags (``--port``) mean exactly what they mean to the server.

- prefill / decode: grpc.health.v1 ``Check(service="")`` answers SERVING (workers answer
  NOT_SERVING until their engine has loaded); over mutual TLS with the container's own
  certificate when ``PDSERVE_TLS_DIR`` is set, as the worker then accepts nothing else (this is
  why Kubernetes runs this script as the workers' probes: its native gRPC probe has no TLS).
- gateway: ``GET /health`` answers 200 (the gateway has a healthy decode worker).
- anything else (``pdserve model prepare``, ``pdserve --help``): healthy, nothing to check.

Exit status 0 when healthy, 1 when not; one line on stdout says why (Docker keeps it).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

TIMEOUT_S = 3.0
SETTINGS = {
    "prefill": "prefill_service.config:PrefillSettings",
    "decode": "decode_service.config:DecodeSettings",
    "gateway": "gateway.config:GatewaySettings",
}


def main_command_line() -> list[str]:
    try:
        raw = Path("/proc/1/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def pdserve_command(argv: list[str]) -> tuple[str | None, list[str]]:
    """(command, its arguments) of a ``pdserve`` command line; argv without ``pdserve`` in it
    is taken as the arguments of ``pdserve`` itself."""
    start = 0
    for i, arg in enumerate(argv):
        if Path(arg).name == "pdserve":
            start = i + 1
            break
    for i in range(start, len(argv)):
        if not argv[i].startswith("-"):
            return argv[i], argv[i + 1 :]
    return None, []


def load_settings(role: str, args: list[str]) -> Any:
    from pdserve.settings import cli_args, from_args

    module, _, name = SETTINGS[role].partition(":")
    cls = getattr(importlib.import_module(module), name)
    parser = argparse.ArgumentParser(add_help=False)
    cli_args(parser, cls)
    namespace, _ = parser.parse_known_args(args)
    return from_args(cls, namespace)


def client_host(host: str) -> str:
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def check_grpc(address: str) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.rpc.tls import channel, deployment_tls

    try:
        tls = deployment_tls()
    except ValueError as exc:
        return False, str(exc)
    # The server is in this container: never go through a proxy from the environment.
    with channel(address, [("grpc.enable_http_proxy", 0)], tls) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
        except grpc.RpcError as err:
            return False, f"{address}: {err.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    mode = " (mutual TLS)" if tls else ""
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}{mode}: {status}"


def check_http(url: str) -> tuple[bool, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=TIMEOUT_S) as reply:
            body = reply.read(512).decode(errors="replace").strip()
            return reply.status == 200, f"{url}: {reply.status} {body}"
    except urllib.error.HTTPError as err:
        body = err.read(512).decode(errors="replace").strip()
        return False, f"{url}: {err.code} {body}"
    except OSError as err:
        return False, f"{url}: {err}"


def main(argv: list[str]) -> int:
    role, args = pdserve_command(argv or main_command_line())
    if role not in SETTINGS:
        print(f"healthy: `pdserve {role or ''}` serves nothing to check")
        return 0
    settings = load_settings(role, args)
    if role == "gateway":
        host = client_host(settings.http_host)
        ok, detail = check_http(f"http://{host}:{settings.http_port}/health")
    else:
        ok, detail = check_grpc(f"{client_host(settings.host)}:{settings.port}")
    print(f"{'healthy' if ok else 'unhealthy'}: {role} {detail}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
