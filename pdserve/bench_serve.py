"""pdserve vs monolithic ``vllm serve`` side by side: same cores, model, settings and workloads.

One run starts a pdserve cluster (``pdserve up``), drives every workload through it with
vLLM's own benchmark client (``vllm bench serve``), stops it, then does the same with one
monolithic ``vllm serve`` engine on all the cores, with the engine arguments pdserve's workers
use (``pdserve.worker.engine``: dtype for this CPU, eager, prefix caching) and the same total
KV cache. On a GPU machine both run on the GPUs (``--gpus``): pdserve's engines with NIXL and
their memory shares, the monolith alone on the first of those GPUs with vLLM's default memory
share (0.9, what pdserve's engines on one GPU share: ``pdserve.up_gpu``). Workloads:

- ``random``: random prompts (default 512 in / 64 out, 32 prompts, concurrency 4), every one
  the same length unless ``--range-ratio`` varies them;
- ``shared_prefix``: prompts that share a few long prefixes (vLLM's ``prefix_repetition``);
- ``multi_turn``: conversations whose every turn resends the whole history so far;
- ``mixed``: long prompts arriving while short requests decode, the case disaggregation is
  for (two clients at once; the short requests' ITL is what it protects).

Reports TTFT/ITL/E2E p50/p90/p99, throughput and goodput under an SLO (default: the
monolith's own p90 TTFT and TPOT in this run), pdserve's fallback and transfer counters from
``/metrics``, and the machine (CPU model, ISA) in a JSON file, a markdown table and one PNG per
workload.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from pdserve import bench_report, machine
from pdserve import bench_serve_together as together

WORKLOADS = ("random", "shared_prefix", "multi_turn", "mixed")
SYSTEMS = ("pdserve", "vllm")
# pdserve counters worth seeing next to the latencies (lines of the gateway's /metrics), the
# time per phase (queue, prefill, transfer, decode) summed over finished requests, and each
# worker's engine steps and core lending (from its heartbeat: a few seconds late).
COUNTERS = re.compile(
    r"^pdserve_gateway_((local_fallbacks|requests|kv_transfer_bytes|rejected)_total"
    r"|phase_seconds_(sum|count)"
    r"|worker_(engine_steps|cpu_(lent_steps|lend_wait_seconds|lend_reclaims)_total))"
)
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="model directory (default: prepared)")
    parser.add_argument("--gpus", default="", help="GPUs to use, e.g. '0' (default: all)")
    parser.add_argument("--engine-args", default="", help="vLLM engine arguments of both")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="pdserve,vllm (order run)")
    parser.add_argument(
        "--prefill", type=int, default=0, help="pdserve prefill workers (0: up's default)"
    )
    parser.add_argument(
        "--decode", type=int, default=0, help="pdserve decode workers (0: up's default)"
    )
    parser.add_argument("--input-len", type=int, default=512, help="random: prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per answer")
    parser.add_argument(
        "--range-ratio", type=float, default=0.0,
        help="random: lengths drawn from len*(1-r) to len*(1+r), in and out (vLLM's "
        "--random-range-ratio; 0: every request the same, so they run in lock step)",
    )  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per workload")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--long-len", type=int, default=2048, help="mixed: long prompt tokens")
    parser.add_argument("--long-prompts", type=int, default=4, help="mixed: long requests")
    parser.add_argument("--slo-ttft-ms", type=float, default=0, help="0: monolith's p90 TTFT")
    parser.add_argument("--slo-tpot-ms", type=float, default=0, help="0: monolith's p90 TPOT")
    parser.add_argument("--port", type=int, default=8700, help="first of the ports used")
    parser.add_argument("--out", default="", help="result directory (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tracing", choices=("off", "compare", "control"), default="off",
        help="compare: pdserve untraced vs every request traced, in alternating rounds "
        "(no vllm serve; docs/observability.md); control: the same with both arms untraced",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=None,
        help="rounds, each running every system in turn, the order alternating; ratios are "
        "the medians over rounds (default 1; --tracing compare: 2)",
    )  # fmt: skip
    parser.add_argument(
        "--together", action="store_true",
        help="start each system once and keep both up, their runs back to back in every "
        "round (a new seed each round); CPU only (pdserve.bench_serve_together)",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-engine-sched", choices=("normal", "idle"), default="normal",
        help="idle: vllm serve's engine processes in the SCHED_IDLE class, as pdserve's are "
        "on the CPU (default: as vLLM leaves them)",
    )  # fmt: skip
    parser.add_argument(
        "--trace-ratio", type=float, default=1.0,
        help="--tracing compare: share of the requests traced (default every one)",
    )  # fmt: skip


# ---- systems under test ------------------------------------------------------------------
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
    return [sys.executable, "-m", "pdserve.vllm_cli", "serve", model, "--served-model-name",
            name, "--host", "127.0.0.1", "--port", str(port), *COMMON_DEFAULT_ARGS, *cpu_args,
            *user, "--disable-uvicorn-access-log"]  # fmt: skip


@contextmanager
def monolith(args: argparse.Namespace, model: str, name: str, out: Path) -> Iterator[str]:
    from pdserve.placement import format_cores, gpus_to_use, usable_cores
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
    system: str, args: argparse.Namespace, model: str, name: str, out: Path
) -> AbstractContextManager[str]:
    """The server of ``system`` ("pdserve" or "vllm"), up until the block ends: its URL."""
    return pdserve_cluster(args, out) if system == "pdserve" else monolith(args, model, name, out)


# ---- workloads ---------------------------------------------------------------------------
def _client_argv(base_url: str, model: str, name: str, result: Path) -> list[str]:
    return [sys.executable, "-m", "pdserve.vllm_cli", "bench", "serve", "--backend", "openai",
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


def workload_runs(
    workload: str, args: argparse.Namespace, out: Path
) -> list[tuple[str, list[str]]]:
    """(label, extra ``vllm bench serve`` arguments) for each client the workload runs at once."""
    common = ["--seed", str(args.seed), "--ignore-eos"]
    n, c, o = str(args.num_prompts), str(args.concurrency), str(args.output_len)
    if workload == "random":
        return [(workload, [*common, "--dataset-name", "random", "--random-input-len",
                            str(args.input_len), "--random-output-len", o, "--num-prompts", n,
                            "--max-concurrency", c, "--random-range-ratio",
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


# ---- the run -----------------------------------------------------------------------------
def _settings_problem(args: argparse.Namespace, workloads: list[str]) -> str:
    """What is wrong with the settings, before anything starts ("" when nothing)."""
    if args.rounds is not None and args.rounds < 1:
        return "--rounds must be at least 1"
    if not 0 < args.trace_ratio <= 1:
        return "--trace-ratio must be in (0, 1]"
    if not 0 <= args.range_ratio < 1:
        return "--range-ratio must be in [0, 1)"
    problem = together.settings_problem(args)
    if problem:
        return problem
    if args.vllm_engine_sched == "idle":
        from pdserve.placement import gpus_to_use

        if gpus_to_use(args.gpus):
            return "--vllm-engine-sched idle is for the CPU (pdserve's GPU engines keep theirs)"
    try:
        for w in workloads:
            workload_runs(w, args, Path(tempfile.gettempdir()))  # validates the names
    except ValueError as exc:
        return str(exc)
    return ""


def run(args: argparse.Namespace) -> int:
    from pdserve.model import resolve_model
    from pdserve.up import served_model_name

    workloads = [w for w in args.workloads.split(",") if w]
    systems = [s for s in args.systems.split(",") if s]
    problem = _settings_problem(args, workloads)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="pdserve-bench-serve-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model or None)
    name = served_model_name(args.model)
    info = machine.cpu_info()
    print(f"bench serve: {machine.describe(info)}")
    if args.tracing != "off":
        from pdserve import bench_serve_tracing

        args.rounds = args.rounds or 2
        arms = "untraced and traced" if args.tracing == "compare" else "untraced twice"
        print(f"  tracing {args.tracing}: workloads {', '.join(workloads)}; {args.rounds} "
              f"rounds of pdserve {arms}; results in {out}")  # fmt: skip
        return bench_serve_tracing.run(args, out, model, name, info)
    args.rounds = args.rounds or 1
    held_up = " (both held up: --together)" if args.together else ""
    print(f"  workloads {', '.join(workloads)}; systems {', '.join(systems)}{held_up}; "
          f"{args.rounds} round(s); results in {out}")  # fmt: skip
    with together.held_servers(args, systems, model, name, out) as held:
        rounds = [
            run_round(
                r, systems if r % 2 else systems[::-1], workloads, args, model, name, out, held
            )
            for r in range(1, args.rounds + 1)
        ]
    report = bench_report.build(rounds, info, args)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    try:
        plots = bench_report.plot(bench_report.plotted(rounds), out)
    except ImportError:
        plots = []
        print("  (matplotlib is not installed: no plots)")
    print(bench_report.table(report["rows"]))
    for r in report["ratios"]:
        x = bench_report.times_text(r)
        print(f"  {r['workload']}: pdserve/vllm throughput {x('throughput')} (requests in "
              f"flight {x('in_flight')}, E2E mean better {x('e2e_mean_better')}); latency "
              f"better by TTFT p99 {x('ttft_p99_better')}, ITL p50 {x('itl_p50_better')}, "
              f"ITL p99 {x('itl_p99_better')}")  # fmt: skip
    print(f"results: {out / 'results.json'}; plots: {', '.join(p.name for p in plots) or '-'}")
    return 0


def run_round(
    round_no: int, systems: list[str], workloads: list[str], args: argparse.Namespace,
    model: str, name: str, out: Path, held: dict[str, together.Held] | None = None,
) -> tuple[bench_report.Raw, dict[str, Any]]:  # fmt: skip
    """One round: each system started (or, in ``held``, already up), every workload through
    it, stopped. Its results and pdserve's counters per workload (the /metrics difference
    across it); with held systems also the CPU seconds each idle one spent meanwhile."""
    raw: bench_report.Raw = {}
    counters: dict[str, Any] = {}
    held = held or {}
    tag = f"-r{round_no}" if args.rounds > 1 else ""
    settings = together.round_args(args, round_no)
    for system in systems:
        with together.serving(system, held, args, model, name, out) as url:
            for i, workload in enumerate(workloads, 1):
                where = f"{system}, round {round_no}" if tag else system
                print(f"  [{where}] workload {i}/{len(workloads)}: {workload} ...", flush=True)
                before = gateway_counters(url) if system == "pdserve" else {}
                started = time.monotonic()
                with together.idle_cpu(held, system) as idle:
                    results = run_workload(workload, system + tag, url, settings, model, name, out)
                took = time.monotonic() - started
                for label, result in results.items():
                    raw.setdefault(label, {})[system] = result
                if system == "pdserve":
                    after = gateway_counters(url)
                    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
                    counters.setdefault(workload, {})["pdserve"] = {
                        k: v for k, v in delta.items() if v
                    }
                if idle:
                    counters.setdefault(workload, {}).setdefault("idle_cpu_s", {}).update(idle)
                print(f"  [{where}] {workload} done in {took:.0f} s{together.meanwhile(idle)}")
    return raw, counters
