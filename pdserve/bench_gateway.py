"""Gateway overhead: the TTFT and inter-token latency the gateway adds to a direct stream.

Fake prefill and decode workers (``pdserve.fake_worker``, one process) stream tokens at a
fixed pace; a real gateway (``pdserve gateway``, its own process; prefix routing on a private
Redis unless ``--no-redis``) serves them. This process is the client: one event loop keeps
``--streams`` streams open (a closed loop: each stream runs its requests back to back), three
ways in turn, round after round, on the same workers: straight to the decode worker's gRPC
stream, through the gateway's OpenAI HTTP API (streaming chat) and through its gRPC API. The
gateway's added latency is a percentile through it minus the same percentile direct. The
direct path skips what the gateway adds on purpose: chat template, tokenization, block
hashing, the Redis lookup, the (instant) fake prefill call and the relay.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import TYPE_CHECKING, Any

from pdserve.bench_routing import wait_healthy
from pdserve.machine import cpu_info, describe
from pdserve.redis_server import RedisServer

if TYPE_CHECKING:
    from pdserve.bench_gateway_client import PathResult, Stream

PATHS = ("direct_grpc", "gateway_http", "gateway_grpc")


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
    parser.add_argument("--json", default="", help="also write the results to this file")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prompt(i: int, words: int) -> list[dict[str, str]]:
    """The i-th stream's chat: a distinct ledger of about ``words`` words, then a question."""
    facts: list[str] = []
    k = 0
    while len(facts) * 12 < words:
        facts.append(f"Entry {k} of ledger {i}: item {k * 7 + i} costs {k * 13 % 97} coins.")
        k += 1
    return [{"role": "system", "content": "You are a bookkeeper. " + " ".join(facts)},
            {"role": "user", "content": "What does entry 3 cost?"}]  # fmt: skip


