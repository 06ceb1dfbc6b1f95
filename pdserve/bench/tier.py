"""TTFT and cached tokens with the shared KV tier on vs off, in one run.

Two ``pdserve up`` clusters on the same machine, each with its own private Redis: one without
a KV tier, one with the LMCache tier in its Redis (``--kv-tier redis``). Both give their
engines a small KV cache (``--kv-blocks``), as a busy production engine effectively has:
the workload's documents do not all fit, so the engine's own prefix cache evicts them.

The workload is shared-prefix question answering: ``--documents`` long system prompts
("documents"); each round asks one new question about every document, one request at a
time, alternating between the two clusters so that both see the same machine. The first
round computes every document; later rounds find it in the engine's cache if it survived,
else (tier on) in the tier, else compute it again. TTFT = request sent to first streamed
content; cached tokens as the workers report them in ``usage``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack

from pdserve.bench.routing import NO_CONDITIONAL, Result, chat, system_prompt, wait_healthy
from pdserve.cluster.redis_server import RedisServer
from pdserve.placement import machine

ARMS = ("tier_off", "tier_on")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=10, help="long shared prefixes")
    parser.add_argument("--rounds", type=int, default=3, help="questions per document")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per answer")
    parser.add_argument(
        "--kv-blocks", type=int, default=24,
        help="each engine's own KV cache in 128-token blocks (small: documents get evicted)",
    )  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=2048, help="engines' context")
    parser.add_argument("--port", type=int, default=8700, help="first of the ports used")
    parser.add_argument("--json", default="", help="also write the results to this file")


def start_cluster(
    args: argparse.Namespace, port: int, redis_url: str, tier: bool, logs: str
) -> subprocess.Popen[bytes]:
    env = {**os.environ, **NO_CONDITIONAL}
    engine = f"--max-model-len {args.max_model_len} --num-gpu-blocks-override {args.kv_blocks}"
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--prefill", "1", "--decode", "1",
         "--http-port", str(port), "--grpc-port", str(port + 1), "--prefill-port",
         str(port + 10), "--decode-port", str(port + 20), "--kv-port", str(port + 30),
         "--redis-url", redis_url, "--log-dir", logs, f"--prefill-engine-args={engine}",
         f"--decode-engine-args={engine}", "--kv-tier", "redis" if tier else "off"],
        env=env, stdout=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def run_workload(gateways: dict[str, str], model: str, args: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    """{arm: {"all": Result, "revisits": Result}}: every request, and rounds after the first."""
    results = {arm: {"all": Result(), "revisits": Result()} for arm in gateways}
    for rnd in range(args.rounds):
        for doc in range(args.documents):
            question = f"What does entry {rnd + 2} cost?"
            messages = [{"role": "system", "content": system_prompt(doc)},
                        {"role": "user", "content": question}]  # fmt: skip
            for arm, url in gateways.items():  # alternate: same conditions for both
                ttft, _, usage = chat(url, model, messages, args.max_tokens)
                for key in ("all", "revisits") if rnd else ("all",):
                    result = results[arm][key]
                    result.ttft.append(ttft)
                    result.prompt_tokens += usage["prompt_tokens"]
                    result.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    return results


def run(args: argparse.Namespace) -> int:
    from pdserve.settings import DEFAULT_MODEL_NAME

    if args.rounds < 2 or args.documents < 2:
        print("error: --rounds and --documents must be at least 2", file=sys.stderr)
        return 2
    cpu = machine.describe(machine.cpu_info())
    logs = tempfile.mkdtemp(prefix="pdserve-bench-tier-")
    print(f"KV tier benchmark: 1 prefill + 1 decode per arm, {args.documents} documents x "
          f"{args.rounds} rounds; {cpu}; logs in {logs}")  # fmt: skip
    ports = {arm: args.port + 100 * i for i, arm in enumerate(ARMS)}
    with ExitStack() as stack:
        processes = []
        for arm in ARMS:
            redis = stack.enter_context(RedisServer())
            arm_logs = os.path.join(logs, arm)
            os.makedirs(arm_logs)
            processes.append(start_cluster(args, ports[arm], redis.url, arm == "tier_on",
                                           arm_logs))  # fmt: skip
        try:
            gateways = {arm: f"http://127.0.0.1:{ports[arm]}" for arm in ARMS}
            for url, process in zip(gateways.values(), processes, strict=True):
                wait_healthy(url, 1, process)
            started = time.monotonic()
            results = run_workload(gateways, DEFAULT_MODEL_NAME, args)
            took = time.monotonic() - started
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        finally:
            for process in processes:
                os.killpg(process.pid, signal.SIGTERM)
            for process in processes:
                process.wait(timeout=120)
    rows = [results[arm][key].row(f"{arm}/{key}") for key in ("all", "revisits") for arm in ARMS]
    print(f"{'arm/requests':<18} {'n':>4} {'cached':>7} {'TTFT p50':>9} {'TTFT p90':>9}")
    for r in rows:
        print(f"{r['policy']:<18} {r['requests']:>4} {r['hit_rate']:>7.1%} "
              f"{r['ttft_p50_s']:>8.3f}s {r['ttft_p90_s']:>8.3f}s")  # fmt: skip
    off, on = rows[2:]  # the revisits rows, tier off then on
    p50 = on["ttft_p50_s"] / off["ttft_p50_s"]
    p90 = on["ttft_p90_s"] / off["ttft_p90_s"]
    print(f"tier on vs off, revisited documents: TTFT p50 x{p50:.2f}, p90 x{p90:.2f} "
          f"({took:.0f} s of requests)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"cpu": cpu, "args": vars(args), "rows": rows,
                       "revisit_ttft_ratio": {"p50": p50, "p90": p90}}, out, indent=2)  # fmt: skip
    return 0
