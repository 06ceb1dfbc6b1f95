"""``pdserve up``: a local cluster (prefill workers, decode workers, gateway), supervised.

Every vLLM engine gets its own GPU or its own CPU cores (``pdserve.placement.engines``); on GPUs the
workers move KV caches with vLLM's NixlConnector (``pdserve.cluster.gpu``). The gateway and the
workers talk mutual TLS with certificates of a private CA made for this run (``tls_env``).
Starting, readiness, logs, restarts and shutdown are pdserve.cluster.supervisor's job; every
process (workers, gateway, the private redis-server) is one of its children.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from pydantic import ValidationError

from pdserve import settings as shared
from pdserve.cluster import gpu as up_gpu
from pdserve.cluster import tier as up_tier
from pdserve.cluster.backoff import Backoff
from pdserve.cluster.ready import client_host, grpc_serving, http_ok
from pdserve.cluster.redis_server import (
    USER,
    RedisServerError,
    answers,
    free_ports,
    has_credentials,
    redacted,
    server_command,
    with_credentials,
    write_acl,
)
from pdserve.cluster.supervisor import (
    ChildExitPolicy,
    ChildSpec,
    Supervisor,
    SupervisorOptions,
)
from pdserve.cluster.up_settings import UpSettings
from pdserve.placement import front_cores, machine, topology
from pdserve.placement.engines import (
    Placement,
    gpus_to_use,
    lend_cores,
    lendable_cores,
    place_engines,
    usable_cores,
)
from pdserve.rpc import tls as rpc_tls
from pdserve.rpc.secret import SECRET_FILE_ENV, secret_file, write_new
from pdserve.worker.core_lending import CoreTable

# Children print as they go, so that a log tail shows the last thing that happened.
CHILD_ENV = {"PYTHONUNBUFFERED": "1"}
# The default model names red, blue and yellow in float32 and in bfloat16 (asked for the
# capital of France, it answers with a French phrase in bfloat16, as plain vLLM does).
QUESTION = "Name three primary colors."


def served_model_name(model: str, given: str = "") -> str:
    """The name clients use: ``given`` (``--served-model-name``), else the model directory's."""
    if given:
        return given
    return Path(model.rstrip("/")).name if model else shared.DEFAULT_MODEL_NAME


def _pdserve(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "pdserve", *args)


def _engine_flags(s: UpSettings, placement: Placement, engine_args: str) -> list[str]:
    flags = ["--model", s.model] if s.model else []
    flags += ["--served-model-name", s.served_model_name] if s.served_model_name else []
    flags += ["--lora-modules", s.lora_modules] if s.lora_modules else []
    flags += ["--runtime-lora"] if s.allow_runtime_lora_updating else []
    if placement.cpu_cores is not None:
        flags += ["--cpu-cores", placement.cpu_cores]
    if placement.lending_table:
        flags += ["--cpu-lending", placement.lending_table]
    if placement.borrow_cores:
        flags += ["--cpu-borrow", placement.borrow_cores]
    engine_args = up_gpu.with_memory_share(engine_args, placement.memory_share)
    if engine_args:  # "=": a separate value starting with "--" would be read as a flag
        flags.append(f"--engine-args={engine_args}")
    return flags


def worker_spec(
    s: UpSettings,
    role: str,
    index: int,
    placement: Placement,
    connector: str = "pdserve",
    after: tuple[str, ...] = (),
    tls: rpc_tls.TlsIdentity | None = None,
) -> ChildSpec:
    """``role`` is "prefill" or "decode"; worker ``i`` takes port base + ``i``; with nixl, its
    side-channel port is ``--nixl-port`` + its place among all workers (prefill first).
    ``tls``: the identity its readiness probe dials with."""
    name = f"{role}-{index}"
    if role == "prefill":
        port, engine_args = s.prefill_port + index, s.prefill_engine_args
        kv_flags = ["--kv-port", str(s.kv_port + index)]
    else:
        port, engine_args, kv_flags = s.decode_port + index, s.decode_engine_args, []
    if connector == "nixl":
        prefill_ports, decode_ports = up_gpu.nixl_ports(s.nixl_port, s.prefill, s.decode)
        side = (prefill_ports if role == "prefill" else decode_ports)[index]
        kv_flags = ["--kv-connector", "nixl", "--nixl-port", str(side)]
    # A URL with a password goes in the environment (credentials_env), never on a command line.
    redis = ["--redis-url", s.redis_url] if s.redis_url and not has_credentials(s.redis_url) else []
    tier_url = "" if has_credentials(s.kv_tier_url) else s.kv_tier_url
    tier = up_tier.worker_flags(s.kv_tier, tier_url, s.kv_tier_cpu_gib, name)
    flags = ["--worker-id", name, "--port", str(port), *kv_flags, *redis, *tier]
    argv = _pdserve(role, *flags, *_engine_flags(s, placement, engine_args))
    env = {**CHILD_ENV, **placement.env}
    ready = grpc_serving(f"127.0.0.1:{port}", tls)
    return ChildSpec(name, argv, env, ready, stop_stage=1, after=after)


