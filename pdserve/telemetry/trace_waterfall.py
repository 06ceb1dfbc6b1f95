"""Draw one trace as a waterfall PNG: ``python -m pdserve.telemetry.trace_waterfall SPANS.json
OUT.png``.

``SPANS.json`` is a list of spans, each an object with ``service``, ``name``, ``span_id``,
``parent_span_id`` ("" or an id not in the list: a root), ``start_ns``, ``end_ns`` and
``attributes`` (what ``tests/e2e/test_tracing.py`` writes with ``PDSERVE_TRACE_DUMP``). Rows
follow the span tree (children under their parent, by start time), one colour per service.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from typing import Any

from pdserve.telemetry.otlp_receiver import load_dump

COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")


def tree_order(spans: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(depth, span) depth-first, siblings by start time."""
    ids = {s["span_id"] for s in spans}
    kids: dict[str, list[dict[str, Any]]] = defaultdict(list)
    roots: list[dict[str, Any]] = []
    for s in spans:
        parent = s.get("parent_span_id") or ""
        (kids[parent] if parent in ids else roots).append(s)
    ordered: list[tuple[int, dict[str, Any]]] = []

    def visit(span: dict[str, Any], depth: int) -> None:
        ordered.append((depth, span))
        for child in sorted(kids[span["span_id"]], key=lambda c: c["start_ns"]):
            visit(child, depth + 1)

    for root in sorted(roots, key=lambda r: r["start_ns"]):
        visit(root, 0)
    return ordered


def _note(span: dict[str, Any]) -> str:
    a = span.get("attributes") or {}
    if "pdserve.kv.bytes" in a and span["name"] == "kv.pull":
        return f"{a.get('pdserve.kv.blocks', 0)} blocks, {a['pdserve.kv.bytes'] / 1e6:.2f} MB"
    if "pdserve.route.path" in a:
        return f"{a['pdserve.route.path']} -> {a.get('pdserve.route.prefill_worker')}, " + str(
            a.get("pdserve.route.decode_worker")
        )
    return ""


def draw(spans: list[dict[str, Any]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = tree_order(spans)
    t0 = min(s["start_ns"] for s in spans)
    services = sorted({s["service"] for s in spans})
    colour = {name: COLOURS[i % len(COLOURS)] for i, name in enumerate(services)}
    total_ms = (max(s["end_ns"] for s in spans) - t0) / 1e6
    fig, ax = plt.subplots(figsize=(12, 0.38 * len(rows) + 1.4))
    for row, (_, s) in enumerate(rows):
        start, width = (s["start_ns"] - t0) / 1e6, max((s["end_ns"] - s["start_ns"]) / 1e6, 0.0)
        ax.barh(row, max(width, total_ms / 600), left=start, color=colour[s["service"]])
        label = f"{width:.1f} ms  {_note(s)}".rstrip()
        ax.text(start + width + total_ms / 200, row, label, va="center", fontsize=8)
    labels = [f"{'  ' * depth}{s['name']}" for depth, s in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=8, family="monospace")
    # Left-aligned, so that the indentation shows the tree.
    width_pt = max(len(label) for label in labels) * 8 * 0.62
    ax.tick_params(axis="y", pad=width_pt + 4)
    for tick in ax.get_yticklabels():
        tick.set_horizontalalignment("left")
    ax.invert_yaxis()
    ax.set_xlim(0, total_ms * 1.3)
    ax.set_xlabel("ms since the request arrived at the gateway")
    trace_id = spans[0].get("trace_id", "")
    ax.set_title(f"one request's trace {trace_id}", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[n]) for n in services]
    ax.legend(handles, services, loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.telemetry.trace_waterfall", description=__doc__
    )
    parser.add_argument("spans", help="JSON list of one trace's spans")
    parser.add_argument("out", help="PNG to write")
    args = parser.parse_args(argv)
    spans = load_dump(args.spans)
    if spans is None:
        return 2
    if not spans:
        print(f"{args.spans} holds no spans", file=sys.stderr)
        return 2
    draw(spans, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
