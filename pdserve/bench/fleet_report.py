"""The figures of ``pdserve bench fleet``: the arithmetic from raw counters, the markdown table
and the plots against the number of workers.

Routing decision times are quantiles of the gateways' ``pdserve_gateway_route_seconds``
histogram over the run (its buckets' counts after minus before), linearly interpolated inside
the bucket as Prometheus's ``histogram_quantile``: exact to within one bucket (buckets step
0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 4, 5 ms and on).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.fleet_client import Turn

Buckets = list[tuple[float, float]]  # (upper bound, cumulative count), ascending, last +Inf


def parse_histogram(text: str, name: str) -> Buckets:
    """The cumulative buckets of histogram ``name`` in a Prometheus text exposition."""
    counts: dict[float, float] = {}
    prefix = f"{name}_bucket{{"
    for line in text.splitlines():
        if line.startswith(prefix):
            labels, value = line[len(prefix) :].rsplit("}", 1)
            le = labels.split('le="', 1)[1].split('"', 1)[0]
            bound = math.inf if le == "+Inf" else float(le)
            counts[bound] = counts.get(bound, 0.0) + float(value)
    return sorted(counts.items())


def bucket_delta(after: Buckets, before: Buckets) -> Buckets:
    old = dict(before)
    return [(le, count - old.get(le, 0.0)) for le, count in after]


def add_buckets(histograms: Iterable[Buckets]) -> Buckets:
    total: dict[float, float] = {}
    for buckets in histograms:
        for le, count in buckets:
            total[le] = total.get(le, 0.0) + count
    return sorted(total.items())


def histogram_quantile(buckets: Buckets, q: float) -> float | None:
    """The ``q`` quantile (0..1) of cumulative ``buckets``, linear inside its bucket; the
    highest finite bound when it lies beyond; None with no observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    low_bound, low_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > low_count:
            if math.isinf(le):
                return low_bound
            return low_bound + (le - low_bound) * (rank - low_count) / (count - low_count)
        low_bound, low_count = le, count
    return low_bound


def beyond(buckets: Buckets) -> float:
    """Observations above the highest finite bound (whose quantile says only "at least")."""
    finite = [count for le, count in buckets if not math.isinf(le)]
    return buckets[-1][1] - finite[-1] if finite else 0.0


def spread(counts: Counter[str] | dict[str, int], workers: Sequence[str]) -> float | None:
    """Max over ``workers`` of what each received / the fair share (the total / workers);
    1.0 is perfectly even. None when nothing was received."""
    total = sum(counts.get(w, 0) for w in workers)
    if not workers or not total:
        return None
    return max(counts.get(w, 0) for w in workers) / (total / len(workers))


def later_turns(turns: Sequence[Turn]) -> list[tuple[Turn, Turn]]:
    """(previous turn, turn) of every later turn that succeeded after a successful one."""
    by = {(t.conversation, t.turn): t for t in turns}
    pairs = []
    for t in turns:
        prev = by.get((t.conversation, t.turn - 1))
        if t.turn > 0 and t.ok and prev is not None and prev.ok:
            pairs.append((prev, t))
    return pairs


def holder_share(pairs: Sequence[tuple[Turn, Turn]]) -> float | None:
    """Share of later turns computed by the prefill worker that computed the previous turn
    (that worker holds the previous prompt's blocks)."""
    if not pairs:
        return None
    return sum(1 for prev, t in pairs if t.prefill and t.prefill == prev.prefill) / len(pairs)


def hit_share(pairs: Sequence[tuple[Turn, Turn]], block_size: int) -> float | None:
    """Share of later turns whose computing worker's cache served at least every full block
    of the previous prompt (the cached tokens the worker itself reported)."""
    if not pairs:
        return None
    hits = sum(
        1 for prev, t in pairs if t.cached_tokens >= prev.prompt_tokens // block_size * block_size
    )
    return hits / len(pairs)


def new_requests(turns: Sequence[Turn], role: str) -> Counter[str]:
    """New conversations (first turns) each worker of ``role`` received."""
    return Counter(getattr(t, role) for t in turns if t.ok and t.turn == 0)


def command_calls(commandstats: dict[str, Any]) -> dict[str, int]:
    """Calls per command from ``INFO commandstats`` (redis-py's parsed dict), the benchmark's
    own INFO calls left out."""
    return {
        key.removeprefix("cmdstat_"): int(v["calls"])
        for key, v in commandstats.items()
        if key.startswith("cmdstat_") and key != "cmdstat_info"
    }


def calls_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    return {k: v for k, v in sorted(delta.items()) if v}