def parser_flags(s: UpSettings) -> list[str]:
    """The gateway's flags for vLLM's front end: its chat template, its chat output parsers,
    vLLM's tokenizer info."""
    flags = ["--tool-call-parser", s.tool_call_parser] if s.tool_call_parser else []
    if s.reasoning_parser:
        flags += ["--reasoning-parser", s.reasoning_parser]
    flags += ["--enable-auto-tool-choice"] if s.enable_auto_tool_choice else []
    flags += ["--chat-template", s.chat_template] if s.chat_template else []
    flags += ["--trust-request-chat-template"] if s.trust_request_chat_template else []
    flags += ["--allow-runtime-lora-updating"] if s.allow_runtime_lora_updating else []
    return flags + (
        ["--enable-tokenizer-info-endpoint"] if s.enable_tokenizer_info_endpoint else []
    )


def gateway_spec(s: UpSettings) -> ChildSpec:
    prefill = [f"127.0.0.1:{s.prefill_port + i}" for i in range(s.prefill)]
    decode = [f"127.0.0.1:{s.decode_port + i}" for i in range(s.decode)]
    argv = _pdserve(
        "gateway", "--http-host", s.host, "--http-port", str(s.http_port),
        "--grpc-port", str(s.grpc_port), *(["--model", s.model] if s.model else []),
        *(["--served-model-name", s.served_model_name] if s.served_model_name else []),
        *(["--extra-models", s.extra_models] if s.extra_models else []),
        *(["--generation-config", s.generation_config] if s.generation_config != "auto" else []),
        *parser_flags(s),
        # "=": an empty list (no prefill workers) stays an explicit empty value.
        "--prefill-workers=" + ",".join(prefill), "--decode-workers=" + ",".join(decode),
        *(["--redis-url", s.redis_url] if s.redis_url and not has_credentials(s.redis_url) else []),
    )  # fmt: skip
    # Ready when the gateway itself sees every worker, so no first request goes local.
    prefill_workers, decode_workers = s.workers()
    expect = {"healthy_prefill_workers": prefill_workers, "healthy_decode_workers": decode_workers}
    health = http_ok(f"http://{client_host(s.host)}:{s.http_port}/health", expect)
    return ChildSpec("gateway", argv, CHILD_ENV, health, stop_stage=0)


def core_split(
    s: UpSettings, gpus: Sequence[str], cores: Sequence[int]
) -> tuple[int, topology.Rates] | None:
    """How many of ``cores`` the prefill engines share (``--cpu-split phases``:
    ``topology.prefill_cores``) and the rates that chose it; None where the cores are split
    evenly (``--cpu-split even``, GPUs, or more engines than cores)."""
    if s.cpu_split == "even" or gpus or s.prefill + s.decode > len(cores):
        return None
    rates = topology.load_rates(s.split_rates, machine.native_bf16())
    workload = topology.parse_workload(s.split_workload)
    return topology.prefill_cores(len(cores), s.prefill, s.decode, workload, rates), rates


def engine_placements(
    s: UpSettings, gpus: Sequence[str], cores: Sequence[int]
) -> tuple[list[Placement], str | None]:
    """Every engine's placement, prefill engines first (``place_engines``, the cores split
    as ``core_split`` says), and a sharing warning."""
    split = core_split(s, gpus, cores)
    to_prefill = split[0] if split is not None else None
    return place_engines(s.prefill + s.decode, gpus, cores, s.prefill, to_prefill)


