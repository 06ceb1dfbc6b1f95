"""Statistics, tables and plots of ``pdserve bench serve`` from ``vllm bench serve`` results.

Every figure is computed here from the per-request arrays vLLM's client saves
(``--save-detailed``: ``ttfts``, ``itls``, ``latencies``, ``start_times``, ``errors``), so the
two systems are measured by the same client and summarised by the same code.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)
Raw = dict[str, dict[str, dict[str, Any]]]  # label -> system -> vLLM's result


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (as numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Slo:
    """A request meets the SLO when its TTFT and its mean inter-token latency are within."""

    ttft_s: float
    tpot_s: float


def ok_requests(raw: dict[str, Any]) -> list[int]:
    errors = raw.get("errors") or [""] * len(raw.get("ttfts", []))
    return [i for i, err in enumerate(errors) if not err]


def tpot(itls: list[float]) -> float:
    return sum(itls) / len(itls) if itls else 0.0


def summarize(raw: dict[str, Any], slo: Slo | None) -> dict[str, Any]:
    """Percentiles (ms), throughput and goodput of one ``vllm bench serve`` result."""
    ok = ok_requests(raw)
    ttft = [raw["ttfts"][i] for i in ok]
    itl = [x for i in ok for x in raw["itls"][i]]
    e2e = [raw["latencies"][i] for i in ok]
    duration = float(raw["duration"])
    row: dict[str, Any] = {
        "completed": int(raw["completed"]),
        "failed": int(raw.get("failed", 0)),
        "duration_s": duration,
        "requests_per_s": float(raw["request_throughput"]),
        "output_tokens_per_s": float(raw["output_throughput"]),
    }
    for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in PERCENTILES:
            row[f"{name}_p{q}_ms"] = percentile(values, q) * 1000.0
    # Completed requests per second = requests in flight on average / mean E2E: whether a
    # system is slower because each request takes longer or because fewer were in flight (a
    # pipeline filling at the start and draining at the end).
    row["e2e_mean_ms"] = sum(e2e) / len(e2e) * 1000.0 if e2e else math.nan
    row["in_flight_mean"] = sum(e2e) / duration if duration > 0 else math.nan
    # The longest stall a stream saw: a monolith's prefill of a long prompt shows here even
    # when it is too rare to move p99.
    row["itl_max_ms"] = max(itl, default=math.nan) * 1000.0
    if slo is not None:
        good = sum(
            1 for i in ok if raw["ttfts"][i] <= slo.ttft_s and tpot(raw["itls"][i]) <= slo.tpot_s
        )
        row["goodput_requests_per_s"] = good / duration if duration > 0 else 0.0
        row["slo"] = {"ttft_ms": slo.ttft_s * 1000.0, "tpot_ms": slo.tpot_s * 1000.0}
    return row


def slo_from(raw: dict[str, Any]) -> Slo:
    """The default SLO: the baseline's own p90 TTFT and p90 per-request TPOT in this run, so
    goodput asks "how many requests/s are at least as good as the baseline's 90th"."""
    ok = ok_requests(raw)
    ttft = [raw["ttfts"][i] for i in ok]
    tpots = [tpot(raw["itls"][i]) for i in ok]
    return Slo(ttft_s=percentile(ttft, 90), tpot_s=percentile(tpots, 90))


COLUMNS = (
    ("req/s", "requests_per_s", "{:.3f}"),
    ("goodput", "goodput_requests_per_s", "{:.3f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.0f}"),
    ("p90", "ttft_p90_ms", "{:.0f}"),
    ("p99", "ttft_p99_ms", "{:.0f}"),
    ("ITL p50", "itl_p50_ms", "{:.1f}"),
    ("p90", "itl_p90_ms", "{:.1f}"),
    ("p99", "itl_p99_ms", "{:.1f}"),
    ("max", "itl_max_ms", "{:.0f}"),
    ("E2E p50", "e2e_p50_ms", "{:.0f}"),
    ("p99", "e2e_p99_ms", "{:.0f}"),
    ("mean", "e2e_mean_ms", "{:.0f}"),
    ("in flight", "in_flight_mean", "{:.2f}"),
    ("failed", "failed", "{}"),
)


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table: one row per (workload, system), latencies in ms."""
    head = ["workload", "system", *(c[0] for c in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        round_no = f" r{row['round']}" if "round" in row else ""
        cells = [row["workload"] + round_no, row["system"]]
        for _, key, fmt in COLUMNS:
            value = row.get(key)
            cells.append("-" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(rows: list[dict[str, Any]], system: str, baseline: str) -> list[dict[str, Any]]:
    """Per workload: throughput ratio (higher is better) and latency ratios baseline/system
    (above 1: the system is better by that factor)."""
    by = {(r["workload"], r["system"]): r for r in rows}
    out = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        ours, base = by.get((workload, system)), by.get((workload, baseline))
        if ours is None or base is None:
            continue
        entry: dict[str, Any] = {"workload": workload}
        entry["throughput"] = _div(ours["requests_per_s"], base["requests_per_s"])
        # throughput = in_flight x e2e_mean_better (see summarize)
        entry["in_flight"] = _div(ours["in_flight_mean"], base["in_flight_mean"])
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "itl_max_ms",
                    "e2e_mean_ms"):  # fmt: skip
            entry[key.replace("_ms", "_better")] = _div(base[key], ours[key])
        out.append(entry)
    return out


def median_ratios(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per workload, the median over rounds of each ratio of ``ratios`` and, with more than
    one round, every round's value in ``per_round``."""
    if len(rounds) == 1:
        return rounds[0]
    out = []
    for workload in dict.fromkeys(r["workload"] for ratios in rounds for r in ratios):
        entries = [r for ratios in rounds for r in ratios if r["workload"] == workload]
        keys = [k for k in entries[0] if k != "workload"]
        per_round = {k: [e[k] for e in entries] for k in keys}
        out.append({"workload": workload, **{k: median(v) for k, v in per_round.items()},
                    "per_round": per_round})  # fmt: skip
    return out


def times_text(ratios: dict[str, Any]) -> Callable[[str], str]:
    """A ratio of ``ratios`` as "x0.91", with every round's after it when there are several."""

    def text(key: str) -> str:
        rounds = ratios.get("per_round", {}).get(key)
        every = f" (rounds {', '.join(f'{v:.2f}' for v in rounds)})" if rounds else ""
        return f"x{ratios[key]:.2f}{every}"

    return text


def median(values: list[float]) -> float:
    """The median of the values that are numbers (NaN: none)."""
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return math.nan
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def build(
    rounds: list[tuple[Raw, dict[str, Any]]], info: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """``bench serve``'s report: rows per (workload, system) of every round (``round`` in each
    when there are several), the pdserve/vllm ratios per workload (several rounds: the median
    of each over the rounds, every round's in ``per_round``), pdserve's counters per round."""
    rows, per_round = [], []
    for r, (raw, _) in enumerate(rounds, 1):
        round_rows = [
            {"workload": label, "system": system, **({"round": r} if len(rounds) > 1 else {}),
             **summarize(result, _slo(args, by_system))}
            for label, by_system in raw.items()
            for system, result in by_system.items()
        ]  # fmt: skip
        rows += round_rows
        per_round.append(ratios(round_rows, "pdserve", "vllm"))
    counters = [c for _, c in rounds]
    return {
        "machine": info,
        "settings": {k: v for k, v in vars(args).items() if isinstance(v, str | int | float)},
        "rows": rows,
        "ratios": median_ratios(per_round),
        "pdserve_counters": counters[0] if len(counters) == 1 else counters,
    }


def _slo(args: argparse.Namespace, by_system: dict[str, Any]) -> Slo | None:
    """The SLO of goodput: the one given, else the monolith's own p90s in the same round."""
    if args.slo_ttft_ms and args.slo_tpot_ms:
        return Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    baseline = by_system.get("vllm")
    return None if baseline is None else slo_from(baseline)


def plotted(rounds: list[tuple[Raw, dict[str, Any]]]) -> Raw:
    """What the plots show: each system's results, one line per round when there are more."""
    if len(rounds) == 1:
        return rounds[0][0]
    lines: Raw = {}
    for r, (raw, _) in enumerate(rounds, 1):
        for label, by_system in raw.items():
            for system, result in by_system.items():
                lines.setdefault(label, {})[f"{system} r{r}"] = result
    return lines


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


def plot(results: dict[str, dict[str, dict[str, Any]]], out_dir: Path) -> list[Path]:
    """Per workload a PNG: TTFT and ITL CDFs, and ITL over time, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for workload, systems in results.items():
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        for system, raw in systems.items():
            ok = ok_requests(raw)
            ttft = sorted(raw["ttfts"][i] * 1000 for i in ok)
            itl = sorted(x * 1000 for i in ok for x in raw["itls"][i])
            for ax, values in ((axes[0], ttft), (axes[1], itl)):
                if values:
                    ys = [(k + 1) / len(values) for k in range(len(values))]
                    ax.plot(values, ys, label=system)
            times, gaps = _itl_timeline(raw, ok)
            axes[2].scatter(times, gaps, s=3, alpha=0.5, label=system)
        axes[0].set(title=f"{workload}: TTFT CDF", xlabel="ms", ylabel="fraction")
        axes[1].set(title=f"{workload}: ITL CDF", xlabel="ms", xscale="log")
        axes[2].set(title=f"{workload}: ITL over time", xlabel="s since start", ylabel="ms")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = out_dir / f"{workload}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def _itl_timeline(raw: dict[str, Any], ok: list[int]) -> tuple[list[float], list[float]]:
    """(time each token arrived, its inter-token gap in ms), time 0 = the first request."""
    starts = raw.get("start_times") or [0.0] * len(raw["ttfts"])
    t0 = min((starts[i] for i in ok), default=0.0)
    times, gaps = [], []
    for i in ok:
        t = starts[i] - t0 + raw["ttfts"][i]
        for gap in raw["itls"][i]:
            t += gap
            times.append(t)
            gaps.append(gap * 1000)
    return times, gaps