def cpu_seconds(info_cpu: dict[str, Any]) -> float:
    return float(info_cpu["used_cpu_sys"]) + float(info_cpu["used_cpu_user"])


def ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def per(a: float | None, b: float) -> float | None:
    return None if a is None or not b else a / b


COLUMNS = (
    ("workers", "workers", "{}"),
    ("index pairs", "index_pairs", "{:,}"),
    ("requests", "requests", "{}"),
    ("failed", "failed", "{}"),
    ("req/s", "requests_per_s", "{:.1f}"),
    ("route p50 ms", "route_p50_ms", "{:.2f}"),
    ("route p99 ms", "route_p99_ms", "{:.2f}"),
    ("Redis cmds/req", "redis_commands_per_request", "{:.1f}"),
    ("beyond idle", "redis_request_commands_per_request", "{:.1f}"),
    ("Redis CPU ms/req", "redis_cpu_ms_per_request", "{:.3f}"),
    ("Redis CPU ms/req beyond idle", "redis_request_cpu_ms_per_request", "{:.3f}"),
    ("index B/pair", "index_bytes_per_pair", "{:.0f}"),
    ("idle cmds/s", "idle_commands_per_s", "{:.0f}"),
    ("holder share", "holder_share", "{:.3f}"),
    ("hit share", "hit_share", "{:.3f}"),
    ("spread", "spread", "{:.2f}"),
    ("gw CPU ms/req", "gateway_cpu_ms_per_request", "{:.2f}"),
    ("gw idle CPU", "gateway_idle_cpu_share", "{:.2f}"),
    ("gw CPU ms/req beyond idle", "gateway_request_cpu_ms_per_request", "{:.2f}"),
)


def table(points: Sequence[dict[str, Any]]) -> str:
    """One row per fleet size (totals over the gateways)."""
    lines = ["| " + " | ".join(c[0] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for point in points:
        cells = []
        for _, key, fmt in COLUMNS:
            value = point["total"].get(key, point.get(key))
            cells.append(_cell(value, fmt, key, point["total"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: Any, fmt: str, key: str, stats: dict[str, Any]) -> str:
    if value is None:
        return "-"
    if key == "route_p99_ms" and stats.get("route_over_100ms", 0) > 0.01 * stats["requests"]:
        return "> 100"  # beyond the histogram's last bound
    return fmt.format(value)


GATEWAY_COLUMNS = (
    ("requests", "requests", "{}"),
    ("route p50 ms", "route_p50_ms", "{:.2f}"),
    ("route p99 ms", "route_p99_ms", "{:.2f}"),
    ("holder share", "holder_share", "{:.3f}"),
    ("spread", "spread", "{:.2f}"),
    ("CPU ms/req", "gateway_cpu_ms_per_request", "{:.2f}"),
)


def gateway_table(points: Sequence[dict[str, Any]]) -> str:
    """One row per (fleet size, gateway replica)."""
    head = ["workers", "gateway", *(c[0] for c in GATEWAY_COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for point in points:
        for g, stats in enumerate(point["gateways"]):
            cells = [str(point["workers"]), str(g)]
            for _, key, fmt in GATEWAY_COLUMNS:
                cells.append(_cell(stats.get(key), fmt, key, stats))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


PLOTS = (
    ("route_p99_ms", "routing decision p99 (ms)"),
    ("route_p50_ms", "routing decision p50 (ms)"),
    ("redis_commands_per_request", "Redis commands per request"),
    ("redis_cpu_ms_per_request", "Redis CPU per request (ms)"),
    ("index_bytes_per_pair", "index bytes per block-holder pair"),
    ("idle_commands_per_s", "Redis commands/s, idle (heartbeats, discovery)"),
    ("holder_share", "later turns on their prefix's holder"),
    ("spread", "max new requests / fair share"),
    ("gateway_cpu_ms_per_request", "gateway CPU per request (ms)"),
)


def plot(points: Sequence[dict[str, Any]], path: Path) -> Path:
    """One PNG: each figure against the number of workers (total, and each gateway's where
    it has one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(15, 11))
    xs = [p["workers"] for p in points]
    for ax, (key, title) in zip(axes.flat, PLOTS, strict=True):
        ax.plot(xs, [p["total"].get(key) for p in points], "o-", label="total")
        replicas = max(len(p["gateways"]) for p in points)
        for g in range(replicas):
            ys = [p["gateways"][g].get(key) if g < len(p["gateways"]) else None for p in points]
            if any(y is not None for y in ys):
                ax.plot(xs, ys, "x--", alpha=0.7, label=f"gateway {g}")
        ax.set(title=title, xlabel="workers", xscale="log")
        ax.set_ylim(bottom=0)
        ax.minorticks_off()
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