def split_line(s: UpSettings, gpus: Sequence[str], cores: Sequence[int]) -> str:
    """What ``pdserve up`` prints about the split of the cores ("" where it does not apply)."""
    split = core_split(s, gpus, cores)
    if split is None or not s.prefill:
        return ""
    to_prefill, rates = split
    return "pdserve up: " + topology.describe(cores, to_prefill, s.split_workload, rates)


def build_specs(
    s: UpSettings,
    gpus: Sequence[str],
    cores: Sequence[int],
    lending_table: str = "",
    tls: rpc_tls.TlsIdentity | None = None,
) -> tuple[list[ChildSpec], str | None]:
    """Workers first, then the gateway (stopped first: stop_stage 0); and a sharing warning.
    With ``lending_table``, decode engines borrow the prefill engines' cores where
    ``placement.lend_cores`` allows it; with ``tls``, the workers' readiness probes dial with
    it. Raises ``up_gpu.ConnectorError`` when the requested connector cannot run here."""
    connector = up_gpu.connector_for(s.kv_connector, gpus)
    placements, warning = engine_placements(s, gpus, cores)
    if lending_table:
        placements = lend_cores(placements, s.prefill, lending_table)
    names = [f"prefill-{i}" for i in range(s.prefill)] + [f"decode-{i}" for i in range(s.decode)]
    after = [
        (names[j],) if j is not None else ()
        for j in up_gpu.starts_after([p.gpu for p in placements])
    ]
    specs = []
    for i, name in enumerate(names):
        role, index = name.split("-")
        specs.append(worker_spec(s, role, int(index), placements[i], connector, after[i], tls))
    specs += more_model_specs(s, placements, connector, tls)
    return [*specs, gateway_spec(s)], warning


def more_model_specs(
    s: UpSettings,
    placements: Sequence[Placement],
    connector: str,
    tls: rpc_tls.TlsIdentity | None = None,
) -> list[ChildSpec]:
    """The workers of ``--extra-models``: for the k-th, prefill-(P + k) (where the first model
    has prefill workers) and decode-(D + k), on the cores or GPU of prefill-0 and decode-0
    and outside core lending. They serve their model's name and no adapters, and the gateway
    finds them in the registry."""
    specs = []
    prefill, decode = s.workers()
    for k, (name, path) in enumerate(s.more_models()):
        model = s.model_copy(
            update={"model": path, "served_model_name": name, "lora_modules": "",
                    "prefill": prefill, "decode": decode}
        )  # fmt: skip
        roles = [("prefill", s.prefill + k, placements[0])] if s.prefill else []
        roles.append(("decode", s.decode + k, placements[s.prefill]))
        for role, index, placement in roles:
            alone = replace(placement, lending_table="", borrow_cores="")
            specs.append(worker_spec(model, role, index, alone, connector, (), tls))
    return specs


def redis_spec(
    port: int,
    name: str = "redis",
    maxmemory_bytes: int | None = None,
    password: str | None = None,
    acl_file: Path | None = None,
) -> ChildSpec:
    """A private redis-server on ``port``, stopped last (the workers withdraw from it as they
    stop); with ``maxmemory_bytes`` it evicts, with ``acl_file`` (holding ``password``) it
    admits only clients with the password (see ``server_command``). Raises
    ``RedisServerError`` when it is not installed."""
    argv = tuple(server_command(port, maxmemory_bytes, acl_file))

    async def check() -> bool:
        return await asyncio.to_thread(answers, port, password)

    return ChildSpec(name, argv, {}, check, stop_stage=2)


def private_redis_specs(
    s: UpSettings, password: str | None = None, acl_file: Path | None = None
) -> tuple[UpSettings, list[ChildSpec]]:
    """The private redis-servers ``s`` asks for (the index's without --redis-url; the tier's for
    --kv-tier redis without --kv-tier-url), and ``s`` with their URLs filled in. With
    ``password`` (and ``acl_file``, ``redis_server.write_acl``) both admit only clients with
    it, and the URLs carry it. Raises ``RedisServerError`` when redis-server is not installed."""
    specs: list[ChildSpec] = []
    ports = iter(free_ports(2))  # different ones: chosen one after another they can repeat

    def url(port: int) -> str:
        plain = f"redis://127.0.0.1:{port}/0"
        return plain if password is None else with_credentials(plain, password)

    if not s.redis_url:
        port = next(ports)
        specs.append(redis_spec(port, password=password, acl_file=acl_file))
        s = s.model_copy(update={"redis_url": url(port)})
    if up_tier.private_redis(s.kv_tier, s.kv_tier_url):
        port = next(ports)
        limit = up_tier.maxmemory_bytes(s.kv_tier_redis_gib)
        specs.append(redis_spec(port, "tier-redis", limit, password, acl_file))
        s = s.model_copy(update={"kv_tier_url": url(port)})
    return s, specs