def start_fakes(args: argparse.Namespace) -> tuple[subprocess.Popen[str], dict[str, int]]:
    fakes = subprocess.Popen(
        [sys.executable, "-m", "pdserve.fake_worker", "--tokens", str(args.tokens),
         "--interval-ms", str(args.interval_ms)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert fakes.stdout is not None
    line = fakes.stdout.readline()  # its one JSON line, once both servers listen
    if not line:
        raise RuntimeError(f"the fake workers did not start (exit {fakes.wait()})")
    return fakes, json.loads(line)


def start_gateway(
    args: argparse.Namespace, ports: dict[str, int], redis_url: str, logs: str
) -> tuple[subprocess.Popen[bytes], int, int]:
    http, grpc = _free_port(), _free_port()
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
    log = open(os.path.join(logs, "gateway.log"), "ab")  # noqa: SIM115 (the child owns it)
    gateway = subprocess.Popen(
        command, env={**os.environ, "PDSERVE_LOG_LEVEL": "WARNING"}, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    return gateway, http, grpc


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used so far; None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _stop(processes: list[subprocess.Popen[Any]]) -> None:
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
    print(f"gateway overhead: {args.streams} concurrent streams x {args.tokens} tokens every "
          f"{args.interval_ms:g} ms, {args.requests} requests per stream x {args.rounds} "
          f"rounds; {describe(machine)}; logs in {logs}", flush=True)  # fmt: skip
    redis = None if args.no_redis else RedisServer().start()
    processes: list[subprocess.Popen[Any]] = []
    try:
        fakes, ports = start_fakes(args)
        processes.append(fakes)
        gateway, http, grpc = start_gateway(args, ports, redis.url if redis else "", logs)
        processes.append(gateway)
        wait_healthy(f"http://127.0.0.1:{http}", prefill=1, timeout_s=120)
        targets = {"decode": f"127.0.0.1:{ports['decode']}", "http": f"http://127.0.0.1:{http}",
                   "grpc": f"127.0.0.1:{grpc}"}  # fmt: skip
        results, extra = asyncio.run(measure(args, targets, gateway.pid))
    finally:
        _stop(list(reversed(processes)))
        if redis is not None:
            redis.stop()
    report = build_report(args, machine, results, extra)
    print_report(report)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0 if all(report["paths"][p]["failed"] == 0 for p in PATHS) else 1


async def measure(
    args: argparse.Namespace, targets: dict[str, str], gateway_pid: int
) -> tuple[dict[str, PathResult], dict[str, Any]]:
    from pdserve.bench_gateway_client import PathResult, Paths
    from pdserve.client import GatewayClient

    prompts = [prompt(i, args.prompt_words) for i in range(args.streams)]
    async with GatewayClient(targets["grpc"]) as client:  # the ids the gateway would send
        prompt_ids = [await client.tokenize(messages=p) for p in prompts]
    with urllib.request.urlopen(targets["http"] + "/v1/models", timeout=10) as response:
        model = json.loads(response.read())["data"][0]["id"]
    paths = Paths(targets["decode"], targets["grpc"], targets["http"], model, prompts, prompt_ids)
    await paths.open(args.streams)
    results = {name: PathResult() for name in PATHS}
    cpu = {name: {"gateway_s": 0.0, "client_s": 0.0, "wall_s": 0.0} for name in PATHS}
    try:
        streams = paths.streams(args.tokens)
        for r in range(args.rounds):
            for k in range(len(PATHS)):
                name = PATHS[(r + k) % len(PATHS)]  # rotate the order round by round
                label = f"round {r + 1}/{args.rounds} {name}"
                if name == "gateway_http":
                    await paths.reopen_http(args.streams)
                await _phase(args, label, streams[name], results[name], cpu[name], gateway_pid)
    finally:
        await paths.close()
    prompt_tokens = sum(len(ids) for ids in prompt_ids) / len(prompt_ids)
    return results, {"cpu": cpu, "prompt_tokens_mean": prompt_tokens}


async def _phase(
    args: argparse.Namespace,
    label: str,
    stream: Stream,
    result: PathResult,
    cpu: dict[str, float],
    gateway_pid: int,
) -> None:
    """One timed phase of one path; adds its wall time and CPU seconds to ``cpu``."""
    from pdserve.bench_gateway_client import run_phase

    def progress(done: int) -> None:  # a live line on a terminal only
        print(f"\r{label}: {done}/{args.streams} streams", end="", flush=True)

    failed_before = result.failed
    gateway_cpu, client_cpu = _cpu_s(gateway_pid), time.process_time()
    wall = await run_phase(
        stream, args.streams, args.tokens, args.requests, args.tokens * args.interval_ms / 1000,
        result, progress if sys.stdout.isatty() else None,
    )  # fmt: skip
    gateway_after = _cpu_s(gateway_pid)
    cpu["wall_s"] += wall
    cpu["client_s"] += time.process_time() - client_cpu
    if gateway_cpu is not None and gateway_after is not None:
        cpu["gateway_s"] += gateway_after - gateway_cpu
    failed = result.failed - failed_before
    print(f"\r{label}: {args.streams} streams in {wall:.1f} s, {failed} failed", flush=True)


def _pct(samples: list[float]) -> dict[str, float | None]:
    """p50/p99 in milliseconds (inclusive method: never beyond the extremes)."""
    import statistics

    if len(samples) < 2:
        value = samples[0] * 1000 if samples else None
        return {"p50": value, "p99": value}
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50": q[49] * 1000, "p99": q[98] * 1000}


def build_report(
    args: argparse.Namespace,
    machine: dict[str, Any],
    results: dict[str, PathResult],
    extra: dict[str, Any],
) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for name, r in results.items():
        cpu = extra["cpu"][name]
        paths[name] = {
            "requests": r.requests, "failed": r.failed, "tokens": r.tokens,
            "ttft_ms": _pct(r.ttft), "itl_ms": _pct(r.itl), "errors": r.errors,
            "client_cpu_share": cpu["client_s"] / cpu["wall_s"] if cpu["wall_s"] else None,
            "gateway_cpu_us_per_token": cpu["gateway_s"] / r.tokens * 1e6 if r.tokens else None,
            "requests_per_s": r.requests / cpu["wall_s"] if cpu["wall_s"] else None,
        }  # fmt: skip
    added: dict[str, Any] = {}
    base = paths["direct_grpc"]
    for name in ("gateway_http", "gateway_grpc"):
        added[name] = {
            metric: {q: _minus(paths[name][metric][q], base[metric][q]) for q in ("p50", "p99")}
            for metric in ("ttft_ms", "itl_ms")
        }
    argv = ["pdserve", "bench", "gateway", "--streams", str(args.streams), "--tokens",
            str(args.tokens), "--requests", str(args.requests), "--interval-ms",
            f"{args.interval_ms:g}", "--rounds", str(args.rounds), "--prompt-words",
            str(args.prompt_words)]  # fmt: skip
    if args.prompt_threads is not None:
        argv += ["--prompt-threads", str(args.prompt_threads)]
    if args.no_redis:
        argv.append("--no-redis")
    return {
        "bench": "gateway", "command": shlex.join(argv), "machine": machine,
        "config": {"streams": args.streams, "tokens": args.tokens, "requests": args.requests,
                   "interval_ms": args.interval_ms, "rounds": args.rounds,
                   "prompt_words": args.prompt_words,
                   "prompt_tokens_mean": extra["prompt_tokens_mean"],
                   "prompt_threads": args.prompt_threads, "redis": not args.no_redis},
        "paths": paths, "added_by_gateway_ms": added,
    }  # fmt: skip


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def print_report(report: dict[str, Any]) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    print(f"\n{describe(report['machine'])}")
    print(f"{'path':<13} {'requests':>8} {'failed':>6}  {'TTFT p50':>8} {'p99':>7}  "
          f"{'ITL p50':>7} {'p99':>7}  (ms)  {'gw CPU/token':>12}")  # fmt: skip
    for name, p in report["paths"].items():
        per_token = p["gateway_cpu_us_per_token"] if name != "direct_grpc" else None
        cost = "-" if per_token is None else f"{per_token:.0f} us"
        print(f"{name:<13} {p['requests']:>8} {p['failed']:>6}  {ms(p['ttft_ms']['p50']):>8} "
              f"{ms(p['ttft_ms']['p99']):>7}  {ms(p['itl_ms']['p50']):>7} "
              f"{ms(p['itl_ms']['p99']):>7}        {cost:>12}")  # fmt: skip
    print("added by the gateway (same percentile, gateway minus direct):")
    for name, a in report["added_by_gateway_ms"].items():
        print(f"  {name}: TTFT p50 {ms(a['ttft_ms']['p50'])} ms, p99 {ms(a['ttft_ms']['p99'])} ms;"
              f" ITL p50 {ms(a['itl_ms']['p50'])} ms, p99 {ms(a['itl_ms']['p99'])} ms")  # fmt: skip
    for name, p in report["paths"].items():
        for error in p["errors"]:
            print(f"  {name} error: {error}")
