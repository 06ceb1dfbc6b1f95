"""``pdserve bench serve --tracing compare``: what tracing costs a real cluster.

The same harness as pdserve vs ``vllm serve`` (real vLLM workers, vLLM's own benchmark client),
with the two arms being pdserve untraced and pdserve with every request traced. An arm is one
``pdserve up`` with the arm's environment (``bench_gateway_tracing.arm_envs``: OTLP over
HTTP/protobuf to a receiver this benchmark runs in its own process, sampler ``always_on`` or
``--trace-ratio``; the untraced arm gets the same variables plus ``OTEL_SDK_DISABLED=true``,
both padded to one size). A cluster cannot switch tracing at run time, so each round starts
each arm's cluster in turn, runs every workload through it and stops it; the order of the arms
alternates from round to round (off, on; then on, off; ...), so that a slow spell of a shared
machine lands on both alike. The figure per workload is the median over rounds of each round's
throughput ratio on/off, with the TTFT and ITL medians beside it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pdserve.bench import gateway_tracing as tb
from pdserve.bench import report as bench_report
from pdserve.bench import systems as bench_systems


def arm_order(round_no: int) -> tuple[str, str]:
    """The arms of round ``round_no`` (1-based) in the order they run."""
    return ("off", "on") if round_no % 2 else ("on", "off")


def arm_envs(mode: str, endpoint: str, ratio: float) -> dict[str, dict[str, str]]:
    """Both arms' environments. ``control``: the "on" arm untraced as well (the "off" arm's
    variables under its own service name): how far the figures stray with no difference."""
    if mode == "compare":
        return tb.arm_envs("compare", ("off", "on"), endpoint, ratio)
    off = tb.arm_env("compare", "off", endpoint, ratio)
    return tb.padded({"off": off, "on": off | {"OTEL_SERVICE_NAME": "bench-on"}})


def compare(results: dict[int, dict[str, dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    """The on/off figures of a compare run.

    ``results``: round -> arm -> label -> vLLM's result of that workload. Per label: each
    round's ratio on/off of requests/s and its median; each arm's median requests/s, TTFT p50
    and ITL p50 (ms) and its failed requests in all; ``"all"``: the median of every round's
    ratio of every label, and the failed requests of both arms."""
    labels = sorted({label for arms in results.values() for r in arms.values() for label in r})
    out: dict[str, Any] = {}
    every: list[float] = []
    failed_in_all = 0
    for label in labels:
        per_arm: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
        failed = {"off": 0, "on": 0}
        ratios = []
        for round_no in sorted(results):
            rows = {}
            for arm in ("off", "on"):
                raw = results[round_no].get(arm, {}).get(label)
                if raw is None:
                    continue
                rows[arm] = row = bench_report.summarize(raw, None)
                failed[arm] += row["failed"]
                for key in ("requests_per_s", "ttft_p50_ms", "itl_p50_ms"):
                    per_arm[arm].setdefault(key, []).append(row[key])
            if len(rows) == 2 and rows["off"]["requests_per_s"]:
                ratios.append(rows["on"]["requests_per_s"] / rows["off"]["requests_per_s"])
        every += ratios
        failed_in_all += sum(failed.values())
        out[label] = {
            "arms": {
                arm: {f"{k}_median": tb.median(v) for k, v in figures.items()}
                | {"failed": failed[arm]}
                for arm, figures in per_arm.items()
            },
            "ratio_per_round": ratios,
            "ratio_median": tb.median(ratios),
        }
    out["all"] = {"ratio_median": tb.median(every), "pairs": len(every), "failed": failed_in_all}
    return out


def run(args: argparse.Namespace, out: Path, model: str, name: str, info: dict[str, Any]) -> int:
    """Rounds of both arms (``args.tracing``: "compare" or "control"); writes ``tracing.json``
    and prints the figures. Exit status 1 when a request failed, the traced arm exported no
    spans or an untraced one did (the figures would mislead)."""
    workloads = [w for w in args.workloads.split(",") if w]
    receiver = tb.ReceiverProcess()
    results: dict[int, dict[str, dict[str, dict[str, Any]]]] = {}
    try:
        envs = arm_envs(args.tracing, receiver.endpoint, args.trace_ratio)
        for round_no in range(1, args.rounds + 1):
            for arm in arm_order(round_no):
                system = f"pdserve-{arm}-r{round_no}"
                what = f"tracing {arm}" if args.tracing == "compare" else f"arm {arm}, untraced"
                with bench_systems.pdserve_cluster(args, out, envs[arm]) as url:
                    for workload in workloads:
                        print(f"  [round {round_no}/{args.rounds}, {what}] {workload} ...",
                              flush=True)  # fmt: skip
                        started = time.monotonic()
                        got = bench_systems.run_workload(
                            workload, system, url, args, model, name, out
                        )
                        results.setdefault(round_no, {}).setdefault(arm, {}).update(got)
                        print(f"  [round {round_no}, {what}] {workload} done in "
                              f"{time.monotonic() - started:.0f} s")  # fmt: skip
    finally:
        stats = receiver.close()
    # A control has no traced arm: both arms are checked as untraced ones.
    traced_arms = ("off", "on") if args.tracing == "compare" else ("off",)
    spans = tb.spans_by_arm(stats, traced_arms)
    leaked = 0 if "on" in spans else tb.spans_by_arm(stats, ("on",))["on"]["spans"]
    report = {
        "machine": info,
        "settings": {k: v for k, v in vars(args).items() if isinstance(v, str | int | float)},
        "tracing": {
            **tb.describe_tracing(args.tracing, args.trace_ratio, spans, None),
            "throughput": compare(results),
        },
    }
    (out / "tracing.json").write_text(json.dumps(report, indent=2))
    print_compare(report["tracing"]["throughput"])
    tb.print_spans(report["tracing"])
    print(f"results: {out / 'tracing.json'}")
    failed = report["tracing"]["throughput"]["all"]["failed"]
    if failed:
        print(f"error: {failed} requests failed (see the random-pdserve-*.log files)")
    if leaked:
        print(f"error: the control's second untraced arm exported {leaked} spans")
    return 1 if failed or leaked or tb.span_problems(spans) else 0


def print_compare(figures: dict[str, Any]) -> None:
    num = tb.num
    print("pdserve throughput, tracing off vs on (median over rounds of each round's on/off):")
    for label, f, per_round in tb.compared(figures):
        off, on = f["arms"]["off"], f["arms"]["on"]
        print(f"  {label}: {num(off.get('requests_per_s_median'), '.3f')} -> "
              f"{num(on.get('requests_per_s_median'), '.3f')} requests/s, on/off "
              f"{num(f['ratio_median'], '.3f')} (rounds: {per_round}); TTFT p50 "
              f"{num(off.get('ttft_p50_ms_median'), '.0f')} -> "
              f"{num(on.get('ttft_p50_ms_median'), '.0f')} ms, ITL p50 "
              f"{num(off.get('itl_p50_ms_median'), '.1f')} -> "
              f"{num(on.get('itl_p50_ms_median'), '.1f')} ms; failed {off['failed']} / "
              f"{on['failed']}")  # fmt: skip
    print(f"  all workloads: on/off {num(figures['all']['ratio_median'], '.3f')} "
          f"(median of {figures['all']['pairs']} pairs)")  # fmt: skip