def credentials_env(s: UpSettings) -> dict[str, str]:
    """The workers' and the gateway's Redis URLs that hold a password, as their settings'
    environment variables. ``run`` puts them into its own environment, which every child
    inherits: a command line is visible to every user of the machine (``ps``), and the
    supervisor writes each child's own ``ChildSpec.env`` into its log."""
    env: dict[str, str] = {}
    if has_credentials(s.redis_url):
        for prefix in ("PDSERVE_PREFILL_", "PDSERVE_DECODE_", "PDSERVE_GATEWAY_"):
            env[f"{prefix}REDIS_URL"] = s.redis_url
    if s.kv_tier != "off" and has_credentials(s.kv_tier_url):
        for prefix in ("PDSERVE_PREFILL_", "PDSERVE_DECODE_"):
            env[f"{prefix}KV_TIER_URL"] = s.kv_tier_url
    return env


def redis_password(s: UpSettings, log_dir: Path) -> tuple[str | None, Path | None]:
    """For the private redis-servers ``s`` needs (none: (None, None)): a fresh password in
    ``<log_dir>/redis-password`` and the servers' ACL file ``<log_dir>/redis-users.acl``
    (both mode 0600, next to the deployment secret; the ACL file holds only its SHA-256)."""
    if s.redis_url and not up_tier.private_redis(s.kv_tier, s.kv_tier_url):
        return None, None
    password = write_new(_prepared(log_dir) / "redis-password").read_text().strip()
    return password, write_acl(log_dir / "redis-users.acl", password)


def supervisor_options(s: UpSettings, log_dir: Path) -> SupervisorOptions:
    return SupervisorOptions(
        log_dir=log_dir,
        startup_timeout_s=s.startup_timeout_s,
        grace_s=s.shutdown_grace_s,
        on_child_exit=ChildExitPolicy(s.on_child_exit),
        backoff=Backoff(s.restart_backoff_s, s.restart_backoff_max_s, s.restart_reset_s),
    )


def cluster_ports(s: UpSettings, connector: str = "pdserve") -> list[tuple[str, int]]:
    """(host, port) of every server of the cluster."""
    wanted = [(s.host, s.http_port), (s.host, s.grpc_port)]
    prefill, decode = s.workers()  # of every model
    wanted += [("127.0.0.1", s.prefill_port + i) for i in range(prefill)]
    wanted += [("127.0.0.1", s.decode_port + i) for i in range(decode)]
    if connector == "nixl":
        prefill_ports, decode_ports = up_gpu.nixl_ports(s.nixl_port, prefill, decode)
        wanted += [("127.0.0.1", port) for port in (*prefill_ports, *decode_ports)]
    else:
        wanted += [("127.0.0.1", s.kv_port + i) for i in range(prefill)]
    return wanted


def shared_ports(s: UpSettings, connector: str = "pdserve") -> list[int]:
    """Ports given to more than one of the cluster's servers (each of N workers takes its
    option's port + 0 .. N-1): the second server could never bind its port."""
    ports = [port for _, port in cluster_ports(s, connector)]
    return sorted({port for port in ports if port and ports.count(port) > 1})  # 0: any


def busy_ports(s: UpSettings, connector: str = "pdserve") -> list[int]:
    """Ports of the cluster that something already listens on (e.g. a previous ``up``)."""
    busy = []
    for host, port in cluster_ports(s, connector):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # As servers do: a port held only by TIME_WAIT connections is free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                busy.append(port)
    return busy


def _python_command() -> str:
    """This interpreter (it has the openai package), relative to the current directory if inside."""
    relative = os.path.relpath(sys.executable)
    return sys.executable if relative.startswith("..") else relative


