"""Goodput of ``pdserve bench goodput`` from ``vllm bench serve``'s per-request results.

One run per (system, request rate) is scored against every SLO scale afterwards: a request is
good when it did not fail, its TTFT is at most scale x the TTFT objective and its TPOT at most
scale x the TPOT objective; goodput is the good requests per second over the run's duration.
TPOT and the comparison are vLLM's own (``--goodput``; ``vllm/benchmarks/serve.py``,
``calculate_metrics``), so a figure here is what ``vllm bench serve --goodput`` would have
printed for that run with the scaled objectives.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pdserve.bench.report import Slo, median, percentile

SUMMARY_KEYS = ("ttft", "tpot", "itl")


def scale_key(scale: float) -> str:
    """How a scale names its figures in results.json ("0.5", "1", "1.5")."""
    return f"{scale:g}"


def failed(raw: dict[str, Any], i: int) -> bool:
    """Whether request ``i`` of a saved result failed. The file has no success flag: vLLM
    writes the error text, and 0 output tokens for every failed request (an empty HTTP reason
    phrase would leave the text empty, the count still 0)."""
    return bool(raw["errors"][i]) or not raw["output_lens"][i]


def ok(raw: dict[str, Any]) -> list[int]:
    """The requests of a saved result that did not fail."""
    return [i for i in range(len(raw["ttfts"])) if not failed(raw, i)]


def request_tpot(raw: dict[str, Any], i: int) -> float:
    """Request ``i``'s time per output token after the first, as vLLM's ``calculate_metrics``
    computes it for ``--goodput``: (E2E latency - TTFT) / (output tokens - 1), and 0 for an
    answer of one token ("if output_len <= 1, we regard tpot as 0 for goodput")."""
    tokens = raw["output_lens"][i]
    if tokens <= 1:
        return 0.0
    return float(raw["latencies"][i] - raw["ttfts"][i]) / (tokens - 1)


def good_requests(raw: dict[str, Any], slo: Slo) -> int:
    """Requests that did not fail and meet both objectives; at the objective counts as met
    (vLLM: ``all([s >= r ...])``)."""
    return sum(
        1 for i in ok(raw) if raw["ttfts"][i] <= slo.ttft_s and request_tpot(raw, i) <= slo.tpot_s
    )


def goodput(raw: dict[str, Any], slo: Slo, scale: float = 1.0) -> float:
    """Good requests per second over the run (vLLM's ``duration``: its first request sent to
    its last answer) against ``slo`` multiplied by ``scale``."""
    duration = float(raw["duration"])
    scaled = Slo(ttft_s=slo.ttft_s * scale, tpot_s=slo.tpot_s * scale)
    return good_requests(raw, scaled) / duration if duration > 0 else 0.0


def summarize_run(raw: dict[str, Any], slo: Slo, scales: list[float]) -> dict[str, Any]:
    """One run's figures: goodput at every scale, failures, throughput, and TTFT, TPOT (per
    request, vLLM's) and ITL p50/p99 in ms over the requests that did not fail."""
    good = ok(raw)
    series = {
        "ttft": [raw["ttfts"][i] for i in good],
        "tpot": [request_tpot(raw, i) for i in good if raw["output_lens"][i] > 1],
        "itl": [x for i in good for x in raw["itls"][i]],
    }
    row: dict[str, Any] = {
        "requests": len(raw["ttfts"]),
        "failed": len(raw["ttfts"]) - len(good),
        "duration_s": float(raw["duration"]),
        "requests_per_s": float(raw["request_throughput"]),
        "output_tokens_per_s": float(raw["output_throughput"]),
        "goodput": {scale_key(s): goodput(raw, slo, s) for s in scales},
    }
    for name in SUMMARY_KEYS:
        for q in (50, 99):
            row[f"{name}_p{q}_ms"] = percentile(series[name], q) * 1000.0
    return row


