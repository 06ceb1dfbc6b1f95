"""Gateway overhead: the TTFT and inter-token latency the gateway adds to a direct stream.

Fake prefill and decode workers (``pdserve.bench.fake_worker``, one process) stream tokens at a
fixed pace; a real gateway (``pdserve gateway``, its own process; prefix routing on a private
Redis unless ``--no-redis``) serves them. This process is the client: one event loop keeps
``--streams`` streams open (a closed loop: each stream runs its requests back to back), three
ways in turn, round after round, on the same workers: straight to the decode worker's gRPC
stream, through the gateway's OpenAI HTTP API (streaming chat) and through its gRPC API. The
gateway's added latency is a percentile through it minus the same percentile direct. The
direct path skips what the gateway adds on purpose: chat template, tokenization, block
hashing, the Redis lookup, the (instant) fake prefill call and the relay.

``--tracing on`` runs the gateway and fake workers with tracing on (spans exported over OTLP
to a receiver this benchmark starts); ``--tracing compare`` runs two of them, one traced and
one not, and interleaves their phases through the gateway paths round by round
(``pdserve.bench.gateway_tracing``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.bench import gateway_tracing as tracing_bench
from pdserve.bench.gateway_report import GATEWAY_PATHS, PATHS, build_report, minus, print_report
from pdserve.bench.routing import wait_healthy
from pdserve.cluster.redis_server import RedisServer, free_ports
from pdserve.placement.machine import cpu_info, describe

if TYPE_CHECKING:
    from pdserve.bench.gateway_client import PathResult, Stream


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, default=256, help="concurrent streams per path")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per stream")
    parser.add_argument("--requests", type=int, default=2,
                        help="measured requests per stream per round, back to back")  # fmt: skip
    parser.add_argument("--interval-ms", type=float, default=50.0,
                        help="the fake decode worker's pause before each token")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every path")
    parser.add_argument("--prompt-words", type=int, default=400,
                        help="words of each chat prompt (about 2 tokens per word)")  # fmt: skip
    parser.add_argument("--prompt-threads", type=int, default=None,
                        help="the gateway's --prompt-threads (default: its default)")  # fmt: skip
    parser.add_argument("--no-redis", action="store_true",
                        help="no Redis: round-robin routing, no block hashing")  # fmt: skip
    parser.add_argument("--model", default="", help="model dir for the gateway's tokenizer")
    parser.add_argument("--gateway-args", default="",
                        help="more flags for the gateway, e.g. '--tool-call-parser hermes "
                        "--enable-auto-tool-choice' (vLLM's parsers on every chat)")  # fmt: skip
    parser.add_argument("--tracing", choices=tuple(tracing_bench.ARMS), default="off",
                        help="off (default); on: gateway and fake workers export every span "
                        "over OTLP to a receiver started here; compare: one gateway of each, "
                        "their phases interleaved, and the throughput ratio on/off")  # fmt: skip
    parser.add_argument("--trace-ratio", type=_ratio, default=1.0,
                        help="with --tracing on/compare: the share of requests traced "
                        "(default 1: every one, sampler always_on)")  # fmt: skip
    parser.add_argument("--json", default="", help="also write the results to this file")


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share in (0, 1]")
    return value


def prompt(i: int, words: int) -> list[dict[str, str]]:
    """The i-th stream's chat: a distinct ledger of about ``words`` words, then a question."""
    facts: list[str] = []
    k = 0
    while len(facts) * 12 < words:
        facts.append(f"Entry {k} of ledger {i}: item {k * 7 + i} costs {k * 13 % 97} coins.")
        k += 1
    return [{"role": "system", "content": "You are a bookkeeper. " + " ".join(facts)},
            {"role": "user", "content": "What does entry 3 cost?"}]  # fmt: skip


def start_fakes(
    args: argparse.Namespace, env: dict[str, str]
) -> tuple[subprocess.Popen[str], dict[str, int]]:
    fakes = subprocess.Popen(
        [sys.executable, "-m", "pdserve.bench.fake_worker", "--tokens", str(args.tokens),
         "--interval-ms", str(args.interval_ms)],
        stdout=subprocess.PIPE, text=True, start_new_session=True, env=env,
    )  # fmt: skip
    assert fakes.stdout is not None
    line = fakes.stdout.readline()  # its one JSON line, once both servers listen
    if not line:
        raise RuntimeError(f"the fake workers did not start (exit {fakes.wait()})")
    return fakes, json.loads(line)


