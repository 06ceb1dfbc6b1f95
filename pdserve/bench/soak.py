"""Soak: mixed load for many minutes with periodic faults; failed requests, RSS growth, p99 drift.

Starts ``pdserve up`` (default 2 prefill + 2 decode workers), keeps ``--concurrency`` clients
streaming completions of random lengths (a share of them cancelled mid-stream, as users do),
and every ``--fault-every-s`` breaks one worker in turn: ``kill -9`` of a decode worker's
process group, ``kill -9`` of a prefill worker's, ``SIGSTOP`` of a prefill worker for
``--hang-s`` then ``SIGCONT``. Reports (and writes ``soak.json``): requests ok / failed /
cancelled, the failures' messages, the gateway's and the workers' resident memory at the start
and the end, and the p50/p99 end-to-end latency of the first and the last window. Not in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.systems import pdserve_cluster
from pdserve.placement import machine

WORDS = [
    "river",
    "stone",
    "lamp",
    "garden",
    "signal",
    "winter",
    "orbit",
    "market",
    "paper",
    "violin",
    "harbor",
    "cedar",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--cancel-share", type=float, default=0.1, help="streams cut short")
    parser.add_argument("--fault-every-s", type=float, default=120.0)
    parser.add_argument("--hang-s", type=float, default=20.0, help="SIGSTOP length")
    parser.add_argument("--window-minutes", type=float, default=4.0, help="p99 drift windows")
    parser.add_argument("--port", type=int, default=8600, help="first of the ports used")
    parser.add_argument("--out", default="soak-results")
    parser.add_argument("--seed", type=int, default=0)


@dataclass
class Outcome:
    started: float
    seconds: float
    kind: str  # "ok", "failed", "cancelled"
    detail: str = ""


def one_request(base_url: str, rng: random.Random, cancel: bool) -> Outcome:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 600)))
    max_tokens = rng.randint(8, 48)
    body = {"model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    request = urllib.request.Request(
        base_url + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    started = time.monotonic()
    stop_after = rng.randint(1, max_tokens) if cancel else None
    tokens, finish = 0, ""
    try:
        with urllib.request.urlopen(request, timeout=900) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Outcome(started, time.monotonic() - started, "failed", line[:300])
                for choice in event.get("choices") or []:
                    tokens += 1 if choice.get("text") else 0
                    finish = choice.get("finish_reason") or finish
                if stop_after is not None and tokens >= stop_after:
                    return Outcome(started, time.monotonic() - started, "cancelled")
    except OSError as exc:
        return Outcome(started, time.monotonic() - started, "failed", f"{exc}"[:300])
    ok = finish == "length"
    detail = "" if ok else f"finish {finish!r} after {tokens} of {max_tokens} tokens"
    return Outcome(started, time.monotonic() - started, "ok" if ok else "failed", detail)


def group_rss_mb(port: int) -> float:
    """Resident memory of the process group serving ``port`` (a worker with its engine)."""
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            group = os.getpgid(conn.pid)
            total = 0
            for proc in psutil.process_iter(["pid"]):
                try:
                    if os.getpgid(proc.pid) == group:
                        total += proc.memory_info().rss
                except (psutil.Error, ProcessLookupError):
                    continue
            return total / 2**20
    return 0.0


def fault_loop(args: argparse.Namespace, ports: dict[str, int], stop: threading.Event,
               log: list[str]) -> None:  # fmt: skip
    turn = 0
    while not stop.wait(args.fault_every_s):
        kind = ("kill-decode", "kill-prefill", "hang-prefill")[turn % 3]
        role = "decode" if kind == "kill-decode" else "prefill"
        count = args.decode if role == "decode" else args.prefill
        port = ports[role] + turn // 3 % count
        turn += 1
        try:
            group = _group(port)
        except LookupError:
            log.append(f"{time.strftime('%H:%M:%S')} {kind}: {role} on {port} is down; skipped")
            continue
        log.append(f"{time.strftime('%H:%M:%S')} {kind} ({role} on port {port})")
        print(f"  fault: {log[-1]}", flush=True)
        if kind.startswith("kill"):
            os.killpg(group, signal.SIGKILL)
        else:
            os.killpg(group, signal.SIGSTOP)
            stop.wait(args.hang_s)
            os.killpg(group, signal.SIGCONT)


def _group(port: int) -> int:
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return os.getpgid(conn.pid)
    raise LookupError(port)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p = args.port  # pdserve_cluster's layout: gateway p, prefill p+10.., decode p+30..
    ports = {"gateway": p, "prefill": p + 10, "decode": p + 30}
    outcomes: list[Outcome] = []
    faults: list[str] = []
    with pdserve_cluster(args, out) as base_url:
        workers = [ports["prefill"] + i for i in range(args.prefill)]
        workers += [ports["decode"] + i for i in range(args.decode)]
        rss_start = {port: group_rss_mb(port) for port in [p, *workers]}
        stop = threading.Event()
        end = time.monotonic() + args.minutes * 60

        def client(index: int) -> None:
            rng = random.Random(args.seed * 1000 + index)
            while time.monotonic() < end:
                outcomes.append(one_request(base_url, rng, rng.random() < args.cancel_share))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.concurrency)]
        threads.append(threading.Thread(target=fault_loop, args=(args, ports, stop, faults)))
        print(f"  soak: {args.minutes:.0f} min, {args.concurrency} clients", flush=True)
        for thread in threads:
            thread.start()
        for thread in threads[:-1]:
            thread.join()
        stop.set()
        threads[-1].join()
        time.sleep(30)  # let a worker killed last come back before memory is measured
        rss_end = {port: group_rss_mb(port) for port in [p, *workers]}
    report = summarize(args, outcomes, faults, rss_start, rss_end)
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=2))
    return 0 if not report["failed"] else 1


def summarize(
    args: argparse.Namespace,
    outcomes: list[Outcome],
    faults: list[str],
    rss_start: dict[int, float],
    rss_end: dict[int, float],
) -> dict[str, Any]:
    first = min((o.started for o in outcomes), default=0.0)
    window = args.window_minutes * 60
    ok = [o for o in outcomes if o.kind == "ok"]
    early = [o.seconds for o in ok if o.started - first < window]
    late_start = max((o.started for o in outcomes), default=0.0) - window
    late = [o.seconds for o in ok if o.started >= late_start]
    return {
        "machine": machine.describe(machine.cpu_info()),
        "minutes": args.minutes,
        "requests": len(outcomes),
        "ok": len(ok),
        "failed": sum(o.kind == "failed" for o in outcomes),
        "cancelled": sum(o.kind == "cancelled" for o in outcomes),
        "faults": faults,
        "rss_mb_start": {str(k): round(v) for k, v in rss_start.items()},
        "rss_mb_end": {str(k): round(v) for k, v in rss_end.items()},
        "e2e_s_first_window": {"p50": percentile(early, 0.5), "p99": percentile(early, 0.99)},
        "e2e_s_last_window": {"p50": percentile(late, 0.5), "p99": percentile(late, 0.99)},
        "failures": [asdict(o) for o in outcomes if o.kind == "failed"][:50],
    }
