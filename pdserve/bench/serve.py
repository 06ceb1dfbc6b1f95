"""pdserve vs monolithic ``vllm serve`` side by side: same cores, model, settings and workloads.

One run starts a pdserve cluster (``pdserve up``), drives every workload through it with
vLLM's own benchmark client (``vllm bench serve``), stops it, then does the same with one
monolithic ``vllm serve`` engine on all the cores, with the engine arguments pdserve's workers
use (``pdserve.worker.engine``: dtype for this CPU, eager, prefix caching) and the same total
KV cache. On a GPU machine both run on the GPUs (``--gpus``): pdserve's engines with NIXL and
their memory shares, the monolith alone on the first of those GPUs with vLLM's default memory
share (0.9, what pdserve's engines on one GPU share: ``pdserve.cluster.gpu``). Workloads:

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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.bench import report as bench_report
from pdserve.bench import serve_together as together
from pdserve.bench import serve_tracing as bench_serve_tracing
from pdserve.bench import systems as bench_systems
from pdserve.placement import machine

WORKLOADS = bench_systems.WORKLOADS
SYSTEMS = bench_systems.SYSTEMS


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
        "round (a new seed each round); CPU only (pdserve.bench.serve_together)",
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
        from pdserve.placement.engines import gpus_to_use

        if gpus_to_use(args.gpus):
            return "--vllm-engine-sched idle is for the CPU (pdserve's GPU engines keep theirs)"
    try:
        for w in workloads:
            bench_systems.workload_runs(w, args, Path(tempfile.gettempdir()))  # validates the names
    except ValueError as exc:
        return str(exc)
    return ""


def run(args: argparse.Namespace) -> int:
    from pdserve.cluster.up import served_model_name
    from pdserve.model import resolve_model

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
                before = bench_systems.gateway_counters(url) if system == "pdserve" else {}
                started = time.monotonic()
                with together.idle_cpu(held, system) as idle:
                    results = bench_systems.run_workload(
                        workload, system + tag, url, settings, model, name, out
                    )
                took = time.monotonic() - started
                for label, result in results.items():
                    raw.setdefault(label, {})[system] = result
                if system == "pdserve":
                    after = bench_systems.gateway_counters(url)
                    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
                    counters.setdefault(workload, {})["pdserve"] = {
                        k: v for k, v in delta.items() if v
                    }
                if idle:
                    counters.setdefault(workload, {}).setdefault("idle_cpu_s", {}).update(idle)
                print(f"  [{where}] {workload} done in {took:.0f} s{together.meanwhile(idle)}")
    return raw, counters
