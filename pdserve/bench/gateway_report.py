"""The report of ``pdserve bench gateway``: per path (and arm) statistics from the samples and
phase records ``bench_gateway.measure`` returns, the JSON report and the printed tables."""

from __future__ import annotations

import argparse
import shlex
import statistics
from typing import TYPE_CHECKING, Any

from pdserve.bench import gateway_tracing as tracing_bench
from pdserve.placement.machine import describe

if TYPE_CHECKING:
    from pdserve.bench.gateway_client import PathResult

PATHS = ("direct_grpc", "gateway_http", "gateway_grpc")
GATEWAY_PATHS = PATHS[1:]  # what --tracing compare measures: the paths through the gateway


def _pct(samples: list[float]) -> dict[str, float | None]:
    """p50/p99 in milliseconds (inclusive method: never beyond the extremes)."""
    if len(samples) < 2:
        value = samples[0] * 1000 if samples else None
        return {"p50": value, "p99": value}
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50": q[49] * 1000, "p99": q[98] * 1000}


def path_stats(r: PathResult, phases: list[dict[str, Any]]) -> dict[str, Any]:
    """One path of one arm over all rounds; ``phases``: that path's and arm's phases."""
    wall = sum(p["wall_s"] for p in phases)
    client = sum(p["client_cpu_s"] for p in phases)
    gateway = [p["gateway_cpu_s"] for p in phases]
    return {
        "requests": r.requests, "failed": r.failed, "tokens": r.tokens,
        "ttft_ms": _pct(r.ttft), "itl_ms": _pct(r.itl), "errors": r.errors,
        "client_cpu_share": client / wall if wall else None,
        "gateway_cpu_us_per_token": sum(gateway) / r.tokens * 1e6
        if r.tokens and None not in gateway else None,
        "requests_per_s": r.requests / wall if wall else None,
        "tokens_per_s": r.tokens / wall if wall else None,
    }  # fmt: skip


def command(args: argparse.Namespace) -> str:
    """The command line that repeats this run (without --model and --json)."""
    argv = ["pdserve", "bench", "gateway", "--streams", str(args.streams), "--tokens",
            str(args.tokens), "--requests", str(args.requests), "--interval-ms",
            f"{args.interval_ms:g}", "--rounds", str(args.rounds), "--prompt-words",
            str(args.prompt_words)]  # fmt: skip
    if args.prompt_threads is not None:
        argv += ["--prompt-threads", str(args.prompt_threads)]
    if args.gateway_args:
        argv += ["--gateway-args", args.gateway_args]
    if args.no_redis:
        argv.append("--no-redis")
    if args.tracing != "off":
        argv += ["--tracing", args.tracing]
        if args.trace_ratio < 1:
            argv += ["--trace-ratio", f"{args.trace_ratio:g}"]
    return shlex.join(argv)


def build_report(
    args: argparse.Namespace,
    machine: dict[str, Any],
    results: dict[str, dict[str, PathResult]],
    phases: list[dict[str, Any]],
    prompt_tokens: float,
    traced: dict[str, Any],
) -> dict[str, Any]:
    """``traced``: the ``tracing`` entry (``bench_gateway_tracing.describe_tracing``)."""
    arms = {
        arm: {name: path_stats(r, [p for p in phases if p["arm"] == arm and p["path"] == name])
              for name, r in paths.items()}
        for arm, paths in results.items()
    }  # fmt: skip
    report: dict[str, Any] = {
        "bench": "gateway", "command": command(args), "machine": machine,
        "config": {"streams": args.streams, "tokens": args.tokens, "requests": args.requests,
                   "interval_ms": args.interval_ms, "rounds": args.rounds,
                   "prompt_words": args.prompt_words, "prompt_tokens_mean": prompt_tokens,
                   "prompt_threads": args.prompt_threads, "redis": not args.no_redis,
                   "gateway_args": args.gateway_args,
                   "tracing": args.tracing, "trace_ratio": args.trace_ratio},
    }  # fmt: skip
    if args.tracing == "compare":
        report["arms"] = arms
        measured = tuple(next(iter(results.values())))
        report["tracing"] = traced
        report["tracing"]["throughput"] = tracing_bench.compare(phases, measured)
    else:
        report["paths"] = paths = next(iter(arms.values()))
        base = paths["direct_grpc"]
        report["added_by_gateway_ms"] = {
            name: {metric: {q: minus(paths[name][metric][q], base[metric][q])
                            for q in ("p50", "p99")} for metric in ("ttft_ms", "itl_ms")}
            for name in ("gateway_http", "gateway_grpc")
        }  # fmt: skip
        report["tracing"] = traced
    report["phases"] = phases
    return report


def minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _print_paths(paths: dict[str, Any], title: str = "path") -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    print(f"{title:<26} {'requests':>8} {'failed':>6} {'req/s':>7}  {'TTFT p50':>8} {'p99':>7}  "
          f"{'ITL p50':>7} {'p99':>7}  (ms)  {'gw CPU/token':>12}")  # fmt: skip
    for name, p in paths.items():
        per_token = p["gateway_cpu_us_per_token"] if not name.startswith("direct") else None
        cost = "-" if per_token is None else f"{per_token:.0f} us"
        rate = "-" if p["requests_per_s"] is None else f"{p['requests_per_s']:.1f}"
        print(f"{name:<26} {p['requests']:>8} {p['failed']:>6} {rate:>7}  "
              f"{ms(p['ttft_ms']['p50']):>8} {ms(p['ttft_ms']['p99']):>7}  "
              f"{ms(p['itl_ms']['p50']):>7} {ms(p['itl_ms']['p99']):>7}        "
              f"{cost:>12}")  # fmt: skip
    for name, p in paths.items():
        for error in p["errors"]:
            print(f"  {name} error: {error}")


def print_report(report: dict[str, Any]) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    print(f"\n{describe(report['machine'])}\n{report['command']}")
    processes = report.get("gateway_process", {})
    for arm, process in processes.items():
        rss = process["peak_rss_mib"]
        name = f"gateway (tracing {arm})" if len(processes) > 1 else "gateway"
        print(f"{name}: healthy {process['start_s']:.1f} s after its start, peak RSS "
              f"{'-' if rss is None else f'{rss:.0f} MiB'}")  # fmt: skip
    if "arms" in report:
        rows = {f"{path} tracing {arm}": stats for path in GATEWAY_PATHS
                for arm, paths in report["arms"].items()
                for name, stats in paths.items() if name == path}  # fmt: skip
        _print_paths(rows, "path, arm")
        tracing_bench.print_compare(report)
        return
    _print_paths(report["paths"])
    print("added by the gateway (same percentile, gateway minus direct):")
    for name, a in report["added_by_gateway_ms"].items():
        print(f"  {name}: TTFT p50 {ms(a['ttft_ms']['p50'])} ms, p99 {ms(a['ttft_ms']['p99'])} ms;"
              f" ITL p50 {ms(a['itl_ms']['p50'])} ms, p99 {ms(a['itl_ms']['p99'])} ms")  # fmt: skip
    tracing_bench.print_spans(report["tracing"])
