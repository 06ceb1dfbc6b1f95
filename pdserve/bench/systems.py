"""The two systems ``pdserve bench serve`` compares, and one workload through either.

``server`` starts pdserve (``pdserve up``) or one monolithic ``vllm serve`` engine with the
engine arguments pdserve's workers use, each in its own process group that is stopped with
everything it started; ``run_workload`` drives one workload through a running system with
vLLM's own benchmark client (``vllm bench serve``); ``gateway_counters`` reads pdserve's
counters from the gateway's ``/metrics``. ``pdserve.bench.serve`` runs the rounds and the
report on top of these, as do ``bench soak``, ``bench gpu`` and the tracing comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

WORKLOADS = ("random", "shared_prefix", "multi_turn", "mixed")
SYSTEMS = ("pdserve", "vllm")
# pdserve counters worth seeing next to the latencies (lines of the gateway's /metrics), the
# time per phase (queue, prefill, transfer, decode) summed over finished requests, where the
# disaggregation policy computed each prompt and why, the SLO met or missed by the gateway's
# own clock, and each worker's engine steps and core lending (from its heartbeat: a few
# seconds late).
COUNTERS = re.compile(
    r"^pdserve_gateway_((local_fallbacks|requests|kv_transfer_bytes|rejected|split_decisions"
    r"|slo_requests)_total"
    r"|phase_seconds_(sum|count)"
    r"|worker_(engine_steps|cpu_(lent_steps|lend_wait_seconds|lend_reclaims)_total))"
)
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _wait_http(url: str, process: subprocess.Popen[bytes], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} before it was ready")
        try:
            with _NO_PROXY.open(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{what} was not ready after {timeout_s:.0f} s")


@contextmanager
def child_process(
    argv: list[str], env: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """A benchmarked server in its own process group, output to ``log``; stopped (SIGTERM,
    then SIGKILL after 120 s) with everything it started when the block ends."""
    with open(log, "ab") as out:
        process = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 15)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()


@contextmanager
def pdserve_cluster(
    args: argparse.Namespace, out: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    """``pdserve up`` with ``env`` (default: this process's) until the block ends."""
    argv = pdserve_up_argv(args, out)
    p = args.port
    log = out / "pdserve-up.log"
    topology = " ".join(_topology(args)) or "(its default topology)"
    print(f"  starting pdserve up {topology} (log {log})")
    start = log.stat().st_size if log.exists() else 0  # the log of an earlier cluster stays
    with child_process(argv, dict(os.environ) if env is None else env, log) as process:
        _wait_for_banner(log, process, start)
        yield f"http://127.0.0.1:{p}"


def _topology(args: argparse.Namespace) -> list[str]:
    """``pdserve up``'s worker counts, as asked (none: its default)."""
    topology = ["--prefill", str(args.prefill)] if args.prefill else []
    return topology + (["--decode", str(args.decode)] if args.decode else [])


def pdserve_up_argv(args: argparse.Namespace, out: Path) -> list[str]:
    """``pdserve up`` on ports from ``--port`` on (NIXL side channels from --port + 70)."""
    p = args.port
    topology = _topology(args)
    options = ["--model", args.model] if args.model else []
    options += ["--gpus", args.gpus] if args.gpus else []
    if args.engine_args:  # "=": a value starting with "--" would be read as a flag
        options += [f"--prefill-engine-args={args.engine_args}",
                    f"--decode-engine-args={args.engine_args}"]  # fmt: skip
    return [sys.executable, "-m", "pdserve", "up", *topology, "--http-port", str(p),
            "--grpc-port", str(p + 1), "--prefill-port", str(p + 10), "--decode-port",
            str(p + 30), "--kv-port", str(p + 50), "--nixl-port", str(p + 70), *options,
            "--startup-timeout-s", "1800", "--log-dir", str(out / "pdserve-logs")]  # fmt: skip


def _wait_for_banner(
    log: Path, process: subprocess.Popen[bytes], start: int = 0, timeout_s: float = 1800
) -> None:
    """Wait until ``pdserve up`` prints its banner in ``log`` after byte ``start``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(log, "rb") as f:
            f.seek(start)
            if b"pdserve is up" in f.read():
                return
        if process.poll() is not None:
            raise RuntimeError(f"pdserve up exited with {process.returncode}; see {log}")
        time.sleep(1)
    raise RuntimeError(f"pdserve up was not ready after {timeout_s:.0f} s; see {log}")


def monolith_argv(
    model: str, name: str, port: int, gpu: bool = False, engine_args: str = ""
) -> list[str]:
    """``vllm serve`` with the engine arguments a pdserve worker gets on this machine (on a
    GPU: pdserve's common ones; on a CPU also its CPU defaults), then the user's."""
    import shlex

    from pdserve.worker.engine import COMMON_DEFAULT_ARGS, cpu_default_args

    user = shlex.split(engine_args)
    cpu_args = [] if gpu else cpu_default_args(user)[0]
    return [sys.executable, "-m", "pdserve.cli.vllm", "serve", model, "--served-model-name",
            name, "--host", "127.0.0.1", "--port", str(port), *COMMON_DEFAULT_ARGS, *cpu_args,
            *user, "--disable-uvicorn-access-log"]  # fmt: skip


@contextmanager
def monolith(args: argparse.Namespace, model: str, name: str, out: Path) -> Iterator[str]:
    from pdserve.placement.engines import format_cores, gpus_to_use, usable_cores
    from pdserve.worker.config import WorkerSettings
    from pdserve.worker.engine import cpu_engine_env

    port = args.port + 5
    gpus = gpus_to_use(args.gpus)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "42"}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"], where, timeout_s = gpus[0], f"GPU {gpus[0]}", 1800
    else:
        cores = usable_cores()
        engines = (args.prefill or 1) + (args.decode or 1)
        # The same KV memory in total as the pdserve engines, all the cores, one OpenMP
        # thread each.
        kv_gib = WorkerSettings.model_fields["kv_cache_gib"].default * engines
        env |= {"VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}",
                "VLLM_CPU_OMP_THREADS_BIND": format_cores(cores)}  # fmt: skip
        # The environment pdserve's engines get: tcmalloc, as vLLM's CPU guide asks, and the
        # compile cache.
        cpu_engine_env(env)
        where, timeout_s = f"cores {format_cores(cores)}", 900
    log = out / "vllm-serve.log"
    print(f"  starting monolithic vllm serve on {where} (log {log})")
    argv = monolith_argv(model, name, port, gpu=bool(gpus), engine_args=args.engine_args)
    with child_process(argv, env, log) as process:
        _wait_http(f"http://127.0.0.1:{port}/health", process, timeout_s, "vllm serve")
        if args.vllm_engine_sched == "idle":  # CPU only (_settings_problem)
            moved = engines_to_idle_class(process.pid)
            print(f"  vllm serve's engine processes {moved} in the SCHED_IDLE class")
        yield f"http://127.0.0.1:{port}"


def engine_processes(pid: int) -> list[Any]:
    """The vLLM engine processes (``VLLM::...``, psutil processes) under process ``pid``."""
    import psutil

    return [p for p in psutil.Process(pid).children(recursive=True)
            if "VLLM::" in " ".join(p.cmdline())]  # fmt: skip


def engines_to_idle_class(pid: int) -> list[int]:
    """Move the vLLM engine processes under ``pid`` to the SCHED_IDLE class
    (pdserve.worker.vllm_plugin.lower_priority does this for a worker's own at their start).
    Their pids."""
    from pdserve.worker.vllm_plugin import to_idle_class

    pids = [engine.pid for engine in engine_processes(pid)]
    for engine_pid in pids:
        to_idle_class(engine_pid)
    return pids


def server(
    system: str, args: argparse.Namespace, model: str, name: str, out: Path,
    env: dict[str, str] | None = None,
) -> AbstractContextManager[str]:  # fmt: skip
    """The server of ``system`` ("pdserve" or "vllm"), up until the block ends: its URL.
    ``env`` is added to ``pdserve up``'s environment, which its children (the gateway, the
    workers) inherit: settings such as ``PDSERVE_GATEWAY_*`` for the gateway."""
    if system == "pdserve":
        return pdserve_cluster(args, out, {**os.environ, **env} if env else None)
    return monolith(args, model, name, out)


# ---- workloads ---------------------------------------------------------------------------
def _client_argv(base_url: str, model: str, name: str, result: Path) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli.vllm", "bench", "serve", "--backend", "openai",
            "--endpoint", "/v1/completions", "--base-url", base_url, "--model", name,
            "--tokenizer", model, "--save-result", "--save-detailed", "--result-dir",
            str(result.parent), "--result-filename", result.name, "--num-warmups", "0",
            "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"]  # fmt: skip


def multi_turn_dataset(path: Path, args: argparse.Namespace) -> int:
    """Conversations as a custom dataset in turn order: turn k of every conversation before
    turn k+1, each prompt the whole history so far. Returns the number of prompts."""
    rng = random.Random(args.seed)
    words = ["ledger", "entry", "costs", "coins", "weighs", "grams", "item", "answer", "total"]
    conversations = max(1, args.concurrency)
    turns = max(1, args.num_prompts // conversations)
    history = [f"Conversation {c}. " for c in range(conversations)]
    lines = []
    for _ in range(turns):
        for c in range(conversations):
            history[c] += " ".join(rng.choice(words) for _ in range(args.input_len // 4)) + ". "
            lines.append(json.dumps({"prompt": history[c]}))
            history[c] += " ".join(rng.choice(words) for _ in range(args.output_len // 2)) + ". "
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def pacing(args: argparse.Namespace) -> list[str]:
    """How the client sends requests: at most ``--concurrency`` in flight (0: no cap) and,
    when the settings have a ``request_rate`` (``bench goodput``; ``bench serve`` has none:
    all at once), Poisson arrivals at that rate with vLLM's ``--burstiness``."""
    cap = ["--max-concurrency", str(args.concurrency)] if args.concurrency else []
    rate = getattr(args, "request_rate", 0.0)
    if not rate:
        return cap
    burstiness = getattr(args, "burstiness", 1.0)
    return [*cap, "--request-rate", f"{rate:g}", "--burstiness", f"{burstiness:g}"]


def workload_runs(
    workload: str, args: argparse.Namespace, out: Path
) -> list[tuple[str, list[str]]]:
    """(label, extra ``vllm bench serve`` arguments) for each client the workload runs at once."""
    common = ["--seed", str(args.seed), "--ignore-eos"]
    n, c, o = str(args.num_prompts), str(args.concurrency), str(args.output_len)
    if workload == "random":
        return [(workload, [*common, "--dataset-name", "random", "--random-input-len",
                            str(args.input_len), "--random-output-len", o, "--num-prompts", n,
                            *pacing(args), "--random-range-ratio",
                            str(args.range_ratio)])]  # fmt: skip
    if workload == "shared_prefix":
        prefix, suffix = args.input_len * 3 // 4, args.input_len // 4
        return [(workload, [*common, "--dataset-name", "prefix_repetition",
                            "--prefix-repetition-prefix-len", str(prefix),
                            "--prefix-repetition-suffix-len", str(suffix),
                            "--prefix-repetition-num-prefixes", "4",
                            "--prefix-repetition-output-len", o, "--num-prompts", n,
                            "--max-concurrency", c])]  # fmt: skip
    if workload == "multi_turn":
        dataset = out / "multi_turn.jsonl"
        count = multi_turn_dataset(dataset, args)
        return [(workload, [*common, "--dataset-name", "custom", "--dataset-path", str(dataset),
                            "--custom-output-len", o, "--disable-shuffle", "--num-prompts",
                            str(count), "--max-concurrency", c])]  # fmt: skip
    if workload == "mixed":
        short_c = str(max(1, args.concurrency - 1))
        return [
            ("mixed", [*common, "--dataset-name", "random", "--random-input-len", "128",
                       "--random-output-len", o, "--num-prompts", n, "--max-concurrency",
                       short_c]),
            ("mixed_long", [*common, "--dataset-name", "random", "--random-input-len",
                            str(args.long_len), "--random-output-len", "8", "--num-prompts",
                            str(args.long_prompts), "--max-concurrency", "1",
                            "--seed", str(args.seed + 1)]),
        ]  # fmt: skip
    raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")


def run_workload(
    workload: str, system: str, url: str, args: argparse.Namespace, model: str, name: str,
    out: Path,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Run the workload's clients at once; returns vLLM's detailed result per label (also
    kept as ``<label>-<system>.json``)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    running = []
    for label, extra in workload_runs(workload, args, out):
        result = out / f"{label}-{system}.json"
        result.unlink(missing_ok=True)
        log = open(out / f"{label}-{system}.log", "wb")  # noqa: SIM115 (closed below)
        argv = [*_client_argv(url, model, name, result), *extra]
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        running.append((label, result, log, process))
    results = {}
    try:
        for label, result, log, process in running:
            code = process.wait()
            if code != 0 or not result.exists():
                raise RuntimeError(f"vllm bench serve ({label}) failed with {code}; see {log.name}")
            results[label] = json.loads(result.read_text())
    finally:  # one failed or the benchmark was stopped: no client goes on alone
        for _, _, log, process in running:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
    return results


def gateway_counters(url: str) -> dict[str, float]:
    with _NO_PROXY.open(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    counters = {}
    for line in text.splitlines():
        if COUNTERS.match(line):
            key, _, value = line.rpartition(" ")
            counters[key] = float(value)
    return counters
