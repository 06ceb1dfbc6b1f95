"""Fleet scale: routing time, Redis load and index memory, stickiness and spread against N workers.

For each fleet size N in ``--workers``: a private redis-server; one process hosting N fake
workers (``pdserve.bench.fleet_workers``: N/2 prefill + N/2 decode, real gRPC servers, each
registered with heartbeats and writing its cache's blocks into the prefix index); ``--blocks``
random blocks preloaded over them (scaled with N below the largest N); ``--gateways`` real
``pdserve gateway`` processes (prefix picker, workers discovered from Redis); then this process
sends multi-turn chats through them at ``--rate`` requests/s for ``--duration`` s
(``pdserve.bench.fleet_client``). Figures (``pdserve.bench.fleet_report``), per gateway and in
total: routing decision p50/p99, Redis commands and CPU per request, index bytes per
block-holder pair, Redis commands/s while idle (heartbeats, discovery), the share of later
turns computed by the worker that computed the previous one, and the spread of new
conversations over the workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.bench import fleet_report as report
from pdserve.bench.fleet_client import Turn, run_load
from pdserve.bench.gateway import process_cpu_s, stop_processes
from pdserve.bench.routing import wait_healthy
from pdserve.cluster.redis_server import RedisServer, free_ports
from pdserve.placement.machine import cpu_info, describe
from pdserve.settings import default_model_dir

ROUTE_METRIC = "pdserve_gateway_route_seconds"
GATEWAY_ATTEMPTS = 3  # gateway starts tried, each on fresh ports


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(n < 2 or n % 2 for n in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: even worker counts, comma-separated")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers",
        type=_sizes,
        default=[16, 64, 256],
        help="fleet sizes N, comma-separated (half prefill, half decode)",
    )
    parser.add_argument("--gateways", type=int, default=2, help="gateway replicas M")
    parser.add_argument("--blocks", type=int, default=1_000_000,
                        help="preloaded block-holder pairs at the largest N "
                        "(smaller N: in proportion)")  # fmt: skip
    parser.add_argument("--cache-blocks", type=int, default=0,
                        help="blocks each worker's cache holds (0: its preloaded share, so "
                        "each new block evicts the oldest)")  # fmt: skip
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=60.0, help="s of new conversations")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--think-s", type=float, default=1.0, help="mean pause between turns")
    parser.add_argument("--prompt-words", type=int, default=200,
                        help="words of each conversation's system prompt")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=4, help="tokens per answer")
    parser.add_argument("--idle-s", type=float, default=10.0,
                        help="idle window for the heartbeat load")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="write fleet.json, fleet.md, fleet.png here")


def command(args: argparse.Namespace) -> str:
    argv = ["pdserve", "bench", "fleet", "--workers", ",".join(map(str, args.workers)),
            "--gateways", str(args.gateways), "--blocks", str(args.blocks), "--rate",
            f"{args.rate:g}", "--duration", f"{args.duration:g}", "--turns", str(args.turns),
            "--think-s", f"{args.think_s:g}", "--prompt-words", str(args.prompt_words),
            "--tokens", str(args.tokens), "--idle-s", f"{args.idle_s:g}", "--seed",
            str(args.seed)]  # fmt: skip
    if args.cache_blocks:
        argv += ["--cache-blocks", str(args.cache_blocks)]
    return shlex.join(argv)


class Fleet:
    """The fake workers' process and its line protocol (``fleet_workers``)."""

    def __init__(self, args: argparse.Namespace, n: int, blocks: int, redis_url: str,
                 model: str, log: Path) -> None:  # fmt: skip
        argv = [sys.executable, "-m", "pdserve.bench.fleet_workers", "--workers", str(n),
                "--redis-url", redis_url, "--model", model, "--blocks", str(blocks),
                "--cache-blocks", str(args.cache_blocks), "--tokens", str(args.tokens),
                "--seed", str(args.seed)]  # fmt: skip
        with open(log, "ab") as err:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        self.read("registered")

    def read(self, key: str | None) -> Any:
        """The next answer's ``key`` (None: the whole answer)."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the fake fleet exited ({self.process.wait()}); see its log")
        answer = json.loads(line)
        return answer if key is None else answer[key]

    def ask(self, command: str, key: str | None) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read(key)

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()  # end of input: it stops
        stop_processes([self.process])


def start_gateway(redis_url: str, prefill: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    for attempt in range(1, GATEWAY_ATTEMPTS + 1):
        http, grpc = free_ports(2)
        argv = [
            sys.executable,
            "-m",
            "pdserve",
            "gateway",
            "--http-port",
            str(http),
            "--grpc-port",
            str(grpc),
            "--redis-url",
            redis_url,
            "--picker",
            "prefix",
        ]
        with open(log, "ab") as out:
            gateway = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                       env={**os.environ, "PDSERVE_LOG_LEVEL": "WARNING"},
                                       start_new_session=True)  # fmt: skip
        url = f"http://127.0.0.1:{http}"
        try:
            wait_healthy(url, prefill=prefill, up=gateway, timeout_s=180)
            return gateway, url
        except RuntimeError:
            stop_processes([gateway])
            if gateway.returncode == 0 or attempt == GATEWAY_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def _route_buckets(url: str) -> report.Buckets:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return report.parse_histogram(response.read().decode(), ROUTE_METRIC)


def snapshot(redis: Any, gateways: list[tuple[subprocess.Popen[bytes], str]],
             fleet: Fleet) -> dict[str, Any]:  # fmt: skip
    return {
        "calls": report.command_calls(redis.info("commandstats")),
        "redis_cpu_s": report.cpu_seconds(redis.info("cpu")),
        "route": [_route_buckets(url) for _, url in gateways],
        "gateway_cpu_s": [process_cpu_s(p.pid) for p, _ in gateways],
        "fleet_cpu_s": process_cpu_s(fleet.process.pid),
        "client_cpu_s": time.process_time(),
        **fleet.ask("stats", None),  # served (per worker), dropped (index writes)
        "at": time.monotonic(),
    }


def measure_point(args: argparse.Namespace, n: int, blocks: int, logs: Path) -> dict[str, Any]:
    import redis as redis_py

    model = default_model_dir().name
    server = RedisServer(log_file=logs / f"redis-{n}.log").start()
    processes: list[subprocess.Popen[Any]] = []
    fleet = None
    try:
        client = redis_py.Redis.from_url(server.url)
        fleet = Fleet(args, n, blocks, server.url, model, logs / f"fleet-{n}.log")
        empty = int(client.info("memory")["used_memory"])
        pairs = int(fleet.ask("preload", "preloaded"))
        loaded = int(client.info("memory")["used_memory"])
        gateways = []
        for g in range(args.gateways):
            gateways.append(start_gateway(server.url, n // 2, logs / f"gateway-{n}-{g}.log"))
            processes.append(gateways[-1][0])
        urls = [url for _, url in gateways]
        with urllib.request.urlopen(urls[0] + "/v1/models", timeout=10) as response:
            served_model = json.loads(response.read())["data"][0]["id"]
        idle_before = report.command_calls(client.info("commandstats"))
        idle_cpu = [process_cpu_s(p.pid) for p, _ in gateways]
        idle_redis = report.cpu_seconds(client.info("cpu"))
        time.sleep(args.idle_s)
        idle_redis = report.cpu_seconds(client.info("cpu")) - idle_redis
        idle = report.calls_delta(report.command_calls(client.info("commandstats")), idle_before)
        idle_cpu = [
            report.minus(process_cpu_s(p.pid), c)
            for (p, _), c in zip(gateways, idle_cpu, strict=True)
        ]
        before = snapshot(client, gateways, fleet)
        turns, wall = asyncio.run(run_load(urls, served_model, args))
        after = snapshot(client, gateways, fleet)
    finally:
        stop_processes(list(reversed(processes)))
        if fleet is not None:
            fleet.stop()
        server.stop()
    result = point(args, n, pairs, (empty, loaded), idle, before, after, turns, wall)
    # A gateway's CPU with no requests (health checks, discovery, load sharing) and what
    # each request adds beyond it.
    idle_share = None if None in idle_cpu else sum(c or 0.0 for c in idle_cpu) / args.idle_s
    total = result["total"]
    total["gateway_idle_cpu_share"] = idle_share
    total["redis_idle_cpu_share"] = idle_redis / args.idle_s
    spent_redis = total["redis_cpu_ms_per_request"] * total["requests"] / 1000
    total["redis_request_cpu_ms_per_request"] = report.ms(
        report.per(spent_redis - idle_redis / args.idle_s * wall, total["requests"])
    )
    if idle_share is not None and total["gateway_cpu_ms_per_request"] is not None:
        spent = total["gateway_cpu_ms_per_request"] * total["requests"] / 1000
        total["gateway_request_cpu_ms_per_request"] = report.ms(
            report.per(spent - idle_share * wall, total["requests"])
        )
    return result


def point(args: argparse.Namespace, n: int, pairs: int, memory: tuple[int, int],
          idle: dict[str, int], before: dict[str, Any], after: dict[str, Any],
          turns: list[Turn], wall: float) -> dict[str, Any]:  # fmt: skip
    """One fleet size's figures from the raw counters and the client's turns."""
    workers = {r: [f"fleet-{r[0]}{i:03d}" for i in range(n // 2)] for r in ("prefill", "decode")}
    calls = report.calls_delta(after["calls"], before["calls"])
    requests = len(turns)
    route = [
        report.bucket_delta(a, b) for a, b in zip(after["route"], before["route"], strict=True)
    ]
    gw_cpu = [
        report.minus(a, b)
        for a, b in zip(after["gateway_cpu_s"], before["gateway_cpu_s"], strict=True)
    ]
    served = {w: after["served"][w] - before["served"].get(w, 0) for w in after["served"]}

    def figures(subset: list[Turn], buckets: report.Buckets, cpu: float | None) -> dict[str, Any]:
        pairs_ = report.later_turns(turns)
        mine = {(t.conversation, t.turn) for t in subset}
        pairs_ = [(p, t) for p, t in pairs_ if (t.conversation, t.turn) in mine]
        spreads = {r: report.spread(report.new_requests(subset, r), workers[r]) for r in workers}
        known = [s for s in spreads.values() if s is not None]
        return {
            "requests": len(subset), "failed": sum(1 for t in subset if not t.ok),
            "route_p50_ms": report.ms(report.histogram_quantile(buckets, 0.5)),
            "route_p99_ms": report.ms(report.histogram_quantile(buckets, 0.99)),
            "routing_decisions": buckets[-1][1] if buckets else 0,
            "route_over_100ms": report.beyond(buckets),
            "later_turns": len(pairs_), "holder_share": report.holder_share(pairs_),
            "hit_share": report.hit_share(pairs_, 16),
            "spread": max(known) if known else None,
            "spread_prefill": spreads["prefill"], "spread_decode": spreads["decode"],
            "gateway_cpu_ms_per_request": report.ms(report.per(cpu, len(subset))),
        }  # fmt: skip

    per_gateway = [
        figures([t for t in turns if t.gateway == g], route[g], gw_cpu[g])
        for g in range(len(route))
    ]
    all_cpu = None if None in gw_cpu else sum(c for c in gw_cpu if c is not None)
    total = figures(turns, report.add_buckets(route), all_cpu)
    redis_cpu = after["redis_cpu_s"] - before["redis_cpu_s"]
    total.update({
        "requests_per_s": requests / wall if wall else None,
        "redis_commands_per_request": report.per(sum(calls.values()), requests),
        # less what the idle rate (heartbeats, discovery, load sharing) accounts for
        "redis_request_commands_per_request": report.per(
            sum(calls.values()) - sum(idle.values()) / args.idle_s * wall, requests),
        "redis_scripts_per_request": report.per(calls.get("evalsha", 0), requests),
        "redis_cpu_ms_per_request": report.ms(report.per(redis_cpu, requests)),
        "redis_cpu_share": redis_cpu / wall if wall else None,
        "index_bytes_per_pair": report.per(memory[1] - memory[0], pairs),
        "idle_commands_per_s": sum(idle.values()) / args.idle_s,
        "idle_commands_per_s_per_worker": sum(idle.values()) / args.idle_s / n,
        "served_spread": report.spread(served, [*workers["prefill"], *workers["decode"]]),
        "index_writes_dropped": after["dropped"],
        # busy share of one core over the run: where this machine's CPU went
        "cpu_share": {
            "gateways": report.per(all_cpu, wall),
            "fake_workers": report.per(report.minus(after["fleet_cpu_s"], before["fleet_cpu_s"]),
                                       wall),
            "redis": redis_cpu / wall if wall else None,
            "client": (after["client_cpu_s"] - before["client_cpu_s"]) / wall if wall else None,
        },
    })  # fmt: skip
    errors = sorted({t.error for t in turns if t.error})[:5]
    return {
        "workers": n, "prefill_workers": n // 2, "decode_workers": n // 2,
        "index_pairs": pairs, "used_memory_empty": memory[0], "used_memory_loaded": memory[1],
        "wall_s": wall, "redis_calls": calls, "idle_calls": idle,
        "total": total, "gateways": per_gateway, "errors": errors,
    }  # fmt: skip


def blocks_at(args: argparse.Namespace, n: int) -> int:
    return round(args.blocks * n / max(args.workers))


def run(args: argparse.Namespace) -> int:
    try:
        import httpx  # noqa: F401 (the HTTP client; a dev dependency)
    except ImportError:
        print("pdserve bench fleet needs httpx: pip install 'pdserve[dev]'", file=sys.stderr)
        return 2
    machine = cpu_info()
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-fleet-"))
    out = Path(args.out) if args.out else logs
    out.mkdir(parents=True, exist_ok=True)
    print(f"fleet: {describe(machine)}; logs in {logs}", flush=True)
    points = []
    for n in args.workers:
        print(f"N={n}: {blocks_at(args, n):,} blocks, {args.gateways} gateways, "
              f"{args.rate:g} requests/s for {args.duration:g} s", flush=True)  # fmt: skip
        points.append(measure_point(args, n, blocks_at(args, n), logs))
        print(report.table(points[-1:]), flush=True)
    result = {"bench": "fleet", "command": command(args), "machine": machine,
              "machine_line": describe(machine), "points": points}  # fmt: skip
    (out / "fleet.json").write_text(json.dumps(result, indent=2))
    text = (f"{describe(machine)}\n\n`{command(args)}`\n\n{report.table(points)}\n\n"
            f"{report.gateway_table(points)}\n")  # fmt: skip
    (out / "fleet.md").write_text(text)
    report.plot(points, out / "fleet.png")
    print(f"\n{text}\nwritten: {out}/fleet.json, fleet.md, fleet.png")
    return 0 if all(p["total"]["failed"] == 0 for p in points) else 1
