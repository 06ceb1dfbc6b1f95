"""Prefix-cache hit rate and TTFT of cache-aware vs round-robin routing on a real cluster.

One ``pdserve up`` cluster (prefill and decode workers, a private Redis, the cache-aware
gateway) plus a second gateway on the same workers that routes round robin. A multi-turn
chat workload (each conversation starts with a long system prompt and grows turn by turn)
runs on both, one request at a time, alternating between the gateways so that both see the
same machine; each gateway gets its own conversations, so they never share a cached prefix.
Conditional disaggregation is off in both, so every request is computed by a prefill worker:
the comparison is about which one. Hit rate = cached prompt tokens / prompt tokens, as the
workers report them in ``usage``; TTFT = request sent to first streamed content.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from pdserve.cluster.redis_server import RedisServer

NO_CONDITIONAL = {"PDSERVE_GATEWAY_DISAGG_MIN_UNCACHED_TOKENS": "0"}


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def row(self, name: str) -> dict[str, Any]:
        q = statistics.quantiles(self.ttft, n=10)
        return {
            "policy": name, "requests": len(self.ttft),
            "hit_rate": self.cached_tokens / max(self.prompt_tokens, 1),
            "ttft_p50_s": statistics.median(self.ttft), "ttft_p90_s": q[8],
        }  # fmt: skip


def system_prompt(seed: int) -> str:
    facts = " ".join(
        f"Entry {k} of ledger {seed}: item {k * 7 + seed} costs {k * 13 % 97} coins and weighs "
        f"{k * 5 % 41} grams." for k in range(28)
    )  # fmt: skip
    return f"You are a bookkeeper. Use this ledger to answer. {facts}"


def chat(
    url: str, model: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, str, Any]:
    """Stream one chat completion: (TTFT seconds, content, usage)."""
    body = json.dumps({
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }).encode()  # fmt: skip
    request = urllib.request.Request(url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
    started, ttft, parts, usage = time.perf_counter(), None, [], None
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - started
                    parts.append(choice["delta"]["content"])
            usage = chunk.get("usage") or usage
    return ttft or time.perf_counter() - started, "".join(parts), usage


def run_workload(
    gateways: dict[str, str], model: str, args: argparse.Namespace
) -> dict[str, Result]:
    results = {name: Result() for name in gateways}
    chats = {
        name: [[{"role": "system", "content": system_prompt(g * 100 + c)},
                {"role": "user", "content": "What does entry 3 cost?"}]
               for c in range(args.conversations)]
        for g, name in enumerate(gateways)
    }  # fmt: skip
    for turn in range(args.turns):
        for c in range(args.conversations):
            for name, url in gateways.items():  # alternate: same conditions for both
                history = chats[name][c]
                ttft, text, usage = chat(url, model, history, args.max_tokens)
                result = results[name]
                result.ttft.append(ttft)
                result.prompt_tokens += usage["prompt_tokens"]
                result.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
                history += [{"role": "assistant", "content": text},
                            {"role": "user", "content": f"And entry {turn + 5}?"}]  # fmt: skip
        print(f"turn {turn + 1}/{args.turns} done", flush=True)
    return results


def wait_healthy(
    url: str, prefill: int, up: subprocess.Popen[bytes] | None = None, timeout_s: float = 900
) -> None:
    """Until the gateway at ``url`` has its workers; raises if ``up`` exits meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up is not None and up.poll() is not None:
            raise RuntimeError(f"the cluster behind {url} exited ({up.returncode}); see its logs")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                body = json.loads(response.read())
                if body["healthy_prefill_workers"] == prefill and body["healthy_decode_workers"]:
                    return
        except (OSError, ValueError):
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not become healthy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=2, help="prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument(
        "--conversations",
        type=int,
        default=5,
        help="per policy; odd, so round robin does not stick to one worker by accident",
    )
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--port", type=int, default=8600, help="first of the ports used")
    parser.add_argument("--json", default="", help="also write the results to this file")


def start_cluster(
    args: argparse.Namespace, redis_url: str, logs: str
) -> list[subprocess.Popen[bytes]]:
    p = args.port
    env = {**os.environ, **NO_CONDITIONAL}
    common = ["--redis-url", redis_url]
    up = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--prefill", str(args.prefill), "--decode",
         str(args.decode), "--http-port", str(p), "--grpc-port", str(p + 1), "--prefill-port",
         str(p + 10), "--decode-port", str(p + 30), "--kv-port", str(p + 50), "--log-dir", logs,
         *common], env=env, stdout=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    round_robin = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "gateway", "--picker", "round_robin", "--http-port",
         str(p + 2), "--grpc-port", str(p + 3), *common], env=env,
        stdout=open(os.path.join(logs, "gateway-rr.log"), "ab"),  # noqa: SIM115 (child owns it)
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    return [up, round_robin]


def run(args: argparse.Namespace) -> int:
    from pdserve.settings import DEFAULT_MODEL_NAME

    logs = tempfile.mkdtemp(prefix="pdserve-bench-")
    print(
        f"routing benchmark: {args.prefill} prefill + {args.decode} decode workers; logs in {logs}"
    )
    with RedisServer() as redis:
        processes = start_cluster(args, redis.url, logs)
        try:
            gateways = {"round_robin": f"http://127.0.0.1:{args.port + 2}",
                        "cache_aware": f"http://127.0.0.1:{args.port}"}  # fmt: skip
            for url in gateways.values():
                wait_healthy(url, args.prefill)
            results = run_workload(gateways, DEFAULT_MODEL_NAME, args)
        finally:
            for process in reversed(processes):
                process.send_signal(signal.SIGTERM)
            for process in processes:
                process.wait(timeout=120)
    rows = [results[name].row(name) for name in ("round_robin", "cache_aware")]
    print(f"{'policy':<12} {'requests':>8} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p90':>9}")
    for r in rows:
        print(f"{r['policy']:<12} {r['requests']:>8} {r['hit_rate']:>9.1%} "
              f"{r['ttft_p50_s']:>8.3f}s {r['ttft_p90_s']:>8.3f}s")  # fmt: skip
    rr, ca = rows
    print(f"cache-aware vs round-robin: TTFT p50 x{ca['ttft_p50_s'] / rr['ttft_p50_s']:.2f}, "
          f"p90 x{ca['ttft_p90_s'] / rr['ttft_p90_s']:.2f}; hit rate {rr['hit_rate']:.1%} -> "
          f"{ca['hit_rate']:.1%}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0
