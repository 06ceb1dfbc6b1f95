"""Where a disaggregated request's time goes before it decodes, from its traces:
``python -m pdserve.telemetry.trace_hops SPANS.json``.

``SPANS.json`` is a list of spans as ``python -m pdserve.telemetry.otlp_receiver --dump SPANS.json``
writes them (docs/observability.md lists the spans). Each hop runs from one span's start or
end to another's, within one request's trace; the table gives each hop's median, mean and
largest value over every request that took the disaggregated path (a trace with all the
spans below). Requests on the local path, tokenization calls and incomplete traces are
counted and left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from typing import Any

from pdserve.telemetry.otlp_receiver import load_dump

GATEWAY, PREFILL, DECODE = "pdserve-gateway", "pdserve-prefill", "pdserve-decode"
P_RPC, D_RPC = "pdserve.v1.PrefillWorker/Prefill", "pdserve.v1.DecodeWorker/Decode"
QUEUE, PROMPT, PULL = "engine.queue", "engine.prefill", "kv.pull"
# (what the hop is, from (service, span, "start" | "end"), to (service, span, edge)); the
# gateway's root span is named "" here
HOPS: tuple[tuple[str, tuple[str, str, str], tuple[str, str, str]], ...] = (
    ("gateway: request to Prefill call", (GATEWAY, "", "start"), (GATEWAY, "prefill", "start")),
    ("Prefill call reaches the engine", (PREFILL, P_RPC, "start"), (PREFILL, QUEUE, "start")),
    ("prefill engine: queue", (PREFILL, QUEUE, "start"), (PREFILL, QUEUE, "end")),
    ("prefill engine: prompt", (PREFILL, PROMPT, "start"), (PREFILL, PROMPT, "end")),
    ("prompt done to Decode call", (PREFILL, PROMPT, "end"), (DECODE, D_RPC, "start")),
    ("Decode call reaches the engine", (DECODE, D_RPC, "start"), (DECODE, QUEUE, "start")),
    ("decode engine: to the pull", (DECODE, QUEUE, "start"), (DECODE, PULL, "start")),
    ("KV pull", (DECODE, PULL, "start"), (DECODE, PULL, "end")),
    ("pull done to scheduled", (DECODE, PULL, "end"), (DECODE, QUEUE, "end")),
    ("decode engine: first step", (DECODE, PROMPT, "start"), (DECODE, PROMPT, "end")),
    ("request to its first step", (GATEWAY, "", "start"), (DECODE, PROMPT, "end")),
)
# The spans a trace needs for every hop: (service, name).
NEEDED = frozenset((service, name) for _, a, b in HOPS for service, name, _ in (a, b))


def _spans_by_name(trace: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(service, name) -> span; the gateway's root span under name ""."""
    found = {(s["service"], s["name"]): s for s in trace}
    ids = {s["span_id"] for s in trace}
    for s in trace:
        if s["service"] == GATEWAY and (s.get("parent_span_id") or "") not in ids:
            found[(GATEWAY, "")] = s
    return found


def hops(spans: list[dict[str, Any]]) -> tuple[dict[str, list[float]], int]:
    """Milliseconds of each hop, one value per disaggregated request; and the traces left
    out."""
    traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        traces[str(span.get("trace_id", ""))].append(span)
    values: dict[str, list[float]] = {label: [] for label, _, _ in HOPS}
    left_out = 0
    for trace in traces.values():
        named = _spans_by_name(trace)
        if not NEEDED.issubset(named):
            left_out += 1
            continue
        for label, (s1, n1, e1), (s2, n2, e2) in HOPS:
            start, end = named[(s1, n1)][f"{e1}_ns"], named[(s2, n2)][f"{e2}_ns"]
            values[label].append((end - start) / 1e6)
    return values, left_out


def table(values: dict[str, list[float]]) -> str:
    width = max(len(label) for label in values)
    lines = [f"{'hop':<{width}}  {'median':>8}  {'mean':>8}  {'max':>8}  (ms)"]
    for label, ms in values.items():
        if ms:
            lines.append(f"{label:<{width}}  {statistics.median(ms):8.1f}  "
                         f"{statistics.fmean(ms):8.1f}  {max(ms):8.1f}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.telemetry.trace_hops", description=__doc__.splitlines()[0]
    )
    parser.add_argument("spans", help="JSON list of spans (otlp_receiver --dump)")
    args = parser.parse_args(argv)
    spans = load_dump(args.spans)
    if spans is None:
        return 2
    values, left_out = hops(spans)
    requests = len(next(iter(values.values())))
    if not requests:
        print(f"no disaggregated request with every span in {args.spans} "
              f"({left_out} traces left out)", file=sys.stderr)  # fmt: skip
        return 1
    print(f"{requests} disaggregated requests ({left_out} other traces left out)")
    print(table(values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