def start_gateway(
    args: argparse.Namespace,
    ports: dict[str, int],
    redis_url: str,
    log_path: str,
    env: dict[str, str],
) -> tuple[subprocess.Popen[bytes], int, int]:
    http, grpc = free_ports(2)
    command = [
        sys.executable, "-m", "pdserve", "gateway", "--http-port", str(http),
        "--grpc-port", str(grpc), "--prefill-workers", f"127.0.0.1:{ports['prefill']}",
        "--decode-workers", f"127.0.0.1:{ports['decode']}",
    ]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    if redis_url:
        command += ["--redis-url", redis_url]
    if args.prompt_threads is not None:
        command += ["--prompt-threads", str(args.prompt_threads)]
    command += shlex.split(args.gateway_args)
    log = open(log_path, "ab")  # noqa: SIM115 (the child owns it)
    gateway = subprocess.Popen(
        command, env={**env, "PDSERVE_LOG_LEVEL": "WARNING"}, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    return gateway, http, grpc


@dataclass
class Stack:
    """One arm: fake workers and a gateway, in their own processes."""

    processes: list[subprocess.Popen[Any]]
    targets: dict[str, str]  # decode (direct), http and grpc (the gateway's)
    gateway_pid: int
    fakes_pid: int
    start_s: float = 0.0  # from the gateway's start to its first healthy answer


GATEWAY_ATTEMPTS = 3  # gateway starts tried, each on fresh ports


def start_stack(
    args: argparse.Namespace, arm: str, env: dict[str, str], redis_url: str, logs: str
) -> Stack:
    """Start one arm; its processes are stopped here if it does not become healthy."""
    stack = Stack([], {}, 0, 0)
    try:
        fakes, ports = start_fakes(args, env)
        stack.processes.append(fakes)
        log = os.path.join(logs, "gateway.log" if args.tracing == "off" else f"gateway-{arm}.log")
        for attempt in range(1, GATEWAY_ATTEMPTS + 1):
            started = time.monotonic()
            gateway, http, grpc = start_gateway(args, ports, redis_url, log, env)
            stack.processes.append(gateway)
            try:
                wait_healthy(f"http://127.0.0.1:{http}", prefill=1, up=gateway, timeout_s=120)
                stack.start_s = time.monotonic() - started
                break
            except RuntimeError:
                if gateway.poll() is None or attempt == GATEWAY_ATTEMPTS:
                    raise
                # It exited: another process took a port it was given between the choice
                # and its bind. Again on fresh ports.
                stack.processes.remove(gateway)
    except BaseException:
        stop_processes(list(reversed(stack.processes)))
        raise
    stack.gateway_pid, stack.fakes_pid = gateway.pid, fakes.pid
    stack.targets = {"decode": f"127.0.0.1:{ports['decode']}",
                     "http": f"http://127.0.0.1:{http}", "grpc": f"127.0.0.1:{grpc}"}  # fmt: skip
    return stack


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used so far; None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_mib(pid: int) -> float | None:
    """The most memory a process has held so far (VmHWM), MiB; None off Linux."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def stop_processes(processes: list[subprocess.Popen[Any]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run(args: argparse.Namespace) -> int:
    try:
        import httpx  # noqa: F401 (the HTTP client; a dev dependency)
    except ImportError:
        print("pdserve bench gateway needs httpx: pip install 'pdserve[dev]'", file=sys.stderr)
        return 2
    machine = cpu_info()
    logs = tempfile.mkdtemp(prefix="pdserve-bench-gateway-")
    arms = tracing_bench.ARMS[args.tracing]
    paths = GATEWAY_PATHS if args.tracing == "compare" else PATHS
    print(f"gateway overhead: {args.streams} concurrent streams x {args.tokens} tokens every "
          f"{args.interval_ms:g} ms, {args.requests} requests per stream x {args.rounds} "
          f"rounds, tracing {args.tracing}; {describe(machine)}; logs in {logs}",
          flush=True)  # fmt: skip
    redis = None if args.no_redis else RedisServer().start()
    receiver = None
    stacks: dict[str, Stack] = {}
    spans: dict[str, Any] = {}
    receiver_cpu = None
    try:
        receiver = tracing_bench.ReceiverProcess() if args.tracing != "off" else None
        endpoint = receiver.endpoint if receiver else ""
        envs = tracing_bench.arm_envs(args.tracing, arms, endpoint, args.trace_ratio)
        for arm in arms:
            stacks[arm] = start_stack(args, arm, envs[arm], redis.url if redis else "", logs)
        results, phases, prompt_tokens = asyncio.run(measure(args, stacks, paths))
        gateways = {arm: {"start_s": s.start_s, "peak_rss_mib": peak_rss_mib(s.gateway_pid)}
                    for arm, s in stacks.items()}  # fmt: skip
    finally:
        # Gateways first, then the fakes; each exports its last spans as it exits.
        stop_processes([p for stack in stacks.values() for p in reversed(stack.processes)])
        if receiver is not None:
            receiver_cpu = process_cpu_s(receiver.process.pid)
            spans = tracing_bench.spans_by_arm(receiver.close(), arms)
        if redis is not None:
            redis.stop()
    traced = tracing_bench.describe_tracing(args.tracing, args.trace_ratio, spans, receiver_cpu)
    report = build_report(args, machine, results, phases, prompt_tokens, traced)
    report["gateway_process"] = gateways
    print_report(report)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    failed = sum(p["failed"] for p in phases)
    return 0 if failed == 0 and not tracing_bench.span_problems(spans) else 1


def _rotate(items: tuple[str, ...], r: int) -> tuple[str, ...]:
    """``items`` rotated left by ``r``: round by round, each item takes each place in turn."""
    r %= len(items)
    return items[r:] + items[:r]


async def measure(
    args: argparse.Namespace, stacks: dict[str, Stack], paths: tuple[str, ...]
) -> tuple[dict[str, dict[str, PathResult]], list[dict[str, Any]], float]:
    """Every round runs every (arm, path) phase once. One arm: the paths in rotating order.
    Several: each path's arms back to back, their order alternating round by round, and the
    paths in a fixed order, so that every phase has the same predecessors as its other arm's
    twin and none follows itself (rotating both made one arm's HTTP phases and the other's
    gRPC phases run twice in a row). Returns the samples per arm and path, one record per
    phase, and the mean prompt length."""
    from pdserve.bench.gateway_client import PathResult, Paths
    from pdserve.cli.client import GatewayClient

    prompts = [prompt(i, args.prompt_words) for i in range(args.streams)]
    prompt_ids: list[list[int]] = []
    for stack in stacks.values():  # the ids the gateway would send; warms up each gateway
        async with GatewayClient(stack.targets["grpc"]) as gateway:
            ids = [await gateway.tokenize(messages=p) for p in prompts]
        if prompt_ids and ids != prompt_ids:
            raise RuntimeError("the gateways of the two arms tokenize differently")
        prompt_ids = ids
    first = next(iter(stacks.values())).targets
    with urllib.request.urlopen(first["http"] + "/v1/models", timeout=10) as response:
        model = json.loads(response.read())["data"][0]["id"]
    clients = {arm: Paths(s.targets["decode"], s.targets["grpc"], s.targets["http"], model,
                          prompts, prompt_ids) for arm, s in stacks.items()}  # fmt: skip
    results = {arm: {name: PathResult() for name in paths} for arm in stacks}
    phases: list[dict[str, Any]] = []
    try:
        for client in clients.values():
            await client.open(args.streams)
        streams = {arm: client.streams(args.tokens) for arm, client in clients.items()}
        for r in range(args.rounds):
            for name in _rotate(paths, r) if len(stacks) == 1 else paths:
                for arm in _rotate(tuple(stacks), r):
                    label = f"round {r + 1}/{args.rounds} {name}"
                    if len(stacks) > 1:
                        label += f" tracing {arm}"
                    if name == "gateway_http":
                        await clients[arm].reopen_http(args.streams)
                    phase = await _phase(args, label, streams[arm][name], results[arm][name],
                                         stacks[arm])  # fmt: skip
                    phases.append({"round": r + 1, "arm": arm, "path": name, **phase})
    finally:
        for client in clients.values():
            await client.close()
    return results, phases, sum(len(ids) for ids in prompt_ids) / len(prompt_ids)


async def _phase(
    args: argparse.Namespace, label: str, stream: Stream, result: PathResult, stack: Stack
) -> dict[str, Any]:
    """One timed phase of one path: its wall time, the CPU seconds of the client, the gateway
    and the fake workers (None off Linux), requests, tokens and failures."""
    from pdserve.bench.gateway_client import run_phase

    def progress(done: int) -> None:  # a live line on a terminal only
        print(f"\r{label}: {done}/{args.streams} streams", end="", flush=True)

    before = (result.requests, result.tokens, result.failed)
    pids = {"gateway_cpu_s": stack.gateway_pid, "fakes_cpu_s": stack.fakes_pid}
    cpu_before, client_cpu = {k: process_cpu_s(pid) for k, pid in pids.items()}, time.process_time()
    wall = await run_phase(
        stream, args.streams, args.tokens, args.requests, args.tokens * args.interval_ms / 1000,
        result, progress if sys.stdout.isatty() else None,
    )  # fmt: skip
    cpu_after = {k: process_cpu_s(pid) for k, pid in pids.items()}
    phase: dict[str, Any] = {
        "wall_s": wall, "client_cpu_s": time.process_time() - client_cpu,
        **{k: minus(cpu_after[k], cpu_before[k]) for k in pids},
        "requests": result.requests - before[0], "tokens": result.tokens - before[1],
        "failed": result.failed - before[2],
    }  # fmt: skip
    print(f"\r{label}: {args.streams} streams in {wall:.1f} s, {phase['failed']} failed, "
          f"{phase['requests'] / wall:.1f} requests/s", flush=True)  # fmt: skip
    return phase
