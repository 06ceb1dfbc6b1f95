"""docs/observability.md lists exactly the metrics the gateway exports, with their labels, and
the fields of the request log."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from gateway.metrics import GatewayMetrics
from gateway.request_log import FIELDS
from gateway.worker_metrics import COUNTERS, GAUGES, LABELS

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
ROW = re.compile(r"^\| `(pdserve_[a-z_]+)` \| (\w+) \|([a-z_, ]*)\|", re.MULTILINE)


def test_the_metric_table_matches_the_registry() -> None:
    rows = ROW.findall(DOC.read_text())
    documented = {name: (kind, labels.strip()) for name, kind, labels in rows}
    assert len(documented) == len(rows), "a metric is listed twice"
    exported = {
        m._name: (m._type, ", ".join(m._labelnames))
        for m in vars(GatewayMetrics()).values()
        if isinstance(m, MetricWrapperBase)
    }
    for suffix, _, _ in GAUGES:  # per-worker gauges, collected from the pool at scrape time
        exported[f"pdserve_gateway_worker_{suffix}"] = ("gauge", ", ".join(LABELS))
    for suffix, _, _ in COUNTERS:  # the workers' own counters (NIXL transfer statistics)
        exported[f"pdserve_gateway_worker_{suffix}"] = ("counter", ", ".join(LABELS))
    assert documented == exported


FIELD_ROW = re.compile(r"^\| `([a-z_]+)` \| ", re.MULTILINE)


def test_the_request_log_table_matches_its_fields() -> None:
    section = DOC.read_text().split("### One line per request", 1)[1].split("\n## ", 1)[0]
    assert FIELD_ROW.findall(section) == list(FIELDS)