def median_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' rows of one (system, rate) as one: the median of every figure, the
    failures summed (one failed request anywhere stays visible), every round's goodput.
    What is not a figure (the names, pdserve's counters) stays in the runs only."""
    out: dict[str, Any] = {"rounds": len(rows), "failed": sum(r["failed"] for r in rows)}
    for key, value in rows[0].items():
        if key == "goodput":
            out[key] = {s: median([r[key][s] for r in rows]) for s in value}
        elif key not in out and key not in ("rate", "round") and isinstance(value, int | float):
            out[key] = median([r[key] for r in rows])
    if len(rows) > 1:
        out["goodput_per_round"] = {s: [r["goodput"][s] for r in rows] for s in rows[0]["goodput"]}
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


# ---- the report --------------------------------------------------------------------------
RATIOS = (("pdserve", "vllm"), ("pdserve", "pdserve-static"))
LATENCY_COLUMNS = (
    ("req/s", "requests_per_s", "{:.3f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.0f}"),
    ("p99", "ttft_p99_ms", "{:.0f}"),
    ("TPOT p50", "tpot_p50_ms", "{:.1f}"),
    ("p99", "tpot_p99_ms", "{:.1f}"),
    ("ITL p50", "itl_p50_ms", "{:.1f}"),
    ("p99", "itl_p99_ms", "{:.1f}"),
    ("failed", "failed", "{}"),
)


def rate_key(rate: float) -> str:
    return f"{rate:g}"


def medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """system -> rate -> the median over rounds of its runs (``median_rows``)."""
    grouped: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        grouped.setdefault(run["system"], {}).setdefault(rate_key(run["rate"]), []).append(run)
    return {
        system: {rate: median_rows(rows) for rate, rows in by_rate.items()}
        for system, by_rate in grouped.items()
    }


def _cell(value: float, fmt: str) -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else (fmt.format(value))
    )


def goodput_table(
    results: dict[str, dict[str, Any]], rates: list[float], scales: list[float]
) -> str:
    """Markdown: goodput (requests/s) per rate and SLO scale, one column per system, then the
    ratios of ``RATIOS`` (of the medians; "-" where the baseline's goodput is 0)."""
    systems = list(results)
    pairs = [(a, b) for a, b in RATIOS if a in results and b in results]
    head = ["rate", "SLO scale", *systems, *(f"{a}/{b}" for a, b in pairs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rate in map(rate_key, rates):
        for scale in map(scale_key, scales):
            cells = [rate, scale]
            value = {s: results[s][rate]["goodput"][scale] for s in systems}
            cells += [_cell(value[s], "{:.3f}") for s in systems]
            cells += [_cell(ratio(value[a], value[b]), "x{:.2f}") for a, b in pairs]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def latency_table(results: dict[str, dict[str, Any]], rates: list[float]) -> str:
    """Markdown: per rate and system, throughput, latencies (ms) and failed requests."""
    head = ["rate", "system", *(c[0] for c in LATENCY_COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rate in map(rate_key, rates):
        for system, by_rate in results.items():
            row = by_rate[rate]
            cells = [rate, system, *(_cell(row[key], fmt) for _, key, fmt in LATENCY_COLUMNS)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(
    results: dict[str, dict[str, Any]], rates: list[float], scales: list[float], out_dir: Path
) -> list[Path]:
    """Two PNGs: goodput against the request rate at the scale nearest 1, one line per system
    (and the offered rate, dashed: the most any system can reach); and goodput against the
    SLO scale, one panel per rate, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = scale_key(min(scales, key=lambda s: abs(s - 1.0)))
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for system, by_rate in results.items():
        ax.plot(rates, [by_rate[rate_key(r)]["goodput"][base] for r in rates], "o-", label=system)
    ax.plot(rates, rates, "k--", alpha=0.4, label="offered rate")
    ax.set(title=f"goodput at SLO scale {base}", xlabel="request rate (req/s)",
           ylabel="goodput (req/s)")  # fmt: skip
    paths = [_save(fig, ax, out_dir / "goodput_vs_rate.png")]
    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4.5), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        for system, by_rate in results.items():
            good = by_rate[rate_key(rate)]["goodput"]
            ax.plot(scales, [good[scale_key(s)] for s in scales], "o-", label=system)
        ax.set(title=f"rate {rate_key(rate)} req/s", xlabel="SLO scale", xscale="log",
               ylabel="goodput (req/s)")  # fmt: skip
        ax.set_xticks(scales, [scale_key(s) for s in scales])
        ax.minorticks_off()  # the log axis's own labels would overprint the scales
    paths.append(_save(fig, axes[0][-1], out_dir / "goodput_vs_slo_scale.png"))
    return paths


def _save(fig: Any, legend_ax: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    for ax in fig.axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    legend_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