def ready_banner(s: UpSettings, log_dir: Path) -> str:
    host, name = client_host(s.host), served_model_name(s.model, s.served_model_name)
    base = f"http://{host}:{s.http_port}"
    message = {"role": "user", "content": QUESTION}
    body = json.dumps({"model": name, "messages": [message], "max_tokens": 32, "temperature": 0})
    curl = (
        f"curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(body)}"
    )
    code = (
        f'from openai import OpenAI; c = OpenAI(base_url="{base}/v1", api_key="none"); '
        f"print(c.chat.completions.create(model={json.dumps(name)}, "
        f'messages=[{{"role": "user", "content": {json.dumps(QUESTION)}}}], '
        "max_tokens=32, temperature=0)"
        ".choices[0].message.content)"
    )
    prefill, decode = s.workers()
    models = ", ".join([name, *(more for more, _ in s.more_models())])
    return "\n".join(
        [
            f"pdserve is up: {prefill} prefill + {decode} decode worker(s), "
            f"model{'s' if s.extra_models else ''} {models}"
            + ("" if s.kv_tier == "off" else f", KV tier {s.kv_tier}"),
            f"  OpenAI API   {base}/v1   (health {base}/health, metrics {base}/metrics)",
            f"  gRPC         {host}:{s.grpc_port}",
            f"  logs         {log_dir}",
            "Try it:",
            f"  {curl}",
            f"  {shlex.quote(_python_command())} -c {shlex.quote(code)}",
            "Press Ctrl-C to stop (twice to kill at once).",
        ]
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shared.cli_args(parser, UpSettings)


def run(args: argparse.Namespace) -> int:
    try:
        s = shared.from_args(UpSettings, args)
    except ValidationError as exc:
        print(f"pdserve up: invalid settings: {exc}", file=sys.stderr)
        return 2
    problem = front_cores.setting_problem()
    if problem:
        print(f"pdserve up: {problem}", file=sys.stderr)
        return 2
    gpus = gpus_to_use(s.gpus)
    try:
        connector = up_gpu.connector_for(s.kv_connector, gpus)
    except up_gpu.ConnectorError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    twice = shared_ports(s, connector)
    if twice:
        ports = ", ".join(map(str, twice))
        print(f"pdserve up: port(s) {ports} given to more than one server (workers take their "
              "option's port + 0, 1, ...: --prefill-port, --decode-port, --kv-port)",
              file=sys.stderr)  # fmt: skip
        return 2
    busy = busy_ports(s, connector)
    if busy:
        ports = ", ".join(map(str, busy))
        print(f"pdserve up: port(s) {ports} in use (another pdserve up?)", file=sys.stderr)
        return 1
    log_dir = Path(s.log_dir).resolve()
    print(f"pdserve up: logs in {log_dir}", flush=True)
    print(up_gpu.choice_line(connector, gpus, s.nixl_port, sum(s.workers())), flush=True)
    missing = [path for _, path in s.more_models() if not Path(path).is_dir()]
    if missing:
        print(f"pdserve up: extra model directory {missing[0]} does not exist", file=sys.stderr)
        return 2
    secret_env = deployment_secret_env(log_dir)
    given = s
    password, acl_file = redis_password(s, log_dir)
    try:
        s, redis = private_redis_specs(s, password, acl_file)
    except RedisServerError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 1
    login = f"user {USER}, password in {log_dir / 'redis-password'}"
    if s.redis_url != given.redis_url:
        print(f"pdserve up: private redis-server on {redacted(s.redis_url)} ({login})", flush=True)
    if s.kv_tier_url != given.kv_tier_url:
        limit = f"maxmemory {s.kv_tier_redis_gib:g} GiB, allkeys-lru"
        print(f"pdserve up: KV tier redis-server on {redacted(s.kv_tier_url)} ({limit}, {login})",
              flush=True)  # fmt: skip
    os.environ.update(credentials_env(s))
    cores = usable_cores()
    line = split_line(s, gpus, cores)
    if line:
        print(line, flush=True)
    table = lending_table(s, gpus, cores, log_dir)
    tls_dirs = tls_env(s, log_dir)
    tls = rpc_tls.load(tls_dirs[PROBE_IDENTITY][rpc_tls.TLS_DIR_ENV]) if tls_dirs else None
    specs, warning = build_specs(s, gpus, cores, table, tls)
    front_env = front_cores_env(s, gpus, cores)
    specs = [
        *redis,
        *(replace(spec, env={**spec.env, **secret_env, **front_env, **tls_dirs.get(spec.name, {})})
          for spec in specs),
    ]  # fmt: skip
    if warning:
        print(warning, flush=True)
    banner = ready_banner(s, log_dir)
    options = supervisor_options(s, log_dir)
    supervisor = Supervisor(specs, options, on_ready=lambda: print(banner, flush=True))
    return asyncio.run(supervisor.run())


def lending_table(s: UpSettings, gpus: Sequence[str], cores: Sequence[int], log_dir: Path) -> str:
    """A new core lending table at ``<log_dir>/cpu-lending`` when this cluster's engines lend
    cores (``--cpu-lending``, ``placement.lendable_cores``); its path, or "". Prints which."""
    placements, _ = engine_placements(s, gpus, cores)
    borrow = lendable_cores(placements, s.prefill) if s.cpu_lending else ""
    if not borrow:
        if not gpus:
            why = ("it needs prefill and decode workers, each on cores of its own"
                   if s.cpu_lending else "--no-cpu-lending")  # fmt: skip
            print(f"pdserve up: core lending off ({why})", flush=True)
        return ""
    path = _prepared(log_dir) / "cpu-lending"
    CoreTable.create(str(path), max(cores) + 1)
    print(f"pdserve up: core lending: decode engines also compute on cores {borrow} while "
          "the prefill engines there have nothing to compute (--no-cpu-lending: off)",
          flush=True)  # fmt: skip
    return str(path)


def front_cores_env(s: UpSettings, gpus: Sequence[str], cores: Sequence[int]) -> dict[str, str]:
    """The gateway's and the workers' ``FRONT_ENV`` (``pdserve.placement.front_cores``); prints
    where their own threads run when it binds them."""
    placements, _ = engine_placements(s, gpus, cores)
    front = front_cores.front_cores(placements, s.prefill)
    if front:
        print(f"pdserve up: the gateway's and the workers' own threads run on the prefill "
              f"engines' cores {front} ({front_cores.FRONT_ENV}= leaves them to the OS)",
              flush=True)  # fmt: skip
    return {front_cores.FRONT_ENV: front}


def deployment_secret_env(log_dir: Path) -> dict[str, str]:
    """The children's ``PDSERVE_SECRET_FILE``: the caller's, or a fresh secret written to
    ``<log_dir>/secret`` (mode 0600) for this run. Only the path is passed (and logged)."""
    if secret_file():
        return {SECRET_FILE_ENV: str(Path(secret_file()).resolve())}
    return {SECRET_FILE_ENV: str(write_new(_prepared(log_dir) / "secret"))}


# The identity pdserve up's own readiness probes dial the workers with (under <log-dir>/tls).
PROBE_IDENTITY = "up"


def tls_env(s: UpSettings, log_dir: Path) -> dict[str, dict[str, str]]:
    """Each process's ``PDSERVE_TLS_DIR`` by name (the gateway, every worker and
    ``PROBE_IDENTITY``; empty with --no-internal-tls). An exported ``PDSERVE_TLS_DIR`` is
    every process's; otherwise a fresh private CA signs one certificate per process, each in
    ``<log-dir>/tls/<name>/`` (``pdserve.rpc.ca.write_set``; keys mode 0600, the CA's key
    never written). Prints which."""
    if not s.internal_tls:
        print("pdserve up: internal traffic in plain text (--no-internal-tls)", flush=True)
        return {}
    prefill, decode = s.workers()  # of every model
    names = [f"prefill-{i}" for i in range(prefill)] + [f"decode-{i}" for i in range(decode)]
    names += ["gateway", PROBE_IDENTITY]
    if rpc_tls.tls_dir():
        given = str(Path(rpc_tls.tls_dir()).resolve())
        print(f"pdserve up: mutual TLS inside the cluster with {given}", flush=True)
        return {name: {rpc_tls.TLS_DIR_ENV: given} for name in names}
    from pdserve.rpc.ca import write_set

    dirs = write_set(_prepared(log_dir) / "tls", names)
    print(f"pdserve up: mutual TLS inside the cluster, a private CA's certificates in "
          f"{log_dir / 'tls'} (--no-internal-tls: off)", flush=True)  # fmt: skip
    return {name: {rpc_tls.TLS_DIR_ENV: str(path)} for name, path in dirs.items()}


def _prepared(log_dir: Path) -> Path:
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir
